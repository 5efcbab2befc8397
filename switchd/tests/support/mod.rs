//! Shared by the data-plane tests (tests/dataplane.rs): the lab of dummy
//! interfaces with a loaded program, the packet builders (client segments,
//! what the switch must emit toward a server, TCPMig datagrams), and the
//! table-driven case runner. One place, so that a frame layout change is
//! made once.
#![allow(dead_code)]

pub use std::net::Ipv4Addr;

pub use capybara_proto::tcpmig::{Kind, Reason, TcpMigRepr};
pub use capybara_proto::FlowKey;
pub use capybara_switchd::abi::*;
pub use capybara_switchd::bpf::{
    BpfDataPlane, BpfOptions, XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX,
};
pub use capybara_switchd::dataplane::DataPlane;
pub use capybara_switchd::maglev::{self, Backend};
pub use capybara_switchd::netns::TestNetns;
pub use capybara_switchd::packet::*;

pub const CL_MAC: Mac = [0x02, 0, 0, 0, 0, 0xc1]; // switch, client side
pub const SV_MAC: Mac = [0x02, 0, 0, 0, 0, 0x51]; // switch, server side
pub const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0x0c, 0x01];
pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 1);
pub const VIP_RING: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 2);
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
pub const SWITCH_SV: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);

pub fn server_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 2, 11 + i as u8)
}
pub fn server_mac(i: u32) -> Mac {
    [0x02, 0, 0, 0, 0x5e, i as u8]
}

pub struct Lab {
    pub _ns: TestNetns,
    pub dp: BpfDataPlane,
    pub cl: u32,
    pub sv: u32,
    pub maglev: Vec<u32>,
}

/// The switch's config and its two interfaces: `cl` facing clients, `sv`
/// facing servers (also an XDP_REDIRECT port).
pub fn set_switch(dp: &mut BpfDataPlane, cl: u32, sv: u32) {
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
}

/// Logical server `i` (`server_ip(i)`, `server_mac(i)`) behind the
/// server-side port `ifindex`, in `state`, weight 1.
pub fn server(state: u8, i: u32, ifindex: u32) -> CServer {
    let mut s = CServer {
        ifindex,
        mac: server_mac(i),
        src_mac: SV_MAC,
        state,
        weight: 1,
        ..Default::default()
    };
    s.set_data_addr(server_ip(i));
    s
}

