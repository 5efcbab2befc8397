//! Table-driven tests of the XDP program through BPF_PROG_TEST_RUN:
//! {description, ingress, input packet, expected verdict, expected output
//! packet, expected reason counter}. Cases run in order against one loaded
//! program, so later cases see the state earlier ones created (a SYN
//! creates the flow that the next case finds established, a PREPARE-ACK
//! installs the migration entry the next case follows...).
//!
//! Needs root (CAP_BPF, CAP_NET_ADMIN); runs inside its own network
//! namespace with dummy interfaces.

use std::net::Ipv4Addr;

use capybara_proto::tcpmig::{Kind, Reason, TcpMigRepr};
use capybara_proto::FlowKey;
use capybara_switchd::abi::*;
use capybara_switchd::bpf::{BpfDataPlane, BpfOptions, XDP_DROP, XDP_PASS, XDP_REDIRECT};
use capybara_switchd::dataplane::DataPlane;
use capybara_switchd::maglev::{self, Backend};
use capybara_switchd::netns::TestNetns;
use capybara_switchd::packet::*;

const CL_MAC: Mac = [0x02, 0, 0, 0, 0, 0xc1]; // switch, client side
const SV_MAC: Mac = [0x02, 0, 0, 0, 0, 0x51]; // switch, server side
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0x0c, 0x01];
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 1);
const VIP_RING: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 2);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const SWITCH_SV: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);

fn server_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 2, 11 + i as u8)
}
fn server_mac(i: u32) -> Mac {
    [0x02, 0, 0, 0, 0x5e, i as u8]
}

struct Lab {
    _ns: TestNetns,
    dp: BpfDataPlane,
    cl: u32,
    sv: u32,
    maglev: Vec<u32>,
}

fn setup() -> Lab {
    let ns = TestNetns::enter(&["cl0", "sv0"]).expect("netns (needs root)");
    let cl = ns.ifindex("cl0").unwrap();
    let sv = ns.ifindex("sv0").unwrap();
    let mut dp = BpfDataPlane::load(BpfOptions::small()).expect("load XDP program (needs root)");
    dp.set_config(CConfig::new(SWITCH_SV)).unwrap();
    dp.set_iface(
        cl,
        CIface {
            role: IFACE_CLIENT,
            mac: CL_MAC,
            pad: 0,
        },
    )
    .unwrap();
    dp.set_iface(
        sv,
        CIface {
            role: IFACE_SERVER,
            mac: SV_MAC,
            pad: 0,
        },
    )
    .unwrap();
    dp.add_tx_port(sv).unwrap();
    // s0, s1 live; s2 draining; s3 dead.
    for (i, state) in [SERVER_LIVE, SERVER_LIVE, SERVER_DRAINING, SERVER_DEAD]
        .into_iter()
        .enumerate()
    {
        let mut s = CServer {
            ifindex: sv,
            mac: server_mac(i as u32),
            src_mac: SV_MAC,
            state,
            weight: 1,
            ..Default::default()
        };
        s.set_data_addr(server_ip(i as u32));
        dp.set_server(i as u32, s).unwrap();
    }
    let table = maglev::build_table(
        &[
            Backend {
                id: 10,
                index: 0,
                weight: 1,
            },
            Backend {
                id: 11,
                index: 1,
                weight: 1,
            },
        ],
        MAGLEV_SIZE,
    );
    let delta = maglev::diff(&[NO_SERVER; 0], &table);
    dp.set_service(
        CServiceKey::tcp(VIP, 80),
        CService {
            index: 0,
            placement: PLACE_MAGLEV,
        },
    )
    .unwrap();
    dp.write_maglev(0, &delta).unwrap();
    dp.write_ring(0, RING_TARGET, &CRing::from_slice(RING_ROTATE, &[0, 1]))
        .unwrap();
    dp.set_service(
        CServiceKey::tcp(VIP_RING, 80),
        CService {
            index: 1,
            placement: PLACE_RING,
        },
    )
    .unwrap();
    dp.write_ring(1, RING_PLACEMENT, &CRing::from_slice(RING_ROTATE, &[1]))
        .unwrap();
    Lab {
        _ns: ns,
        dp,
        cl,
        sv,
        maglev: table,
    }
}

fn client_tcp(dst: Ipv4Addr, sport: u16, flags: u8) -> Vec<u8> {
    tcp_frame(CL_MAC, CLIENT_MAC, CLIENT, sport, dst, 80, flags, b"")
}

/// What the switch must emit for a client packet sent to server `s`.
fn to_server_tcp(s: u32, sport: u16, flags: u8) -> Vec<u8> {
    // Built from scratch (full checksums), so it also checks the program's
    // incremental checksum updates.
    tcp_frame(
        server_mac(s),
        SV_MAC,
        CLIENT,
        sport,
        server_ip(s),
        80,
        flags,
        b"",
    )
}

fn tcpmig(kind: Kind, sport_flow: u16, origin: u32, target: Option<u32>) -> Vec<u8> {
    mig(kind, 0x1122_3344_5566_7788, sport_flow, origin, target)
}

/// Migration id `n` of origin server `s`: data address << 32 | counter.
fn mid(s: u32, n: u32) -> u64 {
    (u64::from(u32::from(server_ip(s))) << 32) | u64::from(n)
}

