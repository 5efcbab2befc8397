//! Export+import latency of one established TCP connection with a few KiB
//! in each queue, two ways in the same run (seed 000 §8.3.1, Table 2):
//!
//! - **ours**: `Endpoint::export` (snapshot + silent removal) on one
//!   endpoint, `Endpoint::import` on another, ping-pong between the two.
//!   One iteration is too short for `Instant` (~20-30 ns per read), so
//!   samples are batches of `BATCH` iterations, each divided by `BATCH`;
//!   housekeeping (draining accept/event/ready queues) runs between batches,
//!   outside the timing.
//! - **linux**: the Prism/CRIU procedure on a real kernel connection over
//!   loopback: dump with TCP_REPAIR (queue seqs, peek of both queues, window,
//!   TCP_INFO/MSS/timestamp), close the socket silently (repair mode), then
//!   restore into a fresh socket (repair on, queue seqs, bind+connect in
//!   repair mode, options, queues, window, repair off). The restored socket
//!   is the next iteration's source. Needs CAP_NET_ADMIN.
//!
//! Also measured, ours only: the empty established connection (177-byte
//! snapshot in format version 2, the paper's "default TCP state") and the copy floor, the time
//! the four queue copies alone take (no encoding can go below it), both
//! done as the snapshot code does them (`copy_queue_bytes`, 2 KiB pieces)
//! and as one libc memcpy per queue.
//!
//! Last line: `RESULT ours_p50_ns=.. ours_p99_ns=.. linux_p50_ns=.. linux_p99_ns=.. speedup_p50=..
//! ours_empty_p50_ns=.. copy_floor_ns=.. memcpy_floor_ns=..`.
//! Usage: `capybara-bench-export-import [--iterations N] [--queue-bytes N]
//! [--ours-only]` (`--ours-only`: the main case of ours alone, for profilers).

use std::hint::black_box;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Instant as WallInstant;

use capybara_tcp::snapshot::copy_queue_bytes;
use capybara_tcp::{ConnId, Duration, Endpoint, Instant, Snapshot, State, TcpConfig};

const BATCH: usize = 16;

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

// ---------------------------------------------------------------- ours

/// Delivers everything `from` wants to send to `to`.
fn pump(now: Instant, from: &mut Endpoint, to: &mut Endpoint, drop_all: bool) {
    let mut buf = [0u8; 1600];
    while let Some(t) = from.poll_transmit(now, &mut buf) {
        if !drop_all {
            to.handle_segment(now, t.src, t.dst, &buf[..t.len]);
        }
    }
}

/// A server connection in ESTABLISHED with `q` unread bytes in its receive
/// queue and `q` bytes in its send queue (half sent and unacknowledged).
fn build_connection(q: usize) -> (Endpoint, ConnId, Instant) {
    let vip = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 1), 80);
    let mut client = Endpoint::new(TcpConfig::default());
    let mut server = Endpoint::new(TcpConfig::default());
    server.listen(vip).unwrap();
    let mut now = Instant::from_millis(1000);
    let c = client
        .connect(
            now,
            SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 11), 0),
            vip,
        )
        .unwrap();
    let mut s = None;
    for _ in 0..10 {
        now += Duration::from_millis(5);
        pump(now, &mut client, &mut server, false);
        pump(now, &mut server, &mut client, false);
        s = s.or_else(|| server.accept());
    }
    let s = s.expect("handshake");
    assert_eq!(client.state(c), Some(State::Established));
    let data: Vec<u8> = (0..q).map(|i| (i * 7 + 3) as u8).collect();
    client.send(c, &data).unwrap();
    now += Duration::from_millis(5);
    pump(now, &mut client, &mut server, false);
    // Half of the server's data goes out (and is lost: stays unacked).
    server.send(s, &data[..q / 2]).unwrap();
    pump(now, &mut server, &mut client, true);
    server.send(s, &data[q / 2..]).unwrap();
    let conn = server.connection(s).unwrap();
    assert_eq!(conn.rx.len(), q);
    assert_eq!(conn.tx.len(), q);
    assert!(q == 0 || conn.unacked() > 0);
    (server, s, now)
}

