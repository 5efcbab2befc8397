//! End-to-end tests of two endpoints over the in-memory link.

mod common;

use capybara_tcp::{CloseReason, Duration, Event, KeepAlive, State, TcpConfig, TcpError};
use common::*;

fn data(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    Rng(seed).fill(&mut v);
    v
}

#[test]
fn handshake_negotiates_each_option() {
    type Tweak = fn(&mut TcpConfig);
    let cases: [(&str, Tweak); 5] = [
        ("all", |_| {}),
        ("no window scale", |c| c.window_scaling = false),
        ("no sack", |c| c.sack = false),
        ("no timestamps", |c| c.timestamps = false),
        ("nothing", |c| {
            c.window_scaling = false;
            c.sack = false;
            c.timestamps = false;
        }),
    ];
    for (name, tweak) in cases {
        let mut ccfg = TcpConfig::default();
        tweak(&mut ccfg);
        let mut p = Pair::new(ccfg.clone(), TcpConfig::default(), LinkConfig::default(), 7);
        let (c, s) = p.connect();
        let cc = p.client.connection(c).unwrap();
        let sc = p.server.connection(s).unwrap();
        assert_eq!(sc.opts.window_scale, ccfg.window_scaling, "{name}");
        assert_eq!(sc.opts.sack, ccfg.sack, "{name}");
        assert_eq!(sc.opts.timestamps, ccfg.timestamps, "{name}");
        assert_eq!(cc.opts, sc.opts, "{name}");
        let expect_smss = if ccfg.timestamps { 1448 } else { 1460 };
        assert_eq!(sc.snd.smss, expect_smss, "{name}");
        if ccfg.window_scaling {
            assert_eq!(sc.snd.wscale, cc.rcv.wscale, "{name}");
            assert_eq!(sc.rcv.wscale, 3, "{name}: 256 KiB needs shift 3");
        } else {
            assert_eq!((sc.snd.wscale, sc.rcv.wscale), (0, 0), "{name}");
        }
        // The server's local address is the VIP, not the data address.
        assert_eq!(p.server.local_addr(s), Some(vip()));
        let d = data(300_000, 3);
        assert_same(
            &transfer(&mut p, c, s, &d, true, Duration::from_secs(30)),
            &d,
            "transfer",
        );
        assert_same(
            &transfer(&mut p, c, s, &d, false, Duration::from_secs(30)),
            &d,
            "transfer",
        );
    }
}

#[test]
fn handshake_rtt_and_events() {
    let mut p = Pair::default_pair();
    let (c, s) = p.connect();
    // One round trip is 10 ms on the default link.
    let info = p.server.info(s).unwrap();
    assert_eq!(info.srtt_us, 10_000);
    assert_eq!(info.rto_us, 200_000, "clamped to the 200 ms minimum");
    assert!(events(&mut p.client).contains(&Event::Connected(c)));
    assert!(events(&mut p.server).contains(&Event::Accepted(s)));
}

#[test]
fn large_transfer_both_ways_byte_exact() {
    let mut p = Pair::default_pair();
    let (c, s) = p.connect();
    let d = data(8 << 20, 11);
    assert_same(
        &transfer(&mut p, c, s, &d, true, Duration::from_secs(60)),
        &d,
        "transfer",
    );
    assert_same(
        &transfer(&mut p, c, s, &d, false, Duration::from_secs(60)),
        &d,
        "transfer",
    );
    assert_eq!(p.client.counters().retransmits_timeout, 0);
    assert_eq!(p.server.counters().retransmits_timeout, 0);
}

#[test]
fn large_transfer_under_loss_duplication_reordering() {
    let link = LinkConfig {
        latency: Duration::from_millis(2),
        loss: 0.05,
        duplicate: 0.02,
        reorder: 0.05,
        reorder_extra: Duration::from_millis(3),
    };
    for seed in [1, 2] {
        let mut p = Pair::new(TcpConfig::default(), TcpConfig::default(), link, seed);
        let (c, s) = p.connect();
        let d = data(4 << 20, seed);
        assert_same(
            &transfer(&mut p, c, s, &d, true, Duration::from_secs(600)),
            &d,
            "transfer",
        );
        assert_same(
            &transfer(&mut p, c, s, &d, false, Duration::from_secs(600)),
            &d,
            "transfer",
        );
        let ctr = p.client.counters();
        assert!(ctr.retransmits_fast > 0, "{ctr:?}");
    }
}