fn mig(
    kind: Kind,
    migration_id: u64,
    sport_flow: u16,
    origin: u32,
    target: Option<u32>,
) -> Vec<u8> {
    let repr = TcpMigRepr {
        kind,
        migration_id,
        flow: FlowKey {
            client_ip: CLIENT,
            client_port: sport_flow,
            service_ip: VIP,
            service_port: 80,
        },
        origin: server_ip(origin),
        target: target.map(server_ip).unwrap_or(Ipv4Addr::UNSPECIFIED),
        seq: 1,
        frag_index: 0,
        frag_count: 1,
        reason: if kind == Kind::Abort {
            Reason::Timeout
        } else {
            Reason::None
        },
        payload: b"",
    };
    let mut buf = vec![0u8; repr.buffer_len()];
    repr.emit(&mut buf).unwrap();
    buf
}

fn udp_from(src: Ipv4Addr, dst: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
    udp_frame(
        SV_MAC,
        [0x02, 0, 0, 0, 0x5e, 0xee],
        src,
        7690,
        dst,
        7690,
        payload,
    )
}
fn udp_to_server(s: u32, src: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
    udp_frame(
        server_mac(s),
        SV_MAC,
        src,
        7690,
        server_ip(s),
        7690,
        payload,
    )
}
/// What the switch emits for a datagram from server `src` to server `dst`
/// forwarded as is (only the Ethernet addresses change).
fn direct(src: u32, dst: u32, payload: &[u8]) -> Vec<u8> {
    udp_to_server(dst, server_ip(src), payload)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Client,
    Server,
    Unknown,
}

struct Case {
    desc: &'static str,
    side: Side,
    input: Vec<u8>,
    verdict: u32,
    /// None: the packet must leave unchanged.
    output: Option<Vec<u8>>,
    reason: &'static str,
}