fn drain(ep: &mut Endpoint, now: Instant) {
    while ep.accept().is_some() {}
    while ep.poll_event().is_some() {}
    // Only stale ids of exported connections are left in the ready queue.
    let mut buf = [0u8; 1600];
    while ep.poll_transmit(now, &mut buf).is_some() {}
}

struct Ours {
    samples: Vec<u64>,
    snapshot_len: usize,
    empty_len: usize,
    export_only: Vec<u64>,
    parse_only: Vec<u64>,
}

fn bench_ours(iterations: usize, q: usize) -> Ours {
    let (mut a0, mut id, mut now) = build_connection(q);
    let mut b0 = Endpoint::new(a0.config().clone());
    // The ping-pong swaps these references, not the endpoints: moving two
    // ~2.6 KB `Endpoint`s per iteration (as this harness did before
    // 2026-11-22 19:00 UTC) is not export+import work.
    let (mut a, mut b) = (&mut a0, &mut b0);
    a.set_spare_buffers(2);
    b.set_spare_buffers(2);
    let mut buf = vec![0u8; 4 * q + 1024];
    let app = [0u8; 0];
    let snapshot_len = a.snapshot_len(now, id, 0).unwrap();
    let empty_len = {
        let (e, eid, enow) = build_connection(0);
        e.snapshot_len(enow, eid, 0).unwrap()
    };
    let batches = iterations.div_ceil(BATCH);
    let warm = batches / 10 + 10;
    let mut samples = Vec::with_capacity(batches);
    // `a` holds the connection at the start of each ping-pong step.
    for k in 0..warm + batches {
        let t0 = WallInstant::now();
        for _ in 0..BATCH {
            now += Duration::from_micros(1);
            let n = a.export(now, id, &app, &mut buf).unwrap();
            let imp = b.import(now, &buf[..n]).unwrap();
            id = imp.id;
            std::mem::swap(&mut a, &mut b);
        }
        let dt = t0.elapsed().as_nanos() as u64;
        if k >= warm {
            samples.push(dt / BATCH as u64);
        }
        drain(a, now);
        drain(b, now);
        black_box(&buf);
    }
    let st = a.connection(id).unwrap();
    assert_eq!(
        (st.rx.len(), st.tx.len(), st.state),
        (q, q, State::Established),
        "state survived the ping-pong"
    );

    // Export alone (import is outside the timing), for the breakdown.
    let mut export_only = Vec::with_capacity(2000);
    for _ in 0..2000 {
        now += Duration::from_micros(1);
        let t0 = WallInstant::now();
        let n = a.export(now, id, &app, &mut buf).unwrap();
        let dt = t0.elapsed().as_nanos() as u64;
        export_only.push(dt);
        id = b.import(now, &buf[..n]).unwrap().id;
        std::mem::swap(&mut a, &mut b);
        drain(a, now);
        drain(b, now);
    }
    // Parse alone (validation, no endpoint), same batching as above.
    let n = a.export(now, id, &app, &mut buf).unwrap();
    let mut parse_only = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let t0 = WallInstant::now();
        for _ in 0..BATCH {
            black_box(Snapshot::parse_bytes(black_box(&buf[..n])).is_ok());
        }
        parse_only.push(t0.elapsed().as_nanos() as u64 / BATCH as u64);
    }
    samples.sort_unstable();
    export_only.sort_unstable();
    parse_only.sort_unstable();
    Ours {
        samples,
        snapshot_len,
        empty_len,
        export_only,
        parse_only,
    }
}