#[test]
fn lossy_transfer_without_sack_or_timestamps() {
    let link = LinkConfig {
        latency: Duration::from_millis(2),
        loss: 0.03,
        ..LinkConfig::default()
    };
    let cfg = TcpConfig {
        sack: false,
        timestamps: false,
        ..TcpConfig::default()
    };
    let mut p = Pair::new(cfg.clone(), cfg, link, 5);
    let (c, s) = p.connect();
    let d = data(1 << 20, 5);
    assert_same(
        &transfer(&mut p, c, s, &d, true, Duration::from_secs(600)),
        &d,
        "transfer",
    );
}

#[test]
fn fast_retransmit_after_three_dup_acks() {
    let mut p = Pair::default_pair();
    let (c, s) = p.connect();
    let mut n = 0;
    p.drop_filter = Some(Box::new(move |dir, seg| {
        if dir == Dir::ToServer && !seg.payload.is_empty() {
            n += 1;
            return n == 3; // lose the third data segment once
        }
        false
    }));
    let d = data(200_000, 9);
    assert_same(
        &transfer(&mut p, c, s, &d, true, Duration::from_secs(30)),
        &d,
        "transfer",
    );
    let ctr = p.client.counters();
    assert!(ctr.retransmits_fast >= 1, "{ctr:?}");
    assert_eq!(ctr.retransmits_timeout, 0, "{ctr:?}");
}

#[test]
fn sack_recovers_multiple_losses_in_one_window() {
    let mut p = Pair::default_pair();
    let (c, s) = p.connect();
    let mut n = 0;
    p.drop_filter = Some(Box::new(move |dir, seg| {
        if dir == Dir::ToServer && !seg.payload.is_empty() {
            n += 1;
            return n == 3 || n == 5 || n == 7;
        }
        false
    }));
    let d = data(300_000, 4);
    assert_same(
        &transfer(&mut p, c, s, &d, true, Duration::from_secs(30)),
        &d,
        "transfer",
    );
    let ctr = p.client.counters();
    assert!(ctr.retransmits_fast >= 3, "{ctr:?}");
    assert_eq!(
        ctr.retransmits_timeout, 0,
        "SACK recovery must avoid the RTO: {ctr:?}"
    );
}

#[test]
fn zero_window_then_persist_probe_then_resume() {
    let small = TcpConfig {
        rx_buffer: 16 * 1024,
        ..TcpConfig::default()
    };
    let mut p = Pair::new(TcpConfig::default(), small, LinkConfig::default(), 3);
    let (c, s) = p.connect();
    let d = data(100_000, 8);
    let mut sent = 0;
    // The server does not read: the window closes.
    p.run_until(Duration::from_secs(5), |p| {
        if let Ok(n) = p.client.send(c, &d[sent..]) {
            sent += n;
        }
        false
    });
    let cc = p.client.connection(c).unwrap();
    assert_eq!(cc.snd.wnd, 0);
    assert_eq!(p.server.info(s).unwrap().recv_queue, 16 * 1024);
    assert!(
        p.client.counters().zero_window_probes >= 3,
        "{:?}",
        p.client.counters()
    );
    assert_eq!(p.client.state(c), Some(State::Established));
    // Reading opens the window; a window update restarts the transfer.
    let mut got = Vec::new();
    let mut buf = vec![0u8; 8192];
    let ok = p.run_until(Duration::from_secs(30), |p| {
        while sent < d.len() {
            match p.client.send(c, &d[sent..]) {
                Ok(n) => sent += n,
                Err(_) => break,
            }
        }
        while let Ok(n) = p.server.recv(s, &mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        got.len() == d.len()
    });
    assert!(ok);
    assert_same(&got, &d, "after zero window");
}

#[test]
fn active_close_passive_close_and_time_wait_expiry() {
    let cfg = TcpConfig {
        time_wait: Duration::from_secs(4),
        ..TcpConfig::default()
    };
    let mut p = Pair::new(cfg.clone(), cfg, LinkConfig::default(), 2);
    let (c, s) = p.connect();
    p.client.send(c, b"bye").unwrap();
    p.client.shutdown(c).unwrap();
    let mut buf = [0u8; 16];
    let mut got = Vec::new();
    assert!(p.run_until(Duration::from_secs(1), |p| {
        match p.server.recv(s, &mut buf) {
            Ok(0) => true,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                false
            }
            Err(_) => false,
        }
    }));
    assert_eq!(got, b"bye");
    assert_eq!(p.server.state(s), Some(State::CloseWait));
    assert_eq!(p.client.state(c), Some(State::FinWait2));
    p.server.close(s).unwrap();
    assert_eq!(p.server.connection(s).unwrap().state, State::LastAck);
    assert!(p.run_until(Duration::from_secs(1), |p| p.client.state(c)
        == Some(State::TimeWait)));
    let t_wait = p.now;
    // The server side is gone once our ACK of its FIN arrives (LAST-ACK -> CLOSED).
    assert!(p.run_until(Duration::from_secs(1), |p| p.server.connection_count() == 0));
    assert!(p.run_until(Duration::from_secs(10), |p| p.client.state(c)
        == Some(State::Closed)));
    assert_eq!(p.now - t_wait, Duration::from_secs(4), "2MSL as configured");
    assert!(events(&mut p.client).contains(&Event::Closed {
        id: c,
        reason: CloseReason::Normal
    }));
    assert_eq!(p.client.recv(c, &mut buf), Ok(0));
    p.client.close(c).unwrap();
    assert_eq!(p.client.connection_count(), 0);
}