fn run(lab: &mut Lab, cases: Vec<Case>) {
    for c in cases {
        let before = lab.dp.stats().unwrap();
        let ingress = match c.side {
            Side::Client => lab.cl,
            Side::Server => lab.sv,
            Side::Unknown => 0,
        };
        let r = lab
            .dp
            .test_run(&c.input, ingress, 1)
            .unwrap_or_else(|e| panic!("{}: {e}", c.desc));
        assert_eq!(r.verdict, c.verdict, "{}: verdict", c.desc);
        let expected = c.output.as_ref().unwrap_or(&c.input);
        assert_eq!(hex(&r.packet), hex(expected), "{}: output packet", c.desc);
        let after = lab.dp.stats().unwrap();
        let idx = stat(c.reason);
        assert_eq!(
            after[idx],
            before[idx] + 1,
            "{}: reason {} not counted",
            c.desc,
            c.reason
        );
        let total_b: u64 = before.iter().sum::<u64>() - before[stat("event_lost")];
        let total_a: u64 = after.iter().sum::<u64>() - after[stat("event_lost")];
        assert_eq!(
            total_a,
            total_b + 1,
            "{}: exactly one verdict counter",
            c.desc
        );
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn maglev_server(lab: &Lab, sport: u16, vip: Ipv4Addr) -> u32 {
    let k = FlowKey {
        client_ip: CLIENT,
        client_port: sport,
        service_ip: vip,
        service_port: 80,
    };
    lab.maglev[(maglev::flow_hash(&k) % MAGLEV_SIZE) as usize]
}

#[test]
fn flows_and_migrations() {
    let mut lab = setup();
    let sport = 40000;
    let owner = maglev_server(&lab, sport, VIP);
    let other = 1 - owner;
    let key = CFlowKey::from(FlowKey {
        client_ip: CLIENT,
        client_port: sport,
        service_ip: VIP,
        service_port: 80,
    });
    let (m1, m2) = (mid(owner, 1), mid(other, 1));

    run(
        &mut lab,
        vec![
            Case {
                desc: "SYN to the VIP is placed by Maglev (user-space hash == kernel hash)",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_SYN),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(owner, sport, TCP_SYN)),
                reason: "fwd_new_flow",
            },
            Case {
                desc: "established ACK follows the flow table",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_ACK),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(owner, sport, TCP_ACK)),
                reason: "fwd_established",
            },
            Case {
                desc: "server response from the VIP is left to the kernel",
                side: Side::Server,
                input: tcp_frame(
                    SV_MAC,
                    server_mac(owner),
                    VIP,
                    80,
                    CLIENT,
                    sport,
                    TCP_ACK,
                    b"x",
                ),
                verdict: XDP_PASS,
                output: None,
                reason: "pass_not_service",
            },
            Case {
                desc: "TCP to a non-VIP address passes",
                side: Side::Client,
                input: client_tcp(Ipv4Addr::new(198, 18, 0, 1), sport, TCP_SYN),
                verdict: XDP_PASS,
                output: None,
                reason: "pass_not_service",
            },
            Case {
                desc: "TCP to the VIP on another port passes",
                side: Side::Client,
                input: tcp_frame(CL_MAC, CLIENT_MAC, CLIENT, sport, VIP, 81, TCP_SYN, b""),
                verdict: XDP_PASS,
                output: None,
                reason: "pass_not_service",
            },
            Case {
                desc: "PREPARE (target 0) is steered to the round-robin target, origin skipped",
                side: Side::Server,
                input: udp_from(
                    server_ip(owner),
                    SWITCH_SV,
                    &tcpmig(Kind::Prepare, sport, owner, None),
                ),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(
                    other,
                    server_ip(owner),
                    &tcpmig(Kind::Prepare, sport, owner, None),
                )),
                reason: "fwd_prepare",
            },
            Case {
                desc: "PREPARE naming a target is honoured",
                side: Side::Server,
                input: udp_from(
                    server_ip(owner),
                    SWITCH_SV,
                    &tcpmig(Kind::Prepare, sport, owner, Some(other)),
                ),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(
                    other,
                    server_ip(owner),
                    &tcpmig(Kind::Prepare, sport, owner, Some(other)),
                )),
                reason: "fwd_prepare",
            },
            Case {
                desc: "PREPARE naming a dead target is dropped",
                side: Side::Server,
                input: udp_from(
                    server_ip(owner),
                    SWITCH_SV,
                    &tcpmig(Kind::Prepare, sport, owner, Some(3)),
                ),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_no_target",
            },
            Case {
                desc: "PREPARE from the client side is dropped",
                side: Side::Client,
                input: udp_from(
                    CLIENT,
                    SWITCH_SV,
                    &tcpmig(Kind::Prepare, sport, owner, None),
                ),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_from_client",
            },
            Case {
                desc: "PREPARE-ACK from the client side is dropped (no hijack)",
                side: Side::Client,
                input: udp_from(
                    CLIENT,
                    server_ip(owner),
                    &tcpmig(Kind::PrepareAck, sport, owner, Some(other)),
                ),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_from_client",
            },
            Case {
                desc: "PREPARE-ACK installs the migration entry and goes on to the origin",
                side: Side::Server,
                input: udp_from(
                    server_ip(other),
                    server_ip(owner),
                    &mig(Kind::PrepareAck, m1, sport, owner, Some(other)),
                ),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(
                    owner,
                    server_ip(other),
                    &mig(Kind::PrepareAck, m1, sport, owner, Some(other)),
                )),
                reason: "fwd_prepare_ack",
            },
            Case {
                desc: "migrated flow goes to the target",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_ACK | TCP_PSH),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(other, sport, TCP_ACK | TCP_PSH)),
                reason: "fwd_migrated",
            },
            Case {
                desc: "CONN_STATE between servers is forwarded to its destination",
                side: Side::Server,
                input: udp_from(
                    server_ip(owner),
                    server_ip(other),
                    &tcpmig(Kind::ConnState, sport, owner, Some(other)),
                ),
                verdict: XDP_REDIRECT,
                output: Some({
                    let mut f = udp_from(
                        server_ip(owner),
                        server_ip(other),
                        &tcpmig(Kind::ConnState, sport, owner, Some(other)),
                    );
                    f[0..6].copy_from_slice(&server_mac(other));
                    f[6..12].copy_from_slice(&SV_MAC);
                    f
                }),
                reason: "fwd_tcpmig",
            },
            Case {
                desc: "CONN_STATE_ACK goes on to the origin and makes the entry final",
                side: Side::Server,
                input: udp_from(
                    server_ip(other),
                    server_ip(owner),
                    &mig(Kind::ConnStateAck, m1, sport, owner, Some(other)),
                ),
                verdict: XDP_REDIRECT,
                output: Some(direct(
                    other,
                    owner,
                    &mig(Kind::ConnStateAck, m1, sport, owner, Some(other)),
                )),
                reason: "fwd_tcpmig",
            },
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::owner(other, m1))
    );
    assert_eq!(
        lab.dp
            .lookup_flow(key)
            .unwrap()
            .map(|f| (f.server, f.flags & FLOW_MIGRATED)),
        Some((owner, FLOW_MIGRATED))
    );

    run(
        &mut lab,
        vec![
            Case {
                desc: "PREPARE-ACK back to the original server: pending entry toward it",
                side: Side::Server,
                input: udp_from(
                    server_ip(owner),
                    server_ip(other),
                    &mig(Kind::PrepareAck, m2, sport, other, Some(owner)),
                ),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(
                    other,
                    server_ip(owner),
                    &mig(Kind::PrepareAck, m2, sport, other, Some(owner)),
                )),
                reason: "fwd_prepare_ack",
            },
            Case {
                desc: "CONN_STATE_ACK of the return makes it final (entry kept as a tombstone)",
                side: Side::Server,
                input: udp_from(
                    server_ip(owner),
                    server_ip(other),
                    &mig(Kind::ConnStateAck, m2, sport, other, Some(owner)),
                ),
                verdict: XDP_REDIRECT,
                output: Some(direct(
                    owner,
                    other,
                    &mig(Kind::ConnStateAck, m2, sport, other, Some(owner)),
                )),
                reason: "fwd_tcpmig",
            },
            Case {
                desc: "returned flow goes to the original server",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_ACK),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(owner, sport, TCP_ACK)),
                reason: "fwd_migrated",
            },
            Case {
                desc: "PREPARE-ACK naming an unknown server is dropped",
                side: Side::Server,
                input: udp_from(
                    Ipv4Addr::new(10, 9, 9, 9),
                    server_ip(owner),
                    &tcpmig(Kind::PrepareAck, sport, owner, None),
                ),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_unknown",
            },
            Case {
                desc: "client FIN is forwarded and marks the flow closing",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_ACK | TCP_FIN),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(owner, sport, TCP_ACK | TCP_FIN)),
                reason: "fwd_migrated",
            },
            Case {
                desc: "client RST is forwarded and removes the flow",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_RST),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(owner, sport, TCP_RST)),
                reason: "fwd_migrated",
            },
            Case {
                desc: "non-SYN without entry is re-placed by Maglev (switch restart)",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_ACK),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(owner, sport, TCP_ACK)),
                reason: "fwd_recovered",
            },
            Case {
                desc: "ring placement: SYN takes the LWRR ring's server",
                side: Side::Client,
                input: client_tcp(VIP_RING, 41000, TCP_SYN),
                verdict: XDP_REDIRECT,
                output: Some(tcp_frame(
                    server_mac(1),
                    SV_MAC,
                    CLIENT,
                    41000,
                    server_ip(1),
                    80,
                    TCP_SYN,
                    b"",
                )),
                reason: "fwd_new_flow",
            },
            Case {
                desc: "ring placement: non-SYN without entry is dropped",
                side: Side::Client,
                input: client_tcp(VIP_RING, 41001, TCP_ACK),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_no_flow",
            },
        ],
    );

    // Flow events, in order, as the store will see them.
    let mut evs = Vec::new();
    lab.dp.drain_events(&mut evs).unwrap();
    let kinds: Vec<(u32, u32, u32)> = evs
        .iter()
        .filter(|e| e.key == key)
        .map(|e| (e.kind, e.server, e.prev_server))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (EV_NEW, owner, owner),
            (EV_MIGRATED, other, owner),
            (EV_RETURNED, owner, other),
            (EV_CLOSED, owner, owner),
            (EV_CLOSED, owner, owner),
            (EV_NEW, owner, owner),
        ]
    );
    // Pool monitor: client packets forwarded to each server.
    let pk = lab.dp.server_packets().unwrap();
    assert_eq!(
        pk[owner as usize], 7,
        "SYN, ACK, returned ACK, FIN, RST, recovered ACK... {pk:?}"
    );
}