/// The part of an export+import no encoding can avoid: copying both
/// queues out of the origin's rings into the snapshot and back into the
/// target's rings (4 x `q` bytes, the snapshot's queue bytes at the same
/// unaligned offsets as in the real run). Same batching as `bench_ours`.
/// `pieces`: copy as the snapshot code does (`copy_queue_bytes`, 2 KiB
/// pieces); otherwise one `copy_from_slice` (libc memcpy) per queue.
fn copy_floor(iterations: usize, q: usize, at: usize, pieces: bool) -> u64 {
    let mut rings = [
        vec![1u8; q.max(1)],
        vec![2u8; q.max(1)],
        vec![0u8; q.max(1)],
        vec![0u8; q.max(1)],
    ];
    let mut snap = vec![0u8; at + 2 * q + 16];
    let batches = iterations.div_ceil(BATCH);
    let mut samples = Vec::with_capacity(batches);
    for _ in 0..batches {
        let t0 = WallInstant::now();
        for _ in 0..BATCH {
            let (from, to) = rings.split_at_mut(2);
            let copy = |d: &mut [u8], s: &[u8]| {
                if pieces {
                    copy_queue_bytes(d, s)
                } else {
                    d.copy_from_slice(s)
                }
            };
            copy(&mut snap[at..at + q], &from[0][..q]);
            copy(&mut snap[at + q + 2..at + 2 * q + 2], &from[1][..q]);
            copy(&mut to[0][..q], &snap[at..at + q]);
            copy(&mut to[1][..q], &snap[at + q + 2..at + 2 * q + 2]);
            rings.swap(0, 2);
            rings.swap(1, 3);
            black_box(&mut snap);
        }
        samples.push(t0.elapsed().as_nanos() as u64 / BATCH as u64);
    }
    samples.sort_unstable();
    percentile(&samples, 0.5)
}

// ---------------------------------------------------------------- linux

mod linux {
    use std::io;
    use std::mem::size_of;
    use std::net::SocketAddrV4;
    use std::time::Instant as WallInstant;

    use libc::{c_int, c_void, sockaddr_in, socklen_t};

    const TCP_REPAIR: c_int = 19;
    const TCP_REPAIR_QUEUE: c_int = 20;
    const TCP_QUEUE_SEQ: c_int = 21;
    const TCP_REPAIR_OPTIONS: c_int = 22;
    const TCP_TIMESTAMP: c_int = 24;
    const TCP_REPAIR_WINDOW: c_int = 29;
    const TCP_RECV_QUEUE: c_int = 1;
    const TCP_SEND_QUEUE: c_int = 2;
    const TCP_REPAIR_ON: c_int = 1;
    /// Leave repair mode without sending a window probe.
    const TCP_REPAIR_OFF_NO_WP: c_int = -1;
    const TCPOPT_MSS: u32 = 2;
    const TCPOPT_WINDOW: u32 = 3;
    const TCPOPT_SACK_PERM: u32 = 4;
    const TCPOPT_TIMESTAMP: u32 = 8;
    const TCPI_OPT_TIMESTAMPS: u8 = 1;
    const TCPI_OPT_SACK: u8 = 2;
    const TCPI_OPT_WSCALE: u8 = 4;
    const SIOCINQ: libc::c_ulong = 0x541B;
    const SIOCOUTQ: libc::c_ulong = 0x5411;

    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    struct RepairWindow {
        snd_wl1: u32,
        snd_wnd: u32,
        max_window: u32,
        rcv_wnd: u32,
        rcv_wup: u32,
    }

    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    struct RepairOpt {
        code: u32,
        val: u32,
    }

    /// Everything dumped from one socket (buffers reused across iterations).
    #[derive(Default)]
    pub struct Dump {
        local: Option<SocketAddrV4>,
        remote: Option<SocketAddrV4>,
        inq_seq: u32,
        outq_seq: u32,
        pub inq: Vec<u8>,
        pub outq: Vec<u8>,
        window: RepairWindow,
        mss: u32,
        timestamp: u32,
        options: u8,
        snd_wscale: u8,
        rcv_wscale: u8,
    }

    fn cvt(r: c_int, what: &str) -> io::Result<c_int> {
        if r < 0 {
            let e = io::Error::last_os_error();
            Err(io::Error::new(e.kind(), format!("{what}: {e}")))
        } else {
            Ok(r)
        }
    }