#[test]
fn simultaneous_close_goes_through_closing() {
    let cfg = TcpConfig {
        time_wait: Duration::from_secs(1),
        ..TcpConfig::default()
    };
    let mut p = Pair::new(cfg.clone(), cfg, LinkConfig::default(), 2);
    let (c, s) = p.connect();
    p.client.shutdown(c).unwrap();
    p.server.shutdown(s).unwrap();
    assert_eq!(p.client.state(c), Some(State::FinWait1));
    let mut saw_closing = false;
    assert!(p.run_until(Duration::from_secs(1), |p| {
        saw_closing |= p.client.state(c) == Some(State::Closing);
        p.client.state(c) == Some(State::TimeWait) && p.server.state(s) == Some(State::TimeWait)
    }));
    assert!(saw_closing);
    assert!(p.run_until(Duration::from_secs(5), |p| {
        p.client.state(c) == Some(State::Closed) && p.server.state(s) == Some(State::Closed)
    }));
}

#[test]
fn abort_resets_the_peer() {
    let mut p = Pair::default_pair();
    let (c, s) = p.connect();
    p.client.abort(c).unwrap();
    assert_eq!(p.client.state(c), None, "handle released");
    let mut buf = [0u8; 8];
    assert!(
        p.run_until(Duration::from_secs(1), |p| p.server.recv(s, &mut buf)
            == Err(TcpError::Reset))
    );
    assert!(events(&mut p.server).contains(&Event::Closed {
        id: s,
        reason: CloseReason::Reset
    }));
    assert_eq!(p.client.connection_count(), 0);
}

#[test]
fn close_with_unread_data_sends_rst() {
    let mut p = Pair::default_pair();
    let (c, s) = p.connect();
    p.client.send(c, b"unread").unwrap();
    assert!(p.run_until(Duration::from_secs(1), |p| p.server.is_readable(s)));
    p.server.close(s).unwrap();
    let mut buf = [0u8; 8];
    assert!(
        p.run_until(Duration::from_secs(1), |p| p.client.recv(c, &mut buf)
            == Err(TcpError::Reset))
    );
}

#[test]
fn connect_to_closed_port_is_refused() {
    let mut p = Pair::default_pair();
    let c = p
        .client
        .connect(
            p.now,
            std::net::SocketAddrV4::new(CLIENT_IP, 0),
            std::net::SocketAddrV4::new(VIP, 81),
        )
        .unwrap();
    let mut buf = [0u8; 8];
    assert!(
        p.run_until(Duration::from_secs(1), |p| p.client.recv(c, &mut buf)
            == Err(TcpError::Refused))
    );
    assert_eq!(p.server.counters().drops.no_listener, 1);
    assert_eq!(p.server.counters().resets_sent, 1);
}

#[test]
fn keepalive_detects_dead_peer() {
    let ka = KeepAlive {
        idle: Duration::from_secs(10),
        interval: Duration::from_secs(2),
        probes: 3,
    };
    let cfg = TcpConfig {
        keepalive: Some(ka),
        ..TcpConfig::default()
    };
    let mut p = Pair::new(cfg, TcpConfig::default(), LinkConfig::default(), 2);
    let (c, _s) = p.connect();
    // While the peer answers, keep-alives keep the connection up.
    assert!(!p.run_until(Duration::from_secs(60), |p| p.client.state(c)
        != Some(State::Established)));
    assert!(p.client.counters().keepalive_probes >= 4);
    // Peer disappears: idle 10 s... then 3 unanswered probes, 2 s apart.
    p.drop_filter = Some(Box::new(|_, _| true));
    let start = p.now;
    assert!(p.run_until(Duration::from_secs(60), |p| p.client.state(c)
        == Some(State::Closed)));
    let mut buf = [0u8; 4];
    assert_eq!(p.client.recv(c, &mut buf), Err(TcpError::TimedOut));
    let took = p.now - start;
    assert!(took <= Duration::from_secs(10 + 2 * 3), "{took:?}");
}