pub fn setup() -> Lab {
    let ns = TestNetns::enter(&["cl0", "sv0"]).expect("netns (needs root)");
    let cl = ns.ifindex("cl0").unwrap();
    let sv = ns.ifindex("sv0").unwrap();
    let mut dp = BpfDataPlane::load(BpfOptions::small()).expect("load XDP program (needs root)");
    set_switch(&mut dp, cl, sv);
    // s0, s1 live; s2 draining; s3 dead.
    for (i, state) in [SERVER_LIVE, SERVER_LIVE, SERVER_DRAINING, SERVER_DEAD]
        .into_iter()
        .enumerate()
    {
        dp.set_server(i as u32, server(state, i as u32, sv))
            .unwrap();
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
            flags: 0,
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
            flags: 0,
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

pub fn client_tcp(dst: Ipv4Addr, sport: u16, flags: u8) -> Vec<u8> {
    tcp_frame(CL_MAC, CLIENT_MAC, CLIENT, sport, dst, 80, flags, b"")
}

/// What the switch must emit for a client packet sent to server `s`.
pub fn to_server_tcp(s: u32, sport: u16, flags: u8) -> Vec<u8> {
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

pub fn tcpmig(kind: Kind, sport_flow: u16, origin: u32, target: Option<u32>) -> Vec<u8> {
    mig(kind, 0x1122_3344_5566_7788, sport_flow, origin, target)
}

/// Migration id `n` of origin server `s`: data address << 32 | counter.
pub fn mid(s: u32, n: u32) -> u64 {
    (u64::from(u32::from(server_ip(s))) << 32) | u64::from(n)
}

pub fn mig(
    kind: Kind,
    migration_id: u64,
    sport_flow: u16,
    origin: u32,
    target: Option<u32>,
) -> Vec<u8> {
    mig_epoch(kind, migration_id, 0, sport_flow, origin, target)
}

/// [`mig`] with the origin's ownership epoch (TCPMig v2: the id of the
/// migration that gave it the flow, 0 for its placement).
pub fn mig_epoch(
    kind: Kind,
    migration_id: u64,
    epoch: u64,
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
        epoch,
        payload: b"",
    };
    let mut buf = vec![0u8; repr.buffer_len()];
    repr.emit(&mut buf).unwrap();
    buf
}

pub fn udp_from(src: Ipv4Addr, dst: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
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
pub fn udp_to_server(s: u32, src: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
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
pub fn direct(src: u32, dst: u32, payload: &[u8]) -> Vec<u8> {
    udp_to_server(dst, server_ip(src), payload)
}

/// The flow events of `key` queued since the last drain, in order, as
/// (kind, server, previous server): what the store will see.
pub fn flow_events(lab: &mut Lab, key: CFlowKey) -> Vec<(u32, u32, u32)> {
    let mut evs = Vec::new();
    lab.dp.drain_events(&mut evs).unwrap();
    evs.iter()
        .filter(|e| e.key == key)
        .map(|e| (e.kind, e.server, e.prev_server))
        .collect()
}

/// A client segment to the VIP that the switch redirects, unchanged but
/// for addresses, to server `s`.
pub fn client_to(desc: &'static str, sport: u16, flags: u8, s: u32, reason: &'static str) -> Case {
    Case {
        desc,
        side: Side::Client,
        input: client_tcp(VIP, sport, flags),
        verdict: XDP_REDIRECT,
        output: Some(to_server_tcp(s, sport, flags)),
        reason,
    }
}

/// The PREPARE of migration `id` of the flow on `sport` from server `o`,
/// naming target `t`: the switch sends it on to `t` (a flow the program
/// made for a SYN takes a PREPARE_ACK without entry only after it).
pub fn prepared(desc: &'static str, id: u64, sport: u16, o: u32, t: u32) -> Case {
    let msg = mig(Kind::Prepare, id, sport, o, Some(t));
    Case {
        desc,
        side: Side::Server,
        input: udp_from(server_ip(o), SWITCH_SV, &msg),
        verdict: XDP_REDIRECT,
        output: Some(udp_to_server(t, server_ip(o), &msg)),
        reason: "fwd_prepare",
    }
}

/// A TCPMig datagram from server `from` to server `to` that the switch
/// redirects to `to` (only the Ethernet addresses change).
pub fn relayed(desc: &'static str, from: u32, to: u32, msg: Vec<u8>, reason: &'static str) -> Case {
    Case {
        desc,
        side: Side::Server,
        input: udp_from(server_ip(from), server_ip(to), &msg),
        verdict: XDP_REDIRECT,
        output: Some(direct(from, to, &msg)),
        reason,
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Side {
    Client,
    Server,
    Unknown,
}

pub struct Case {
    pub desc: &'static str,
    pub side: Side,
    pub input: Vec<u8>,
    pub verdict: u32,
    /// None: the packet must leave unchanged.
    pub output: Option<Vec<u8>>,
    pub reason: &'static str,
}

pub fn run(lab: &mut Lab, cases: Vec<Case>) {
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

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn maglev_server(lab: &Lab, sport: u16, vip: Ipv4Addr) -> u32 {
    let k = FlowKey {
        client_ip: CLIENT,
        client_port: sport,
        service_ip: vip,
        service_port: 80,
    };
    lab.maglev[(maglev::flow_hash(&k) % MAGLEV_SIZE) as usize]
}

/// The flow key of client port `sport` to the Maglev service.
pub fn flow_key(sport: u16) -> CFlowKey {
    CFlowKey::from(FlowKey {
        client_ip: CLIENT,
        client_port: sport,
        service_ip: VIP,
        service_port: 80,
    })
}

/// A segment from server `s`'s stack to the client (source: the VIP), as it
/// arrives at the switch's server side.
pub fn server_tcp(s: u32, sport: u16, flags: u8) -> Vec<u8> {
    tcp_frame(SV_MAC, server_mac(s), VIP, 80, CLIENT, sport, flags, b"")
}