    fn set<T>(fd: c_int, opt: c_int, v: &T, what: &str) -> io::Result<()> {
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                opt,
                v as *const T as *const c_void,
                size_of::<T>() as socklen_t,
            )
        };
        cvt(r, what).map(|_| ())
    }

    fn get<T: Copy>(fd: c_int, opt: c_int, v: &mut T, what: &str) -> io::Result<()> {
        let mut len = size_of::<T>() as socklen_t;
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                opt,
                v as *mut T as *mut c_void,
                &mut len,
            )
        };
        cvt(r, what).map(|_| ())
    }

    fn sin(a: SocketAddrV4) -> sockaddr_in {
        sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a.ip()).to_be(),
            },
            sin_zero: [0; 8],
        }
    }

    fn from_sin(s: &sockaddr_in) -> SocketAddrV4 {
        SocketAddrV4::new(
            u32::from_be(s.sin_addr.s_addr).into(),
            u16::from_be(s.sin_port),
        )
    }

    fn name(fd: c_int, peer: bool) -> io::Result<SocketAddrV4> {
        let mut s: sockaddr_in = unsafe { std::mem::zeroed() };
        let mut len = size_of::<sockaddr_in>() as socklen_t;
        let p = &mut s as *mut sockaddr_in as *mut libc::sockaddr;
        let r = unsafe {
            if peer {
                libc::getpeername(fd, p, &mut len)
            } else {
                libc::getsockname(fd, p, &mut len)
            }
        };
        cvt(r, "getsockname/getpeername")?;
        Ok(from_sin(&s))
    }

    fn ioctl_len(fd: c_int, req: libc::c_ulong) -> io::Result<usize> {
        let mut n: c_int = 0;
        cvt(
            unsafe { libc::ioctl(fd, req, &mut n) },
            "ioctl SIOCINQ/SIOCOUTQ",
        )?;
        Ok(n as usize)
    }

    fn peek_queue(fd: c_int, q: c_int, len: usize, out: &mut Vec<u8>) -> io::Result<u32> {
        set(fd, TCP_REPAIR_QUEUE, &q, "TCP_REPAIR_QUEUE")?;
        let mut seq: u32 = 0;
        get(fd, TCP_QUEUE_SEQ, &mut seq, "TCP_QUEUE_SEQ")?;
        out.resize(len, 0);
        let mut got = 0;
        while got < len {
            let r = unsafe {
                libc::recv(
                    fd,
                    out[got..].as_mut_ptr() as *mut c_void,
                    len - got,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            let r = cvt(r as c_int, "recv(MSG_PEEK) of a repair queue")? as usize;
            if r == 0 {
                break;
            }
            // MSG_PEEK always starts at the queue head: one call must do.
            got = r;
            if got < len {
                return Err(io::Error::other(format!("short peek {got} of {len}")));
            }
        }
        Ok(seq)
    }

    /// Dump (TCP_REPAIR on, both queues with their seqs, window, options)
    /// then close silently: the export half of a Prism-style migration.
    pub fn dump_and_close(fd: c_int, d: &mut Dump) -> io::Result<()> {
        set(fd, TCP_REPAIR, &TCP_REPAIR_ON, "TCP_REPAIR on")?;
        d.local = Some(name(fd, false)?);
        d.remote = Some(name(fd, true)?);
        let inq = ioctl_len(fd, SIOCINQ)?;
        let outq = ioctl_len(fd, SIOCOUTQ)?;
        d.inq_seq = peek_queue(fd, TCP_RECV_QUEUE, inq, &mut d.inq)?;
        d.outq_seq = peek_queue(fd, TCP_SEND_QUEUE, outq, &mut d.outq)?;
        get(fd, TCP_REPAIR_WINDOW, &mut d.window, "TCP_REPAIR_WINDOW")?;
        get(fd, libc::TCP_MAXSEG, &mut d.mss, "TCP_MAXSEG")?;
        get(fd, TCP_TIMESTAMP, &mut d.timestamp, "TCP_TIMESTAMP")?;
        let mut info = [0u8; 232];
        let mut len = info.len() as socklen_t;
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                info.as_mut_ptr() as *mut c_void,
                &mut len,
            )
        };
        cvt(r, "TCP_INFO")?;
        d.options = info[5];
        d.snd_wscale = info[6] & 0x0f;
        d.rcv_wscale = info[6] >> 4;
        // In repair mode close() neither sends FIN nor RST.
        cvt(unsafe { libc::close(fd) }, "close")?;
        Ok(())
    }

    /// Restore into a fresh socket: the import half.
    pub fn restore(d: &Dump) -> io::Result<c_int> {
        let fd = cvt(
            unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) },
            "socket",
        )?;
        let r = (|| {
            set(fd, TCP_REPAIR, &TCP_REPAIR_ON, "TCP_REPAIR on")?;
            let q = TCP_RECV_QUEUE;
            set(fd, TCP_REPAIR_QUEUE, &q, "TCP_REPAIR_QUEUE recv")?;
            let seq = d.inq_seq.wrapping_sub(d.inq.len() as u32);
            set(fd, TCP_QUEUE_SEQ, &seq, "TCP_QUEUE_SEQ recv")?;
            let q = TCP_SEND_QUEUE;
            set(fd, TCP_REPAIR_QUEUE, &q, "TCP_REPAIR_QUEUE send")?;
            let seq = d.outq_seq.wrapping_sub(d.outq.len() as u32);
            set(fd, TCP_QUEUE_SEQ, &seq, "TCP_QUEUE_SEQ send")?;
            let local = sin(d.local.unwrap());
            let remote = sin(d.remote.unwrap());
            let sl = size_of::<sockaddr_in>() as socklen_t;
            cvt(
                unsafe {
                    libc::bind(
                        fd,
                        &local as *const sockaddr_in as *const libc::sockaddr,
                        sl,
                    )
                },
                "bind",
            )?;
            cvt(
                unsafe {
                    libc::connect(
                        fd,
                        &remote as *const sockaddr_in as *const libc::sockaddr,
                        sl,
                    )
                },
                "connect (repair)",
            )?;
            let mut opts = [RepairOpt { code: 0, val: 0 }; 4];
            let mut n = 0;
            opts[n] = RepairOpt {
                code: TCPOPT_MSS,
                val: d.mss,
            };
            n += 1;
            if d.options & TCPI_OPT_WSCALE != 0 {
                opts[n] = RepairOpt {
                    code: TCPOPT_WINDOW,
                    val: u32::from(d.snd_wscale) | (u32::from(d.rcv_wscale) << 16),
                };
                n += 1;
            }
            if d.options & TCPI_OPT_SACK != 0 {
                opts[n] = RepairOpt {
                    code: TCPOPT_SACK_PERM,
                    val: 0,
                };
                n += 1;
            }
            if d.options & TCPI_OPT_TIMESTAMPS != 0 {
                opts[n] = RepairOpt {
                    code: TCPOPT_TIMESTAMP,
                    val: 0,
                };
                n += 1;
            }
            let r = unsafe {
                libc::setsockopt(
                    fd,
                    libc::IPPROTO_TCP,
                    TCP_REPAIR_OPTIONS,
                    opts.as_ptr() as *const c_void,
                    (n * size_of::<RepairOpt>()) as socklen_t,
                )
            };
            cvt(r, "TCP_REPAIR_OPTIONS")?;
            set(fd, TCP_TIMESTAMP, &d.timestamp, "TCP_TIMESTAMP")?;
            for (q, data, what) in [
                (TCP_SEND_QUEUE, &d.outq, "send queue"),
                (TCP_RECV_QUEUE, &d.inq, "recv queue"),
            ] {
                if data.is_empty() {
                    continue;
                }
                set(fd, TCP_REPAIR_QUEUE, &q, "TCP_REPAIR_QUEUE")?;
                let w = unsafe { libc::send(fd, data.as_ptr() as *const c_void, data.len(), 0) };
                if (cvt(w as c_int, what)? as usize) != data.len() {
                    return Err(io::Error::other(format!("short write of the {what}")));
                }
            }
            set(fd, TCP_REPAIR_WINDOW, &d.window, "TCP_REPAIR_WINDOW")?;
            set(fd, TCP_REPAIR, &TCP_REPAIR_OFF_NO_WP, "TCP_REPAIR off")?;
            Ok(())
        })();
        match r {
            Ok(()) => Ok(fd),
            Err(e) => {
                unsafe { libc::close(fd) };
                Err(e)
            }
        }
    }

    /// A loopback connection whose server side holds `q` unread bytes and
    /// at least `q` bytes it cannot send (the client's window is closed).
    /// Returns (client fd, server fd).
    pub fn build(q: usize) -> io::Result<(c_int, c_int)> {
        unsafe {
            let l = cvt(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0), "socket")?;
            let one: c_int = 1;
            libc::setsockopt(
                l,
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR,
                &one as *const c_int as *const c_void,
                4,
            );
            let a = sin(SocketAddrV4::new([127, 0, 0, 1].into(), 0));
            let sl = size_of::<sockaddr_in>() as socklen_t;
            cvt(
                libc::bind(l, &a as *const sockaddr_in as *const libc::sockaddr, sl),
                "bind listener",
            )?;
            cvt(libc::listen(l, 4), "listen")?;
            let port = name(l, false)?.port();
            let c = cvt(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0), "socket")?;
            let small: c_int = 4096;
            libc::setsockopt(
                c,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                &small as *const c_int as *const c_void,
                4,
            );
            let to = sin(SocketAddrV4::new([127, 0, 0, 1].into(), port));
            cvt(
                libc::connect(c, &to as *const sockaddr_in as *const libc::sockaddr, sl),
                "connect",
            )?;
            let s = cvt(
                libc::accept(l, std::ptr::null_mut(), std::ptr::null_mut()),
                "accept",
            )?;
            libc::close(l);
            let data: Vec<u8> = (0..q).map(|i| (i * 7 + 3) as u8).collect();
            cvt(
                libc::send(c, data.as_ptr() as *const c_void, q, 0) as c_int,
                "client send",
            )?;
            // Fill the client's receive window, then queue `q` more bytes.
            let chunk = [0x5au8; 512];
            let start = WallInstant::now();
            while ioctl_len(s, SIOCOUTQ)? < q {
                libc::send(
                    s,
                    chunk.as_ptr() as *const c_void,
                    chunk.len(),
                    libc::MSG_DONTWAIT,
                );
                std::thread::sleep(std::time::Duration::from_millis(2));
                if start.elapsed().as_secs() > 5 {
                    return Err(io::Error::other("server send queue does not fill"));
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            Ok((c, s))
        }
    }

    pub fn inq_len(fd: c_int) -> io::Result<usize> {
        ioctl_len(fd, SIOCINQ)
    }
    pub fn outq_len(fd: c_int) -> io::Result<usize> {
        ioctl_len(fd, SIOCOUTQ)
    }
}