#[test]
fn retransmission_gives_up_after_max_retries() {
    let cfg = TcpConfig {
        max_retries: 3,
        ..TcpConfig::default()
    };
    let mut p = Pair::new(cfg, TcpConfig::default(), LinkConfig::default(), 2);
    let (c, _s) = p.connect();
    p.drop_filter = Some(Box::new(|_, _| true));
    p.client.send(c, b"lost forever").unwrap();
    let start = p.now;
    assert!(p.run_until(Duration::from_secs(60), |p| p.client.state(c)
        == Some(State::Closed)));
    // 200 + 400 + 800 + 1600 ms of backoff.
    assert_eq!(p.now - start, Duration::from_millis(3000));
    assert!(events(&mut p.client).contains(&Event::Closed {
        id: c,
        reason: CloseReason::TimedOut
    }));
    assert_eq!(p.client.counters().retransmits_timeout, 3);
}

#[test]
fn many_connections_with_loss() {
    let link = LinkConfig {
        loss: 0.02,
        latency: Duration::from_millis(1),
        ..LinkConfig::default()
    };
    let mut p = Pair::new(TcpConfig::default(), TcpConfig::default(), link, 77);
    let mut pairs = Vec::new();
    for _ in 0..20 {
        pairs.push(p.connect());
    }
    for (i, &(c, s)) in pairs.iter().enumerate() {
        let d = data(20_000 + i * 100, i as u64);
        assert_same(
            &transfer(&mut p, c, s, &d, i % 2 == 0, Duration::from_secs(60)),
            &d,
            "transfer",
        );
    }
    let states = p.server.connections_by_state();
    assert_eq!(
        states
            .iter()
            .find(|(s, _)| *s == State::Established)
            .unwrap()
            .1,
        20
    );
}

/// Echo through the server the way the hostagent's echo service does it
/// (it reads only as much as it can queue for sending), with the client
/// sending and reading at the same time, so both directions carry data and
/// most ACKs ride on data segments. Returns (virtual time taken, bytes
/// echoed back intact).
fn echo_run(p: &mut Pair, c: capybara_tcp::ConnId, s: capybara_tcp::ConnId, d: &[u8]) -> Duration {
    let start = p.now;
    let mut sent = 0;
    let mut got = Vec::with_capacity(d.len());
    let mut buf = vec![0u8; 64 * 1024];
    let ok = p.run_until(Duration::from_secs(3600), |p| {
        while sent < d.len() {
            match p.client.send(c, &d[sent..]) {
                Ok(n) => sent += n,
                Err(_) => break,
            }
        }
        loop {
            let room = p.server.connection(s).map_or(0, |x| x.tx.free());
            if room == 0 {
                break;
            }
            let k = room.min(buf.len());
            match p.server.recv(s, &mut buf[..k]) {
                Ok(n) if n > 0 => {
                    assert_eq!(p.server.send(s, &buf[..n]), Ok(n));
                }
                _ => break,
            }
        }
        while let Ok(n) = p.client.recv(c, &mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        got.len() >= d.len()
    });
    assert!(ok, "echo stalled: sent {sent}, echoed {}", got.len());
    assert_same(&got, d, "echo");
    p.now - start
}

/// The lab's "100 MiB echo at 5% loss" in miniature: 8 MiB through the
/// echo, 1 ms RTT, 5% loss in both directions. Before SACK recovery counted
/// ACKs riding on data, resent lost retransmissions and kept the scoreboard
/// across an RTO, this took 18-22 s of virtual time with 47-87 RTOs per
/// side; now about 1.5 s with none (printed with --nocapture).
#[test]
fn echo_at_five_percent_loss_recovers_without_timeouts() {
    for seed in [1u64, 2, 3] {
        let link = LinkConfig {
            latency: Duration::from_micros(500),
            loss: 0.05,
            ..LinkConfig::default()
        };
        let mut p = Pair::new(TcpConfig::default(), TcpConfig::default(), link, seed);
        let (c, s) = p.connect();
        let d = data(8 << 20, seed);
        let t = echo_run(&mut p, c, s, &d);
        let (cc, sc) = (p.client.counters(), p.server.counters());
        eprintln!(
            "seed {seed}: {t:?}, RTOs client {} server {}, recovery retransmits client {} server {}",
            cc.retransmits_timeout,
            sc.retransmits_timeout,
            cc.retransmits_fast,
            sc.retransmits_fast
        );
        assert!(t < Duration::from_secs(4), "seed {seed}: took {t:?}");
        assert!(cc.retransmits_timeout <= 2, "seed {seed}: {cc:?}");
        assert!(sc.retransmits_timeout <= 2, "seed {seed}: {sc:?}");
    }
}
