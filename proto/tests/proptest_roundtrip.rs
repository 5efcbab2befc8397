//! Property tests: every Repr survives emit -> parse unchanged, with and
//! without the MAC, and split -> reassemble reproduces any snapshot.

use std::net::{Ipv4Addr, SocketAddrV4};

use capybara_proto::control::{self, ControlBody, ControlRepr, ErrorCode, ServiceList};
use capybara_proto::frag::{self, Progress, Reassembly};
use capybara_proto::load::LoadRepr;
use capybara_proto::tcpmig::{Kind, Reason, TcpMigRepr};
use capybara_proto::{FlowKey, MigrationKey, ServerId};
use proptest::prelude::*;

fn key() -> MigrationKey {
    MigrationKey::from_bytes(&[0x42; 32]).unwrap()
}

fn ip() -> impl Strategy<Value = Ipv4Addr> {
    any::<u32>().prop_map(Ipv4Addr::from)
}

fn flow() -> impl Strategy<Value = FlowKey> {
    (ip(), any::<u16>(), ip(), any::<u16>()).prop_map(
        |(client_ip, client_port, service_ip, service_port)| FlowKey {
            client_ip,
            client_port,
            service_ip,
            service_port,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn tcpmig_round_trip(
        kind in 0usize..6, id in any::<u64>(), flow in flow(), origin in ip(), target in ip(),
        seq in any::<u32>(), count in 1u16.., idx in any::<u16>(), reason in any::<u16>(),
        epoch in any::<u64>(),
        payload in proptest::collection::vec(any::<u8>(), 0..1500),
    ) {
        let repr = TcpMigRepr {
            kind: Kind::ALL[kind], migration_id: id, flow, origin, target, seq,
            frag_index: idx % count, frag_count: count, reason: Reason::from_u16(reason),
            epoch, payload: &payload,
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        let n = repr.emit_with_mac(&mut buf, &key()).unwrap();
        prop_assert_eq!(n, buf.len());
        prop_assert_eq!(TcpMigRepr::parse_verified(&buf, &key()).unwrap(), repr);
        prop_assert_eq!(TcpMigRepr::parse_bytes(&buf).unwrap(), repr);
    }

    #[test]
    fn load_round_trip(
        epoch in any::<u32>(), sequence in any::<u64>(), interval_us in any::<u32>(),
        server in any::<u32>(), own in any::<u64>(), pool in any::<u64>(),
        live in any::<u32>(), least in ip(),
        weights in proptest::option::of((any::<u32>(), any::<u32>())),
    ) {
        let repr = LoadRepr {
            epoch, sequence, interval_us, server_id: ServerId(server), own_load: own,
            pool_load: pool, live_servers: live, least_loaded: least,
            weights: weights.map(|(own, pool)| capybara_proto::load::LoadWeights { own, pool }),
        };
        let mut buf = [0u8; capybara_proto::load::MAX_LEN];
        let n = repr.emit(&mut buf).unwrap();
        prop_assert_eq!(n, repr.buffer_len());
        prop_assert_eq!(LoadRepr::parse_bytes(&buf[..n]).unwrap(), repr);
    }

    #[test]
    fn control_register_round_trip(
        server in any::<u32>(), seq in any::<u64>(), mgmt in ip(), data in ip(),
        mac in any::<[u8; 6]>(), weight in any::<u16>(),
        services in proptest::collection::vec((ip(), any::<u16>()), 0..=control::MAX_SERVICES),
        instance in any::<u64>(), reads_last_id in any::<bool>(),
    ) {
        let services: Vec<_> = services.into_iter().map(|(a, p)| SocketAddrV4::new(a, p)).collect();
        let repr = ControlRepr {
            server_id: ServerId(server), seq,
            body: ControlBody::Register(control::Register {
                mgmt_addr: mgmt, data_addr: data, data_mac: mac, weight,
                services: ServiceList::Slice(&services), instance, reads_last_id,
            }),
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_mac(&mut buf, &key()).unwrap();
        let parsed = ControlRepr::parse_verified(&buf, &key()).unwrap();
        prop_assert_eq!(parsed, repr);
        if let ControlBody::Register(r) = parsed.body {
            prop_assert_eq!(r.services.iter().collect::<Vec<_>>(), services);
            prop_assert_eq!(r.instance, instance);
        }
    }

    #[test]
    fn control_fixed_bodies_round_trip(
        server in any::<u32>(), seq in any::<u64>(), a in any::<u32>(), b in any::<u32>(),
        c in any::<u64>(), d in any::<u64>(), flow in flow(), target in proptest::option::of(1u32..),
        which in 0usize..7, code in any::<u16>(), ref_kind in any::<u8>(), text in "\\PC{0,100}",
        last_id in proptest::option::of(any::<u64>()),
    ) {
        let body = match which {
            0 => ControlBody::RegisterAck(control::RegisterAck {
                switch_epoch: a, load_interval_us: b, heartbeat_interval_ms: c as u32, dead_after_ms: d as u32,
                last_migration_id: last_id,
            }),
            1 => ControlBody::Heartbeat(control::Heartbeat {
                connections: a, migrations_in_flight: b, load_pps: c, rx_backlog_bytes: d, flags: a ^ b,
                policy_generation: a.rotate_left(3),
            }),
            2 => ControlBody::Drain(control::Drain { deadline_ms: a, flags: b }),
            3 => ControlBody::Migrate(control::Migrate { flow, target: target.map(Ipv4Addr::from) }),
            4 => ControlBody::SetOwner(control::SetOwner { flow, owner: Ipv4Addr::from(a) }),
            5 => ControlBody::Policy(control::PolicyMsg {
                generation: a, flags: b, proactive_threshold_bp: c as u32, hysteresis_bp: (c >> 32) as u32,
                reactive_backlog_packets: d as u32, cooldown_ms: (d >> 32) as u32, max_migrations_per_sec: a ^ b,
                migration_deadline_ms: a.rotate_left(7),
            }),
            _ => ControlBody::Error(control::ErrorMsg {
                code: ErrorCode::from_u16(code), ref_kind, ref_seq: c, text: &text,
            }),
        };
        let repr = ControlRepr { server_id: ServerId(server), seq, body };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_mac(&mut buf, &key()).unwrap();
        prop_assert_eq!(ControlRepr::parse_verified(&buf, &key()).unwrap(), repr);
    }

    #[test]
    fn split_then_reassemble(
        snapshot in proptest::collection::vec(any::<u8>(), 0..20_000),
        mtu in 97usize..9000, seed in any::<u64>(),
    ) {
        let frags: Vec<_> = frag::split(&snapshot, mtu).unwrap().collect();
        prop_assert!(frags.iter().all(|f| f.payload.len() <= frag::max_fragment_payload(mtu)));
        let mut order: Vec<usize> = (0..frags.len()).collect();
        let mut s = seed | 1;
        for i in (1..order.len()).rev() {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            order.swap(i, (s % (i as u64 + 1)) as usize);
        }
        let mut r = Reassembly::new(snapshot.len());
        let mut last = None;
        for i in order {
            let f = frags[i];
            last = Some(r.accept(f.index, f.count, f.payload).unwrap());
        }
        prop_assert_eq!(last, Some(Progress::Complete));
        prop_assert_eq!(r.snapshot().unwrap(), &snapshot[..]);
    }
}