struct Linux {
    samples: Vec<u64>,
    dump_bytes: usize,
    outq: usize,
}

fn bench_linux(iterations: usize, q: usize) -> std::io::Result<Linux> {
    let (client, mut fd) = linux::build(q)?;
    let mut d = linux::Dump::default();
    let warm = iterations / 10 + 10;
    let mut samples = Vec::with_capacity(iterations);
    for k in 0..warm + iterations {
        let t0 = WallInstant::now();
        linux::dump_and_close(fd, &mut d)?;
        fd = linux::restore(&d)?;
        let dt = t0.elapsed().as_nanos() as u64;
        if k >= warm {
            samples.push(dt);
        }
    }
    // The restored socket still holds the client's bytes, unread.
    let inq = linux::inq_len(fd)?;
    let outq = linux::outq_len(fd)?;
    let want: Vec<u8> = (0..q).map(|i| (i * 7 + 3) as u8).collect();
    assert_eq!(
        inq, q,
        "receive queue survived {iterations} dump/restore cycles"
    );
    assert_eq!(d.inq, want, "receive queue bytes");
    let dump_bytes = d.inq.len() + d.outq.len() + 4 * 5 + 4 * 6;
    unsafe {
        libc::close(fd);
        libc::close(client);
    }
    samples.sort_unstable();
    Ok(Linux {
        samples,
        dump_bytes,
        outq,
    })
}

