//! A reset from the server that owns a flow ends the flow's entry at once
//! (bpf/switch.bpf.c `note_server_rst`), as a client's reset does. Found in
//! an operator walkthrough: after a hostagent restart, clients' segments of
//! the connections it no longer knew were recovered (established entries),
//! the server answered each with a reset, and the entries stayed until the
//! LRU evicted them: a drain of that server then waited for "4 connections"
//! that no longer existed until its deadline. A reset from another server
//! than the owner leaves the flow alone.
//!
//! Needs root (CAP_BPF): the real XDP program on dummy interfaces
//! (BPF_PROG_TEST_RUN), as tests/dataplane.rs.

#[allow(unused_imports)]
mod support;

use support::*;

fn closed_events(lab: &mut Lab, key: CFlowKey) -> usize {
    flow_events(lab, key)
        .iter()
        .filter(|(kind, _, _)| *kind == EV_CLOSED)
        .count()
}

fn server_says(desc: &'static str, s: u32, sport: u16, flags: u8) -> Case {
    Case {
        desc,
        side: Side::Server,
        input: server_tcp(s, sport, flags),
        verdict: XDP_PASS,
        output: None,
        reason: "pass_not_service",
    }
}

#[test]
fn a_reset_from_the_owner_ends_the_flow_entry() {
    let mut lab = setup();

    // A recovered flow (a client segment without entry, e.g. after its
    // server's hostagent restarted and its entries went): the owner does
    // not know the connection and resets it.
    let recovered = 46001u16;
    let owner = maglev_server(&lab, recovered, VIP);
    let key = flow_key(recovered);
    run(
        &mut lab,
        vec![client_to(
            "a segment without entry is recovered",
            recovered,
            TCP_ACK | TCP_PSH,
            owner,
            "fwd_recovered",
        )],
    );
    let f = lab.dp.lookup_flow(key).unwrap().expect("recovered entry");
    assert_ne!(
        f.flags & FLOW_ESTABLISHED,
        0,
        "recovered flows are established"
    );
    let _ = flow_events(&mut lab, key);
    run(
        &mut lab,
        vec![server_says(
            "the owner resets it",
            owner,
            recovered,
            TCP_RST | TCP_ACK,
        )],
    );
    assert_eq!(lab.dp.lookup_flow(key).unwrap(), None, "entry removed");
    assert_eq!(closed_events(&mut lab, key), 1, "one CLOSED event");

    // A refused SYN: the entry goes with the reset, not 10 s later.
    let refused = 46002u16;
    let owner = maglev_server(&lab, refused, VIP);
    let key = flow_key(refused);
    run(
        &mut lab,
        vec![
            client_to("SYN placed", refused, TCP_SYN, owner, "fwd_new_flow"),
            server_says("the owner refuses it", owner, refused, TCP_RST | TCP_ACK),
        ],
    );
    assert_eq!(lab.dp.lookup_flow(key).unwrap(), None, "entry removed");

    // A reset from a server that does not own the flow changes nothing.
    let live = 46003u16;
    let owner = maglev_server(&lab, live, VIP);
    let other = if owner == 0 { 1 } else { 0 };
    let key = flow_key(live);
    run(
        &mut lab,
        vec![
            client_to("SYN placed", live, TCP_SYN, owner, "fwd_new_flow"),
            client_to("handshake ACK", live, TCP_ACK, owner, "fwd_established"),
        ],
    );
    let _ = flow_events(&mut lab, key);
    run(
        &mut lab,
        vec![server_says(
            "another server's reset",
            other,
            live,
            TCP_RST | TCP_ACK,
        )],
    );
    let f = lab.dp.lookup_flow(key).unwrap().expect("entry kept");
    assert_eq!(f.server, owner);
    assert_eq!(closed_events(&mut lab, key), 0);
    run(
        &mut lab,
        vec![client_to(
            "the connection still goes to its owner",
            live,
            TCP_ACK | TCP_PSH,
            owner,
            "fwd_established",
        )],
    );
}

/// A reset from the owner's data address instead of the VIP (its stack
/// refused a SYN for a port it does not listen on and could not tell which
/// VIP the client used: listeners bound to 0.0.0.0 or to several VIPs)
/// leaves with the VIP as source (`server_rst_from_vip`), so that the
/// client accepts it and connect() fails at once with "connection
/// refused", and it ends the entry. Before, it left from the data address:
/// the client ignored it and retried its SYN until it timed out, and the
/// entry stayed until the embryonic reaper. A reset from a data address
/// that does not own the client's flow is left as it is.
#[test]
fn a_reset_from_the_owners_data_address_leaves_from_the_vip() {
    let mut lab = setup();
    let from_data = |s: u32, sport: u16| {
        tcp_frame(
            SV_MAC,
            server_mac(s),
            server_ip(s),
            80,
            CLIENT,
            sport,
            TCP_RST | TCP_ACK,
            b"",
        )
    };
    let refused = 46101u16;
    let owner = maglev_server(&lab, refused, VIP);
    let key = flow_key(refused);
    run(
        &mut lab,
        vec![client_to(
            "SYN placed",
            refused,
            TCP_SYN,
            owner,
            "fwd_new_flow",
        )],
    );
    let _ = flow_events(&mut lab, key);
    run(
        &mut lab,
        vec![Case {
            desc: "the owner refuses it from its data address",
            side: Side::Server,
            input: from_data(owner, refused),
            verdict: XDP_PASS,
            // Built from scratch: also checks the checksum updates.
            output: Some(server_tcp(owner, refused, TCP_RST | TCP_ACK)),
            reason: "pass_not_service",
        }],
    );
    assert_eq!(lab.dp.lookup_flow(key).unwrap(), None, "entry removed");
    assert_eq!(closed_events(&mut lab, key), 1, "one CLOSED event");

    // Another server's data address: not the flow's owner, unchanged.
    let live = 46102u16;
    let owner = maglev_server(&lab, live, VIP);
    let other = if owner == 0 { 1 } else { 0 };
    run(
        &mut lab,
        vec![
            client_to("SYN placed", live, TCP_SYN, owner, "fwd_new_flow"),
            server_says_raw("another server's reset", from_data(other, live)),
            // No flow with that client port at all: unchanged.
            server_says_raw("a reset for no flow", from_data(owner, 46199)),
        ],
    );
    let f = lab
        .dp
        .lookup_flow(flow_key(live))
        .unwrap()
        .expect("entry kept");
    assert_eq!(f.server, owner);
}

fn server_says_raw(desc: &'static str, input: Vec<u8>) -> Case {
    Case {
        desc,
        side: Side::Server,
        input,
        verdict: XDP_PASS,
        output: None,
        reason: "pass_not_service",
    }
}