/// docs/MIGRATION.md "What the switch must do": the {owner, id, pending}
/// rules of the migration table, one case per rule, in the order a flow
/// that migrates away, back and away again would meet them.
#[test]
fn migration_table_rules() {
    let mut lab = setup();
    let sport = 44000;
    let a = maglev_server(&lab, sport, VIP);
    let b = 1 - a;
    let key = CFlowKey::from(FlowKey {
        client_ip: CLIENT,
        client_port: sport,
        service_ip: VIP,
        service_port: 80,
    });
    let (a1, a2, a3, a4, a9, b1) = (
        mid(a, 1),
        mid(a, 2),
        mid(a, 3),
        mid(a, 4),
        mid(a, 9),
        mid(b, 1),
    );
    // Message helpers: `ack(id, o, t)` is a PREPARE_ACK from t to o, etc.
    let pa = |id, o, t| mig(Kind::PrepareAck, id, sport, o, Some(t));
    let csa = |id, o, t| mig(Kind::ConnStateAck, id, sport, o, Some(t));
    let abort = |id, o, t: Option<u32>| mig(Kind::Abort, id, sport, o, t);
    let ack_in = |id, o, t| udp_from(server_ip(t), server_ip(o), &pa(id, o, t));
    let ack_out = |id, o, t| udp_to_server(o, server_ip(t), &pa(id, o, t));
    let data = |s: u32| Case {
        desc: "",
        side: Side::Client,
        input: client_tcp(VIP, sport, TCP_ACK | TCP_PSH),
        verdict: XDP_REDIRECT,
        output: Some(to_server_tcp(s, sport, TCP_ACK | TCP_PSH)),
        reason: "fwd_migrated",
    };
    let entry = |lab: &mut Lab| lab.dp.lookup_migration(key).unwrap();
    let before = lab.dp.server_packets().unwrap();

    run(
        &mut lab,
        vec![
            Case {
                desc: "SYN placed on a",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_SYN),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(a, sport, TCP_SYN)),
                reason: "fwd_new_flow",
            },
            Case {
                desc: "PREPARE_ACK a1 (a->b), no entry: pending entry toward b, forwarded to a",
                side: Side::Server,
                input: ack_in(a1, a, b),
                verdict: XDP_REDIRECT,
                output: Some(ack_out(a1, a, b)),
                reason: "fwd_prepare_ack",
            },
        ],
    );
    assert_eq!(entry(&mut lab), Some(CMigration::pending(b, a1)));
    run(
        &mut lab,
        vec![
            Case {
                desc: "client data follows the pending entry to the target (it buffers)",
                ..data(b)
            },
            Case {
                desc: "duplicate PREPARE_ACK a1: forwarded, no change",
                side: Side::Server,
                input: ack_in(a1, a, b),
                verdict: XDP_REDIRECT,
                output: Some(ack_out(a1, a, b)),
                reason: "fwd_prepare_ack",
            },
            Case {
                desc: "PREPARE_ACK a2 while a1 is pending: dropped",
                side: Side::Server,
                input: ack_in(a2, a, b),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_prepare_ack_stale",
            },
            Case {
                desc: "PREPARE_ACK b1 (b->a) while a1 is pending: dropped",
                side: Side::Server,
                input: ack_in(b1, b, a),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_prepare_ack_stale",
            },
            Case {
                desc: "ABORT request a1 to the switch: steered to the pending target",
                side: Side::Server,
                input: udp_from(server_ip(a), SWITCH_SV, &abort(a1, a, None)),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(b, server_ip(a), &abort(a1, a, None))),
                reason: "fwd_tcpmig",
            },
            Case {
                desc: "ABORT request a9 to the switch (no pending entry of that id): dropped",
                side: Side::Server,
                input: udp_from(server_ip(a), SWITCH_SV, &abort(a9, a, None)),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_abort_unmatched",
            },
            Case {
                desc: "CONN_STATE_ACK a9 (not the pending migration): forwarded, no change",
                side: Side::Server,
                input: udp_from(server_ip(b), server_ip(a), &csa(a9, a, b)),
                verdict: XDP_REDIRECT,
                output: Some(direct(b, a, &csa(a9, a, b))),
                reason: "fwd_tcpmig",
            },
        ],
    );
    assert_eq!(entry(&mut lab), Some(CMigration::pending(b, a1)));
    run(
        &mut lab,
        vec![Case {
            desc: "CONN_STATE_ACK a1 from b: entry final on b, forwarded to a",
            side: Side::Server,
            input: udp_from(server_ip(b), server_ip(a), &csa(a1, a, b)),
            verdict: XDP_REDIRECT,
            output: Some(direct(b, a, &csa(a1, a, b))),
            reason: "fwd_tcpmig",
        }],
    );
    assert_eq!(entry(&mut lab), Some(CMigration::owner(b, a1)));
    run(
        &mut lab,
        vec![
            Case {
                desc: "client data goes to the new owner b",
                ..data(b)
            },
            Case {
                desc: "late duplicate PREPARE_ACK a1 after the commit: forwarded, stays final",
                side: Side::Server,
                input: ack_in(a1, a, b),
                verdict: XDP_REDIRECT,
                output: Some(ack_out(a1, a, b)),
                reason: "fwd_prepare_ack",
            },
            Case {
                desc: "stale PREPARE_ACK a3 from a, which no longer owns the flow: dropped",
                side: Side::Server,
                input: ack_in(a3, a, b),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_prepare_ack_stale",
            },
            Case {
                desc: "ABORT decision a1 from b after its commit (impossible, forged): no change",
                side: Side::Server,
                input: udp_from(server_ip(b), server_ip(a), &abort(a1, a, Some(b))),
                verdict: XDP_REDIRECT,
                output: Some(direct(b, a, &abort(a1, a, Some(b)))),
                reason: "fwd_tcpmig",
            },
        ],
    );
    assert_eq!(entry(&mut lab), Some(CMigration::owner(b, a1)));
    // Back to the original server a, and away again.
    run(
        &mut lab,
        vec![
            Case {
                desc: "PREPARE_ACK b1 (b->a, back home): pending toward a",
                side: Side::Server,
                input: ack_in(b1, b, a),
                verdict: XDP_REDIRECT,
                output: Some(ack_out(b1, b, a)),
                reason: "fwd_prepare_ack",
            },
            Case {
                desc: "client data to a (buffering for the return)",
                ..data(a)
            },
            Case {
                desc: "CONN_STATE_ACK b1 from a: final on a",
                side: Side::Server,
                input: udp_from(server_ip(a), server_ip(b), &csa(b1, b, a)),
                verdict: XDP_REDIRECT,
                output: Some(direct(a, b, &csa(b1, b, a))),
                reason: "fwd_tcpmig",
            },
        ],
    );
    assert_eq!(
        entry(&mut lab),
        Some(CMigration::owner(a, b1)),
        "kept final on the original server"
    );
    run(
        &mut lab,
        vec![
            Case {
                desc: "returned flow goes to a",
                ..data(a)
            },
            Case {
                desc: "duplicate PREPARE_ACK b1 after the return: forwarded, no change",
                side: Side::Server,
                input: ack_in(b1, b, a),
                verdict: XDP_REDIRECT,
                output: Some(ack_out(b1, b, a)),
                reason: "fwd_prepare_ack",
            },
            Case {
                desc: "PREPARE_ACK a2 (a->b again, final entry owned by a): pending toward b",
                side: Side::Server,
                input: ack_in(a2, a, b),
                verdict: XDP_REDIRECT,
                output: Some(ack_out(a2, a, b)),
                reason: "fwd_prepare_ack",
            },
            Case {
                desc: "client data to b",
                ..data(b)
            },
            Case {
                desc: "ABORT decision a2 from b (dst == origin): forwarded to a",
                side: Side::Server,
                input: udp_from(server_ip(b), server_ip(a), &abort(a2, a, Some(b))),
                verdict: XDP_REDIRECT,
                output: Some(direct(b, a, &abort(a2, a, Some(b)))),
                reason: "fwd_tcpmig",
            },
        ],
    );
    assert_eq!(
        entry(&mut lab),
        Some(CMigration::owner(a, a2)),
        "target's decision: final on the origin"
    );
    run(
        &mut lab,
        vec![
            Case {
                desc: "client data back to the origin a",
                ..data(a)
            },
            Case {
                desc: "stale PREPARE_ACK a1 (older id from the same origin): dropped",
                side: Side::Server,
                input: ack_in(a1, a, b),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_prepare_ack_stale",
            },
            Case {
                desc: "PREPARE_ACK a2 of the aborted migration, delayed: dropped",
                side: Side::Server,
                input: ack_in(a2, a, b),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_prepare_ack_stale",
            },
            Case {
                desc: "ABORT request a2 to the switch after the decision: dropped",
                side: Side::Server,
                input: udp_from(server_ip(a), SWITCH_SV, &abort(a2, a, None)),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_abort_unmatched",
            },
            Case {
                desc: "PREPARE_ACK a4 (newer migration from a): pending toward b",
                side: Side::Server,
                input: ack_in(a4, a, b),
                verdict: XDP_REDIRECT,
                output: Some(ack_out(a4, a, b)),
                reason: "fwd_prepare_ack",
            },
            Case {
                desc: "ABORT decision a3 (another migration) from b: forwarded, no change",
                side: Side::Server,
                input: udp_from(server_ip(b), server_ip(a), &abort(a3, a, Some(b))),
                verdict: XDP_REDIRECT,
                output: Some(direct(b, a, &abort(a3, a, Some(b)))),
                reason: "fwd_tcpmig",
            },
            Case {
                desc: "ABORT request a4 to the switch: steered to b",
                side: Side::Server,
                input: udp_from(server_ip(a), SWITCH_SV, &abort(a4, a, None)),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(b, server_ip(a), &abort(a4, a, None))),
                reason: "fwd_tcpmig",
            },
            Case {
                desc: "CONN_STATE_ACK a4 from b: final on b",
                side: Side::Server,
                input: udp_from(server_ip(b), server_ip(a), &csa(a4, a, b)),
                verdict: XDP_REDIRECT,
                output: Some(direct(b, a, &csa(a4, a, b))),
                reason: "fwd_tcpmig",
            },
            Case {
                desc: "client data to b",
                ..data(b)
            },
        ],
    );
    assert_eq!(entry(&mut lab), Some(CMigration::owner(b, a4)));

    // Events: the store sees owners when they become final only.
    let mut evs = Vec::new();
    lab.dp.drain_events(&mut evs).unwrap();
    let kinds: Vec<(u32, u32, u32)> = evs
        .iter()
        .filter(|e| e.key == key)
        .map(|e| (e.kind, e.server, e.prev_server))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (EV_NEW, a, a),
            (EV_MIGRATED, b, a),
            (EV_RETURNED, a, b),
            (EV_MIGRATED, b, a)
        ]
    );
    // Pool monitor: client packets counted on the server they went to.
    let after = lab.dp.server_packets().unwrap();
    assert_eq!(
        (
            after[a as usize] - before[a as usize],
            after[b as usize] - before[b as usize]
        ),
        (4, 4),
        "{after:?}"
    );
}

