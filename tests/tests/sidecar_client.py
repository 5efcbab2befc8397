#!/usr/bin/env python3
"""Checking clients for the sidecar lab tests (tests/tests/sidecar_lab.rs).

Every mode verifies each response against what the request asked for, so a
lost, duplicated, reordered or corrupted response fails the run:

  files DIR                      write the HTTP test files f0.bin..f9.bin
  http HOST PORT                 keep-alive, pipelined GETs; bodies compared byte for byte
  resp HOST PORT                 pipelined ECHO of unique payloads; replies compared
  resp-oversize HOST PORT BYTES  one command larger than the sidecar's limit
  resp-dies HOST PORT WAITFILE   PING, wait for WAITFILE (the app is killed), PING again

Options: --conns N --rounds N --depth N --tls CAFILE --slow (send in small
pieces with pauses, so requests and TLS records straddle segments and
migrations) --seconds S (rounds until S seconds passed, after --rounds).
Prints `ok ...` and `port=P` lines; exits 1 with a message on any mismatch.
"""

import argparse
import hashlib
import os
import random
import socket
import ssl
import sys
import threading
import time

SIZES = [100, 1000, 10_000, 100_000, 300_000]


def content(k):
    seed = hashlib.sha256(b"file%d" % k).digest()
    size = SIZES[k % len(SIZES)]
    reps = size // len(seed) + 1
    return (seed * reps)[:size]


class BioTls:
    """TLS over memory BIOs: the client controls the ciphertext stream, so
    with `slow` every record reaches the server in small pieces over time
    and migrations land in the middle of records."""

    def __init__(self, sock, ctx, host, slow):
        self.sock, self.slow = sock, slow
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.inc, self.out, server_hostname=host)
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.flush()
                self.pull()
        self.flush()

    def pull(self):
        d = self.sock.recv(65536)
        if not d:
            raise EOFError("connection closed by the server")
        self.inc.write(d)

    def flush(self):
        d = self.out.read()
        i = 0
        while i < len(d):
            n = random.randint(50, 1500) if self.slow else len(d)
            self.sock.sendall(d[i:i + n])
            i += n
            if self.slow:
                time.sleep(0.0003)

    def sendall(self, data):
        self.obj.write(data)
        self.flush()

    def recv(self, n):
        while True:
            try:
                return self.obj.read(n)
            except ssl.SSLWantReadError:
                self.flush()
                try:
                    self.pull()
                except EOFError:
                    return b""
            except ssl.SSLZeroReturnError:
                return b""

    def getsockname(self):
        return self.sock.getsockname()

    def close(self):
        self.sock.close()


def connect(a):
    s = socket.create_connection((a.host, a.port), timeout=20)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if a.tls:
        ctx = ssl.create_default_context(cafile=a.tls)
        return BioTls(s, ctx, a.host, a.slow)
    return s


class Reader:
    def __init__(self, s):
        self.s = s
        self.buf = b""

    def fill(self):
        d = self.s.recv(65536)
        if not d:
            raise EOFError("connection closed by the server")
        self.buf += d

    def line(self):
        while b"\r\n" not in self.buf:
            self.fill()
        i = self.buf.index(b"\r\n")
        l, self.buf = self.buf[:i], self.buf[i + 2:]
        return l

    def exact(self, n):
        while len(self.buf) < n:
            self.fill()
        d, self.buf = self.buf[:n], self.buf[n:]
        return d


def send(s, data, slow):
    if not slow or isinstance(s, BioTls):
        s.sendall(data)
        return
    i = 0
    while i < len(data):
        n = random.choice([700, 1500, 5000, 20000])
        s.sendall(data[i:i + n])
        i += n
        time.sleep(0.0005)


def http_conn(a, cid, out):
    rng = random.Random(cid)
    s = connect(a)
    out["port"].append(s.getsockname()[1])
    r = Reader(s)
    n = 0
    deadline = time.time() + a.seconds
    rounds = 0
    while rounds < a.rounds or time.time() < deadline:
        rounds += 1
        ks = [rng.randrange(10) for _ in range(a.depth)]
        req = b"".join(b"GET /f%d.bin HTTP/1.1\r\nHost: t\r\n\r\n" % k for k in ks)
        send(s, req, a.slow)
        for k in ks:
            status = r.line()
            if not status.startswith(b"HTTP/1.1 200"):
                raise AssertionError(f"conn {cid}: status {status!r} for f{k}")
            length = None
            while True:
                h = r.line()
                if not h:
                    break
                name, _, value = h.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = r.exact(length)
            if body != content(k):
                raise AssertionError(f"conn {cid}: wrong body for f{k} ({len(body)} bytes)")
            n += 1
    s.close()
    out["n"].append(n)


