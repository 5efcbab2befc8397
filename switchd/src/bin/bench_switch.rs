//! Data-plane benchmark: packets/s of the XDP program for a non-migrated
//! and a migrated flow, with 1,000,000 tracked flows and 200,000 migration
//! entries loaded, through BPF_PROG_TEST_RUN with `repeat` (needs root).
//!
//! BPF_PROG_TEST_RUN does not restore the frame between repetitions, so
//! after the first run the destination is already the server's data
//! address. To keep every repetition on the full path (service lookup,
//! migration-table lookup, flow-table lookup, rewrite, count, redirect),
//! each probe flow's data address is also registered as a service whose
//! entries point at the same server: the rewrite is then a fixed point.
//!
//! Last line: `RESULT pps_plain=... pps_migrated=... migrated_over_plain=...
//! flows=... migrated_entries=...`.

use std::net::Ipv4Addr;

use capybara_proto::FlowKey;
use capybara_switchd::abi::*;
use capybara_switchd::bpf::{BpfDataPlane, BpfOptions, XDP_REDIRECT};
use capybara_switchd::dataplane::DataPlane;
use capybara_switchd::maglev::{self, Backend};
use capybara_switchd::packet::*;

const FLOWS: u32 = 1_000_000;
const MIGRATED: u32 = 200_000;
const SERVERS: u32 = 8;
const LO: u32 = 1; // loopback: exists in every namespace; no frame is sent by TEST_RUN

fn server_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 2, 10 + i as u8)
}

fn main() -> anyhow::Result<()> {
    let repeat: u32 = std::env::var("BENCH_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000);
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let mut dp = BpfDataPlane::load(BpfOptions {
        max_flows: 2 * FLOWS,
        max_migrations: 262_144,
        event_ring_bytes: 1 << 20,
    })?;
    let vip = Ipv4Addr::new(198, 18, 100, 1);
    dp.set_config(CConfig::new(Ipv4Addr::new(198, 18, 1, 1)))?;
    dp.set_iface(
        LO,
        CIface {
            role: IFACE_CLIENT,
            mac: [2, 0, 0, 0, 0, 1],
            pad: 0,
        },
    )?;
    dp.add_tx_port(LO)?;
    let mut backends = Vec::new();
    for i in 0..SERVERS {
        let mut s = CServer {
            ifindex: LO,
            mac: [2, 0, 0, 0, 1, i as u8],
            src_mac: [2, 0, 0, 0, 0, 1],
            state: SERVER_LIVE,
            weight: 1,
            ..Default::default()
        };
        s.set_data_addr(server_ip(i));
        dp.set_server(i, s)?;
        backends.push(Backend {
            id: 100 + i,
            index: i,
            weight: 1,
        });
        // Fixed-point aliases (see module doc).
        dp.set_service(
            CServiceKey::tcp(server_ip(i), 80),
            CService {
                index: 1,
                placement: PLACE_MAGLEV,
                flags: 0,
            },
        )?;
    }
    dp.set_service(
        CServiceKey::tcp(vip, 80),
        CService {
            index: 0,
            placement: PLACE_MAGLEV,
            flags: 0,
        },
    )?;
    let table = maglev::build_table(&backends, MAGLEV_SIZE);
    dp.write_maglev(0, &maglev::diff(&[], &table))?;

    eprintln!("loading {FLOWS} flows, {MIGRATED} migrated entries...");
    let key_of = |i: u32| {
        CFlowKey::from(FlowKey {
            client_ip: Ipv4Addr::from(0x0A00_0000 + (i >> 8)),
            client_port: 10_000 + (i & 0xff) as u16,
            service_ip: vip,
            service_port: 80,
        })
    };
    let keys: Vec<CFlowKey> = (0..FLOWS).map(key_of).collect();
    let vals: Vec<CFlow> = (0..FLOWS)
        .map(|i| CFlow {
            server: i % SERVERS,
            service: 0,
            flags: 0,
            ..Default::default()
        })
        .collect();
    dp.insert_flows_batch(&keys, &vals)?;
    let mkeys: Vec<CFlowKey> = (0..MIGRATED)
        .map(|i| key_of(i * (FLOWS / MIGRATED)))
        .collect();
    let mvals: Vec<CMigration> = (0..MIGRATED)
        .map(|i| CMigration::owner((i + 1) % SERVERS, i as u64))
        .collect();
    dp.insert_migrations_batch(&mkeys, &mvals)?;

    // Probe flows: a plain one on server 3, a migrated one 2 -> 5.
    let client = Ipv4Addr::new(198, 18, 0, 11);
    let plain = FlowKey {
        client_ip: client,
        client_port: 50_000,
        service_ip: server_ip(3),
        service_port: 80,
    };
    dp.insert_flow(
        plain.into(),
        CFlow {
            server: 3,
            service: 1,
            flags: 0,
            ..Default::default()
        },
    )?;
    let migrated = FlowKey {
        client_ip: client,
        client_port: 50_001,
        service_ip: server_ip(5),
        service_port: 80,
    };
    dp.insert_flow(
        migrated.into(),
        CFlow {
            server: 2,
            service: 1,
            flags: FLOW_MIGRATED,
            ..Default::default()
        },
    )?;
    dp.insert_migration(migrated.into(), CMigration::owner(5, 1))?;
    let pkt = |k: &FlowKey| {
        tcp_frame(
            [2, 0, 0, 0, 0, 1],
            [2, 0, 0, 0, 9, 9],
            k.client_ip,
            k.client_port,
            k.service_ip,
            80,
            TCP_ACK,
            &[0u8; 64],
        )
    };
    let (pp, pm) = (pkt(&plain), pkt(&migrated));

    let mut ns_plain = Vec::new();
    let mut ns_migr = Vec::new();
    for _ in 0..rounds {
        let a = dp.test_run(&pp, LO, repeat)?;
        let b = dp.test_run(&pm, LO, repeat)?;
        anyhow::ensure!(
            a.verdict == XDP_REDIRECT && b.verdict == XDP_REDIRECT,
            "unexpected verdicts {} {}",
            a.verdict,
            b.verdict
        );
        ns_plain.push(a.duration.as_nanos() as f64);
        ns_migr.push(b.duration.as_nanos() as f64);
    }
    let st = dp.stats()?;
    anyhow::ensure!(
        st[stat("fwd_migrated")] > 0 && st[stat("fwd_established")] > 0,
        "probes took the wrong path: {st:?}"
    );
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2].max(1.0)
    };
    let (np, nm) = (median(&mut ns_plain), median(&mut ns_migr));
    let (pps_p, pps_m) = (1e9 / np, 1e9 / nm);
    println!(
        "ns_per_packet_plain={np:.1} ns_per_packet_migrated={nm:.1} added_latency_ns={:.1}",
        nm - np
    );
    println!(
        "RESULT pps_plain={:.0} pps_migrated={:.0} migrated_over_plain={:.3} flows={} migrated_entries={}",
        pps_p,
        pps_m,
        pps_m / pps_p,
        FLOWS,
        MIGRATED
    );
    Ok(())
}