/// ABORT decision without an entry: a tombstone on the origin, so that the
/// migration's PREPARE_ACK, delayed in the network, cannot redirect the flow.
#[test]
fn abort_decision_without_entry_leaves_a_tombstone() {
    let mut lab = setup();
    let sport = 44100;
    let a = maglev_server(&lab, sport, VIP);
    let b = 1 - a;
    let key = CFlowKey::from(FlowKey {
        client_ip: CLIENT,
        client_port: sport,
        service_ip: VIP,
        service_port: 80,
    });
    let id = mid(a, 5);
    let abort = mig(Kind::Abort, id, sport, a, Some(b));
    let ack = mig(Kind::PrepareAck, id, sport, a, Some(b));
    run(
        &mut lab,
        vec![
            Case {
                desc: "SYN placed on a",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_SYN),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(a, sport, TCP_SYN)),
                reason: "fwd_new_flow",
            },
            Case {
                desc: "ABORT decision from b, no entry: forwarded to a",
                side: Side::Server,
                input: udp_from(server_ip(b), server_ip(a), &abort),
                verdict: XDP_REDIRECT,
                output: Some(direct(b, a, &abort)),
                reason: "fwd_tcpmig",
            },
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::owner(a, id))
    );
    run(
        &mut lab,
        vec![
            Case {
                desc: "the aborted migration's PREPARE_ACK arrives late: dropped",
                side: Side::Server,
                input: udp_from(server_ip(b), server_ip(a), &ack),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_prepare_ack_stale",
            },
            Case {
                desc: "client data stays on a",
                side: Side::Client,
                input: client_tcp(VIP, sport, TCP_ACK),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(a, sport, TCP_ACK)),
                reason: "fwd_migrated",
            },
            Case {
                desc: "a later migration a->b proceeds",
                side: Side::Server,
                input: udp_from(
                    server_ip(b),
                    server_ip(a),
                    &mig(Kind::PrepareAck, mid(a, 6), sport, a, Some(b)),
                ),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(
                    a,
                    server_ip(b),
                    &mig(Kind::PrepareAck, mid(a, 6), sport, a, Some(b)),
                )),
                reason: "fwd_prepare_ack",
            },
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::pending(b, mid(a, 6)))
    );
    // A flow placed on b: an ABORT decision naming a as origin installs nothing.
    let other = (44101..45000)
        .find(|p| maglev_server(&lab, *p, VIP) == b)
        .unwrap();
    let okey = CFlowKey::from(FlowKey {
        client_ip: CLIENT,
        client_port: other,
        service_ip: VIP,
        service_port: 80,
    });
    lab.dp
        .insert_flow(
            okey,
            CFlow {
                server: b,
                service: 0,
                flags: 0,
            },
        )
        .unwrap();
    let forged = mig(Kind::Abort, mid(a, 7), other, a, Some(b));
    run(
        &mut lab,
        vec![Case {
            desc: "ABORT decision whose origin is not the flow's owner: forwarded, no tombstone",
            side: Side::Server,
            input: udp_from(server_ip(b), server_ip(a), &forged),
            verdict: XDP_REDIRECT,
            output: Some(direct(b, a, &forged)),
            reason: "fwd_tcpmig",
        }],
    );
    assert_eq!(lab.dp.lookup_migration(okey).unwrap(), None);
}