def resp_conn(a, cid, out):
    rng = random.Random(1000 + cid)
    s = connect(a)
    out["port"].append(s.getsockname()[1])
    r = Reader(s)
    n = 0
    deadline = time.time() + a.seconds
    rounds = 0
    while rounds < a.rounds or time.time() < deadline:
        rounds += 1
        payloads = []
        for i in range(a.depth):
            if a.small:
                size = rng.choice([8, 30, 200])
            else:
                size = rng.choice([8, 30, 200, 3000]) if rng.random() < 0.9 else rng.choice([20_000, 70_000])
            tag = b"c%d-r%d-i%d-" % (cid, rounds, i)
            body = (tag * (size // len(tag) + 1))[:max(size, len(tag))]
            payloads.append(body)
        req = b"".join(b"*2\r\n$4\r\nECHO\r\n$%d\r\n%s\r\n" % (len(p), p) for p in payloads)
        send(s, req, a.slow)
        for p in payloads:
            l = r.line()
            if not l.startswith(b"$"):
                raise AssertionError(f"conn {cid}: reply {l[:100]!r} to ECHO of {len(p)} bytes")
            body = r.exact(int(l[1:]) + 2)[:-2]
            if body != p:
                raise AssertionError(f"conn {cid}: ECHO reply differs ({len(body)} vs {len(p)} bytes)")
            n += 1
        if a.think:
            time.sleep(a.think / 1000)
    s.close()
    out["n"].append(n)


def sum_conn(a, cid, out):
    rng = random.Random(2000 + cid)
    s = connect(a)
    out["port"].append(s.getsockname()[1])
    r = Reader(s)
    total, n = 0, 0
    deadline = time.time() + a.seconds
    rounds = 0
    while rounds < a.rounds or time.time() < deadline:
        rounds += 1
        nums = [rng.randrange(10 ** rng.randint(1, 9)) for _ in range(rng.randint(1, 8))]
        data = b"".join(b"%d\n" % x for x in nums)
        # Split anywhere, even inside a number, with pauses between pieces.
        i = 0
        while i < len(data):
            k = rng.randint(1, 6)
            s.sendall(data[i:i + k])
            i += k
            if a.slow:
                time.sleep(0.0005)
        for x in nums:
            total += x
            while b"\n" not in r.buf:
                r.fill()
            j = r.buf.index(b"\n")
            l, r.buf = r.buf[:j], r.buf[j + 1:]
            if int(l) != total:
                raise AssertionError(f"conn {cid}: sum {l!r}, expected {total}")
            n += 1
    s.close()
    out["n"].append(n)


def run_many(a, fn):
    out = {"n": [], "port": [], "err": []}

    def wrap(cid):
        try:
            fn(a, cid, out)
        except Exception as e:  # reported below, fails the run
            out["err"].append(f"{type(e).__name__}: {e}")

    ts = [threading.Thread(target=wrap, args=(c,)) for c in range(a.conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for p in out["port"]:
        print(f"port={p}")
    if out["err"]:
        print("FAILED: " + "; ".join(out["err"][:5]))
        sys.exit(1)
    print(f"ok responses={sum(out['n'])} connections={a.conns}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("args", nargs="*")
    p.add_argument("--conns", type=int, default=1)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--seconds", type=float, default=0)
    p.add_argument("--tls")
    p.add_argument("--slow", action="store_true")
    p.add_argument("--small", action="store_true")
    p.add_argument("--think", type=float, default=0, help="ms between rounds")
    a = p.parse_args()
    if a.mode == "files":
        for k in range(10):
            with open(os.path.join(a.args[0], "f%d.bin" % k), "wb") as f:
                f.write(content(k))
        return
    a.host, a.port = a.args[0], int(a.args[1])
    if a.mode == "http":
        run_many(a, http_conn)
    elif a.mode == "resp":
        run_many(a, resp_conn)
    elif a.mode == "sum":
        run_many(a, sum_conn)
    elif a.mode == "resp-oversize":
        s = connect(a)
        n = int(a.args[2])
        try:
            s.sendall(b"*2\r\n$4\r\nECHO\r\n$%d\r\n" % n + b"x" * n + b"\r\n")
        except OSError:
            pass  # the server may close before taking it all
        r = Reader(s)
        try:
            l = r.line()
            print(f"reply={l.decode(errors='replace')}")
        except (EOFError, OSError) as e:
            print(f"closed={e}")
    elif a.mode == "resp-dies":
        s = connect(a)
        r = Reader(s)
        s.sendall(b"PING\r\n")
        assert r.line() == b"+PONG", "no PONG before the kill"
        print("ready", flush=True)
        while not os.path.exists(a.args[2]):
            time.sleep(0.05)
        try:
            s.sendall(b"PING\r\n")
            l = r.line()
            print(f"reply={l.decode(errors='replace')}")
        except (EOFError, OSError) as e:
            print(f"closed={e}")
    else:
        sys.exit(f"unknown mode {a.mode}")


if __name__ == "__main__":
    main()
