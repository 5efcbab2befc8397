#!/usr/bin/env python3
"""Tiny TCP relay for `make demo`: listens on LISTEN (IP:PORT) in the
namespace it is started in (the root one), then enters the network
namespace NETNS (a path such as /run/netns/demo-sw) and connects every
accepted connection to TARGET (IP:PORT) there, e.g. the API on that
namespace's loopback. Nothing else is reachable through it.

usage: demo-relay.py LISTEN NETNS TARGET
"""
import ctypes
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def addr(s):
    host, port = s.rsplit(":", 1)
    return host, int(port)


def pump(src, dst):
    try:
        while True:
            b = src.recv(65536)
            if not b:
                break
            dst.sendall(b)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def serve(client, target):
    try:
        upstream = socket.create_connection(target, timeout=5)
        upstream.settimeout(None)
    except OSError as e:
        print(f"demo-relay: cannot reach {target}: {e}", file=sys.stderr)
        client.close()
        return
    t = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    t.start()
    pump(client, upstream)
    t.join()
    client.close()
    upstream.close()


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    listen, netns, target = addr(sys.argv[1]), sys.argv[2], addr(sys.argv[3])
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(listen)
    ls.listen(128)
    # The listening socket stays in the namespace it was created in; every
    # socket created from now on lives in NETNS.
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(netns, os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        sys.exit(f"demo-relay: setns {netns}: {os.strerror(ctypes.get_errno())}")
    os.close(fd)
    print(f"demo-relay: {sys.argv[1]} -> {sys.argv[3]} in {netns}", flush=True)
    while True:
        c, _ = ls.accept()
        threading.Thread(target=serve, args=(c, target), daemon=True).start()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