/// Every retransmission of one PREPARE (target 0) reaches the target the
/// first one went to, although the round-robin ring moves on.
#[test]
fn prepare_retransmissions_keep_their_target() {
    let mut lab = setup();
    let mut s4 = CServer {
        ifindex: lab.sv,
        mac: server_mac(4),
        src_mac: SV_MAC,
        state: SERVER_LIVE,
        weight: 1,
        ..Default::default()
    };
    s4.set_data_addr(server_ip(4));
    lab.dp.set_server(4, s4).unwrap();
    lab.dp
        .write_ring(0, RING_TARGET, &CRing::from_slice(RING_ROTATE, &[0, 1, 4]))
        .unwrap();
    let sport = 45000;
    let prep = |id| {
        udp_from(
            server_ip(0),
            SWITCH_SV,
            &mig(Kind::Prepare, id, sport, 0, None),
        )
    };
    let target_of = |lab: &mut Lab, id| {
        let r = lab.dp.test_run(&prep(id), lab.sv, 1).unwrap();
        assert_eq!(r.verdict, XDP_REDIRECT);
        [1u32, 4]
            .into_iter()
            .find(|s| {
                r.packet == udp_to_server(*s, server_ip(0), &mig(Kind::Prepare, id, sport, 0, None))
            })
            .expect("steered to 1 or 4")
    };
    let first = target_of(&mut lab, mid(0, 1));
    let mut cases = Vec::new();
    for i in 0..4 {
        let _ = i;
        cases.push(Case {
            desc: "PREPARE retransmission: same target",
            side: Side::Server,
            input: prep(mid(0, 1)),
            verdict: XDP_REDIRECT,
            output: Some(udp_to_server(
                first,
                server_ip(0),
                &mig(Kind::Prepare, mid(0, 1), sport, 0, None),
            )),
            reason: "fwd_prepare",
        });
        // Another migration in between moves the ring on.
        let _ = target_of(&mut lab, mid(0, 100 + i));
    }
    run(&mut lab, cases);
    // Round robin still spreads distinct migrations.
    let seen: std::collections::BTreeSet<u32> =
        (200..204).map(|n| target_of(&mut lab, mid(0, n))).collect();
    assert_eq!(seen.len(), 2, "{seen:?}");
}