fn main() {
    let mut iterations = 10_000usize;
    let mut q = 4096usize;
    let mut ours_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--iterations" => {
                iterations = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--iterations N")
            }
            "--queue-bytes" => {
                q = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--queue-bytes N")
            }
            "--ours-only" => ours_only = true,
            _ => {
                eprintln!("usage: capybara-bench-export-import [--iterations N] [--queue-bytes N] [--ours-only]");
                std::process::exit(2);
            }
        }
    }
    let ours = bench_ours(iterations.max(10_000) * 4, q);
    let o50 = percentile(&ours.samples, 0.50);
    let o99 = percentile(&ours.samples, 0.99);
    if ours_only {
        // For profilers: the main case alone, no RESULT line.
        println!(
            "ours: export+import p50 {o50} ns, p99 {o99} ns, snapshot {} B; export alone p50 {} ns; parse alone p50 {} ns",
            ours.snapshot_len,
            percentile(&ours.export_only, 0.5),
            percentile(&ours.parse_only, 0.5)
        );
        return;
    }
    let empty = bench_ours(iterations.max(10_000) * 4, 0);
    let e50 = percentile(&empty.samples, 0.50);
    // The send queue's bytes start after the TCP state fields.
    let at = ours.snapshot_len - 2 * q - 4;
    let floor = copy_floor(iterations.max(10_000) * 4, q, at, true);
    let memcpy_floor = copy_floor(iterations.max(10_000) * 4, q, at, false);
    println!(
        "ours: {} iterations in batches of {BATCH}; snapshot {} B ({} B TCP state + 2 x {q} B queues), empty established {} B",
        ours.samples.len() * BATCH,
        ours.snapshot_len,
        ours.snapshot_len - 2 * q,
        ours.empty_len
    );
    println!(
        "ours: export+import p50 {o50} ns, p99 {o99} ns, max {} ns; export alone p50 {} ns (single-shot, incl. ~25 ns timer); parse alone p50 {} ns",
        ours.samples.last().unwrap(),
        percentile(&ours.export_only, 0.5),
        percentile(&ours.parse_only, 0.5)
    );
    println!(
        "ours: empty established connection ({} B snapshot) export+import p50 {e50} ns; copy floor (4 x {q} B, ring -> snapshot -> ring) p50 {floor} ns in 2 KiB pieces as the snapshot code copies, {memcpy_floor} ns as one memcpy each",
        empty.snapshot_len
    );
    let (l50, l99) = match bench_linux(iterations, q) {
        Ok(l) => {
            let l50 = percentile(&l.samples, 0.50);
            let l99 = percentile(&l.samples, 0.99);
            println!(
                "linux: {} TCP_REPAIR dump+close+restore cycles; {} B dumped ({q} B receive queue, {} B send queue)",
                l.samples.len(),
                l.dump_bytes,
                l.outq
            );
            println!(
                "linux: p50 {l50} ns, p99 {l99} ns, max {} ns",
                l.samples.last().unwrap()
            );
            (l50, l99)
        }
        Err(e) => {
            eprintln!("linux TCP_REPAIR baseline unavailable (needs CAP_NET_ADMIN): {e}");
            (0, 0)
        }
    };
    let speedup = if o50 > 0 {
        l50 as f64 / o50 as f64
    } else {
        0.0
    };
    println!("RESULT ours_p50_ns={o50} ours_p99_ns={o99} linux_p50_ns={l50} linux_p99_ns={l99} speedup_p50={speedup:.1} ours_empty_p50_ns={e50} copy_floor_ns={floor} memcpy_floor_ns={memcpy_floor}");
}