#[test]
fn owners_and_malformed_packets() {
    let mut lab = setup();
    let dead_key = CFlowKey::from(FlowKey {
        client_ip: CLIENT,
        client_port: 42000,
        service_ip: VIP,
        service_port: 80,
    });
    lab.dp
        .insert_flow(
            dead_key,
            CFlow {
                server: 3,
                service: 0,
                flags: 0,
            },
        )
        .unwrap();
    let drain_key = CFlowKey::from(FlowKey {
        client_ip: CLIENT,
        client_port: 42001,
        service_ip: VIP,
        service_port: 80,
    });
    lab.dp
        .insert_flow(
            drain_key,
            CFlow {
                server: 2,
                service: 0,
                flags: 0,
            },
        )
        .unwrap();

    let syn = client_tcp(VIP, 43000, TCP_SYN);
    let mut bad_ihl = syn.clone();
    bad_ihl[14] = 0x44;
    let mut bad_version = syn.clone();
    bad_version[14] = 0x65;
    let mut long_tot = syn.clone();
    long_tot[16..18].copy_from_slice(&200u16.to_be_bytes());
    let mut frag = syn.clone();
    frag[20] = 0x20; // MF
    let mut bad_doff = syn.clone();
    bad_doff[14 + 20 + 12] = 0x30;
    let mut arp = syn.clone();
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    let prep = tcpmig(Kind::Prepare, 43000, 0, None);
    let mut bad_magic = prep.clone();
    bad_magic[0] = 0;
    let mut bad_version_mig = prep.clone();
    bad_version_mig[2] = 9;
    let mut bad_kind = prep.clone();
    bad_kind[3] = 77;
    let mut long_payload = prep.clone();
    long_payload[40..42].copy_from_slice(&500u16.to_be_bytes());

    run(
        &mut lab,
        vec![
            Case {
                desc: "flow owned by a dead server is dropped",
                side: Side::Client,
                input: client_tcp(VIP, 42000, TCP_ACK),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_server_down",
            },
            Case {
                desc: "flow owned by a draining server is still forwarded",
                side: Side::Client,
                input: client_tcp(VIP, 42001, TCP_ACK),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(2, 42001, TCP_ACK)),
                reason: "fwd_established",
            },
            // (Frames under 14 bytes, drop_short_eth, are refused by
            // BPF_PROG_TEST_RUN itself, so the shortest testable is this one.)
            Case {
                desc: "Ethernet header alone, IPv4 ethertype",
                side: Side::Client,
                input: syn[..14].to_vec(),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_bad_ipv4",
            },
            Case {
                desc: "ARP passes",
                side: Side::Client,
                input: arp,
                verdict: XDP_PASS,
                output: None,
                reason: "pass_not_ipv4",
            },
            Case {
                desc: "IPv4 header cut short",
                side: Side::Client,
                input: syn[..24].to_vec(),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_bad_ipv4",
            },
            Case {
                desc: "IHL below 5",
                side: Side::Client,
                input: bad_ihl,
                verdict: XDP_DROP,
                output: None,
                reason: "drop_bad_ipv4",
            },
            Case {
                desc: "IP version 6 in an IPv4 frame",
                side: Side::Client,
                input: bad_version,
                verdict: XDP_DROP,
                output: None,
                reason: "drop_bad_ipv4",
            },
            Case {
                desc: "total length beyond the frame",
                side: Side::Client,
                input: long_tot,
                verdict: XDP_DROP,
                output: None,
                reason: "drop_bad_ipv4",
            },
            Case {
                desc: "TCP fragment to the VIP",
                side: Side::Client,
                input: frag,
                verdict: XDP_DROP,
                output: None,
                reason: "drop_ip_fragment",
            },
            Case {
                desc: "TCP data offset beyond the segment",
                side: Side::Client,
                input: bad_doff,
                verdict: XDP_DROP,
                output: None,
                reason: "drop_short_l4",
            },
            Case {
                desc: "unconfigured interface passes",
                side: Side::Unknown,
                input: syn.clone(),
                verdict: XDP_PASS,
                output: None,
                reason: "pass_unknown_iface",
            },
            Case {
                desc: "TCPMig with bad magic",
                side: Side::Server,
                input: udp_from(server_ip(0), SWITCH_SV, &bad_magic),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_malformed",
            },
            Case {
                desc: "TCPMig with unknown version",
                side: Side::Server,
                input: udp_from(server_ip(0), SWITCH_SV, &bad_version_mig),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_malformed",
            },
            Case {
                desc: "TCPMig with unknown kind",
                side: Side::Server,
                input: udp_from(server_ip(0), SWITCH_SV, &bad_kind),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_malformed",
            },
            Case {
                desc: "TCPMig payload_len beyond the datagram",
                side: Side::Server,
                input: udp_from(server_ip(0), SWITCH_SV, &long_payload),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_malformed",
            },
            Case {
                desc: "TCPMig shorter than header + MAC",
                side: Side::Server,
                input: udp_from(server_ip(0), SWITCH_SV, &prep[..50]),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_malformed",
            },
            Case {
                desc: "PREPARE for an unknown service has no target",
                side: Side::Server,
                input: udp_from(server_ip(0), SWITCH_SV, &{
                    let mut p = prep.clone();
                    p[18..20].copy_from_slice(&9u16.to_be_bytes());
                    p
                }),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_tcpmig_no_target",
            },
        ],
    );
}

/// The control plane's dead-server cleanup on the real maps (batched reads).
#[test]
fn remove_flows_of_dead_server_on_bpf_maps() {
    let mut lab = setup();
    let k = |p: u16| {
        CFlowKey::from(FlowKey {
            client_ip: CLIENT,
            client_port: p,
            service_ip: VIP,
            service_port: 80,
        })
    };
    // 2,000 flows on s0 and s1 (well below the small LRU's capacity, so
    // none is evicted), two of them migrated.
    for p in 0..2000u16 {
        lab.dp
            .insert_flow(
                k(p),
                CFlow {
                    server: (p % 2) as u32,
                    service: 0,
                    flags: 0,
                },
            )
            .unwrap();
    }
    lab.dp
        .insert_migration(k(0), CMigration::owner(1, 1))
        .unwrap(); // s0 -> s1: dies with s1
    lab.dp
        .insert_migration(k(1), CMigration::owner(0, 1))
        .unwrap(); // s1 -> s0: survives
    assert_eq!(lab.dp.table_sizes().unwrap(), (2000, 2));
    let mut removed = lab.dp.remove_flows_of(1).unwrap();
    removed.sort_by_key(|x| FlowKey::from(*x).client_port);
    assert_eq!(
        removed.len(),
        1000,
        "999 placed on s1 and not migrated away + 1 migrated to s1"
    );
    assert!(removed.contains(&k(0)) && !removed.contains(&k(1)));
    assert_eq!(lab.dp.table_sizes().unwrap(), (1000, 1));
    assert_eq!(
        lab.dp.lookup_migration(k(1)).unwrap().map(|m| m.server),
        Some(0)
    );
    assert!(
        lab.dp.lookup_flow(k(3)).unwrap().is_none() && lab.dp.lookup_flow(k(2)).unwrap().is_some()
    );
}
