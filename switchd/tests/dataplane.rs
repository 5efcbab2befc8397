//! Table-driven tests of the XDP program through BPF_PROG_TEST_RUN:
//! {description, ingress, input packet, expected verdict, expected output
//! packet, expected reason counter}. Cases run in order against one loaded
//! program, so later cases see the state earlier ones created (a SYN
//! creates the flow that the next case finds established, a PREPARE-ACK
//! installs the migration entry the next case follows...).
//!
//! Needs root (CAP_BPF, CAP_NET_ADMIN); runs inside its own network
//! namespace with dummy interfaces.

mod support;

use support::*;

#[test]
fn flows_and_migrations() {
    let mut lab = setup();
    let sport = 40000;
    let owner = maglev_server(&lab, sport, VIP);
    let other = 1 - owner;
    let key = flow_key(sport);
    let (m1, m2) = (mid(owner, 1), mid(other, 1));

    run(
        &mut lab,
        vec![
            client_to(
                "SYN to the VIP is placed by Maglev (user-space hash == kernel hash)",
                sport,
                TCP_SYN,
                owner,
                "fwd_new_flow",
            ),
            client_to(
                "established ACK follows the flow table",
                sport,
                TCP_ACK,
                owner,
                "fwd_established",
            ),
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
            relayed(
                "PREPARE-ACK installs the migration entry and goes on to the origin",
                other,
                owner,
                mig(Kind::PrepareAck, m1, sport, owner, Some(other)),
                "fwd_prepare_ack",
            ),
            client_to(
                "migrated flow goes to the target",
                sport,
                TCP_ACK | TCP_PSH,
                other,
                "fwd_migrated",
            ),
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
            relayed(
                "CONN_STATE_ACK goes on to the origin and makes the entry final",
                other,
                owner,
                mig(Kind::ConnStateAck, m1, sport, owner, Some(other)),
                "fwd_tcpmig",
            ),
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
            relayed(
                "PREPARE-ACK back to the original server: pending entry toward it",
                owner,
                other,
                mig_epoch(Kind::PrepareAck, m2, m1, sport, other, Some(owner)),
                "fwd_prepare_ack",
            ),
            relayed(
                "CONN_STATE_ACK of the return makes it final (entry kept as a tombstone)",
                owner,
                other,
                mig(Kind::ConnStateAck, m2, sport, other, Some(owner)),
                "fwd_tcpmig",
            ),
            client_to(
                "returned flow goes to the original server",
                sport,
                TCP_ACK,
                owner,
                "fwd_migrated",
            ),
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
                desc: "server FIN (from the VIP) passes to the kernel and is noted",
                side: Side::Server,
                input: server_tcp(owner, sport, TCP_ACK | TCP_FIN),
                verdict: XDP_PASS,
                output: None,
                reason: "pass_not_service",
            },
            client_to(
                "client FIN after the server's is forwarded and closes the flow",
                sport,
                TCP_ACK | TCP_FIN,
                owner,
                "fwd_migrated",
            ),
            client_to(
                "client RST is forwarded and removes the flow",
                sport,
                TCP_RST,
                owner,
                "fwd_migrated",
            ),
            client_to(
                "non-SYN without entry is re-placed by Maglev (switch restart)",
                sport,
                TCP_ACK,
                owner,
                "fwd_recovered",
            ),
            Case {
                desc: "ring placement: SYN takes the LWRR ring's server",
                side: Side::Client,
                input: client_tcp(VIP_RING, 41000, TCP_SYN),
                verdict: XDP_REDIRECT,
                output: Some(to_server_tcp(1, 41000, TCP_SYN)),
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
    let kinds = flow_events(&mut lab, key);
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

/// A flow closes (CLOSED event, reaped after the linger) only when FINs
/// have passed both ways: after the client's FIN alone a half-closed
/// connection may stream for seconds, and reaping its migration entry then
/// sent the client's ACKs to the wrong server (1,000-connection lab test).
#[test]
fn client_fin_alone_does_not_close_the_flow() {
    let mut lab = setup();
    let sport = 40500;
    let owner = maglev_server(&lab, sport, VIP);
    let key = flow_key(sport);
    let closed = |lab: &mut Lab| {
        let mut evs = Vec::new();
        lab.dp.drain_events(&mut evs).unwrap();
        evs.iter()
            .filter(|e| e.key == key && e.kind == EV_CLOSED)
            .count()
    };
    run(
        &mut lab,
        vec![
            client_to("SYN places the flow", sport, TCP_SYN, owner, "fwd_new_flow"),
            client_to(
                "client FIN: half-closed, still open",
                sport,
                TCP_ACK | TCP_FIN,
                owner,
                "fwd_established",
            ),
        ],
    );
    assert_eq!(closed(&mut lab), 0, "client FIN alone closed the flow");
    run(
        &mut lab,
        vec![Case {
            desc: "server FIN completes the close",
            side: Side::Server,
            input: server_tcp(owner, sport, TCP_ACK | TCP_FIN),
            verdict: XDP_PASS,
            output: None,
            reason: "pass_not_service",
        }],
    );
    assert_eq!(closed(&mut lab), 1, "FINs both ways must close the flow");
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
    let key = flow_key(sport);
    let (a1, a2, a3, a4, a9, b1) = (
        mid(a, 1),
        mid(a, 2),
        mid(a, 3),
        mid(a, 4),
        mid(a, 9),
        mid(b, 1),
    );
    // The origin's ownership epoch (TCPMig v2) in each migration below:
    // b1 follows a1, a2 and a4 follow b1; the others from placement.
    let epoch = move |id| match id {
        _ if id == b1 => a1,
        _ if id == a2 || id == a4 => b1,
        _ => 0,
    };
    // Message helpers: `ack(id, o, t)` is a PREPARE_ACK from t to o, etc.
    let pa = |id, o, t| mig_epoch(Kind::PrepareAck, id, epoch(id), sport, o, Some(t));
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
            client_to("SYN placed on a", sport, TCP_SYN, a, "fwd_new_flow"),
            prepared("PREPARE a1 (a->b)", a1, sport, a, b),
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
                desc: "PREPARE_ACK b1 (b->a) while a1 is pending, its epoch not a1: dropped",
                side: Side::Server,
                input: udp_from(
                    server_ip(a),
                    server_ip(b),
                    &mig_epoch(Kind::PrepareAck, b1, 0, sport, b, Some(a)),
                ),
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
            relayed(
                "CONN_STATE_ACK a9 (not the pending migration): forwarded, no change",
                b,
                a,
                csa(a9, a, b),
                "fwd_tcpmig",
            ),
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
            relayed(
                "ABORT decision a1 from b after its commit (impossible, forged): no change",
                b,
                a,
                abort(a1, a, Some(b)),
                "fwd_tcpmig",
            ),
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
            relayed(
                "CONN_STATE_ACK b1 from a: final on a",
                a,
                b,
                csa(b1, b, a),
                "fwd_tcpmig",
            ),
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
            relayed(
                "ABORT decision a2 from b (dst == origin): forwarded to a",
                b,
                a,
                abort(a2, a, Some(b)),
                "fwd_tcpmig",
            ),
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
            relayed(
                "ABORT decision a3 (another migration) from b: forwarded, no change",
                b,
                a,
                abort(a3, a, Some(b)),
                "fwd_tcpmig",
            ),
            Case {
                desc: "ABORT request a4 to the switch: steered to b",
                side: Side::Server,
                input: udp_from(server_ip(a), SWITCH_SV, &abort(a4, a, None)),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(b, server_ip(a), &abort(a4, a, None))),
                reason: "fwd_tcpmig",
            },
            relayed(
                "CONN_STATE_ACK a4 from b: final on b",
                b,
                a,
                csa(a4, a, b),
                "fwd_tcpmig",
            ),
            Case {
                desc: "client data to b",
                ..data(b)
            },
        ],
    );
    assert_eq!(entry(&mut lab), Some(CMigration::owner(b, a4)));
    run(
        &mut lab,
        vec![Case {
            desc: "PREPARE_ACK b1 (epoch a1) delayed past a2 and a4: the entry {b, a4} is \
                   not its epoch, dropped (TCPMig v1 installed it and blackholed the flow)",
            side: Side::Server,
            input: ack_in(b1, b, a),
            verdict: XDP_DROP,
            output: None,
            reason: "drop_prepare_ack_stale",
        }],
    );
    assert_eq!(entry(&mut lab), Some(CMigration::owner(b, a4)));

    // Events: the store sees owners when they become final only.
    let kinds = flow_events(&mut lab, key);
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
/// Migration ids of one origin compare in serial-number arithmetic: a
/// hostagent seeds its counter from the wall clock (milliseconds, wrapping
/// every ~49.7 days) so that a restarted process continues above the ids
/// of the one before; an id just past the wrap is newer than one just
/// before it, and an id just before it older than one after.
#[test]
fn migration_ids_of_one_origin_compare_across_the_counter_wrap() {
    let mut lab = setup();
    let sport = 44100;
    let a = maglev_server(&lab, sport, VIP);
    let b = 1 - a;
    let key = flow_key(sport);
    let (older, old, new) = (mid(a, 0xffff_ffe0), mid(a, 0xffff_fff0), mid(a, 5));
    let pa = |id| mig_epoch(Kind::PrepareAck, id, 0, sport, a, Some(b));
    let ack = |desc, id, fwd: bool| Case {
        desc,
        side: Side::Server,
        input: udp_from(server_ip(b), server_ip(a), &pa(id)),
        verdict: if fwd { XDP_REDIRECT } else { XDP_DROP },
        output: fwd.then(|| udp_to_server(a, server_ip(b), &pa(id))),
        reason: if fwd {
            "fwd_prepare_ack"
        } else {
            "drop_prepare_ack_stale"
        },
    };
    let abort = |id| mig(Kind::Abort, id, sport, a, Some(b));
    run(
        &mut lab,
        vec![
            client_to("SYN placed on a", sport, TCP_SYN, a, "fwd_new_flow"),
            prepared("its PREPARE", old, sport, a, b),
            ack("PREPARE_ACK of id 2^32-16: pending toward b", old, true),
            relayed(
                "its ABORT decision from b: final on a",
                b,
                a,
                abort(old),
                "fwd_tcpmig",
            ),
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::owner(a, old))
    );
    run(
        &mut lab,
        vec![
            ack("PREPARE_ACK of id 2^32-32 (older): stale", older, false),
            ack(
                "PREPARE_ACK of id 5 (past the wrap, newer): installs",
                new,
                true,
            ),
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::pending(b, new))
    );
}

/// The last migration id of each origin (`origin_ids`, told to a
/// registering hostagent in REGISTER_ACK so that a restarted process
/// numbers its migrations above the ids the steering memory and the
/// targets still hold): every PREPARE of a registered origin, target
/// picked by the switch or named, moves it to the newest id in
/// serial-number arithmetic, across the counter's wrap; an older id, an id
/// of another address than its origin field, and a PREPARE of an origin
/// that is not a registered server leave it.
#[test]
fn the_last_migration_id_of_each_origin_is_remembered() {
    let mut lab = setup();
    let sport = 45200;
    let prepare = |lab: &mut Lab, origin: u32, id: u64, target: Option<u32>| {
        let m = mig(Kind::Prepare, id, sport, origin, target);
        lab.dp
            .test_run(&udp_from(server_ip(origin), SWITCH_SV, &m), lab.sv, 1)
            .unwrap();
    };
    let last = |lab: &mut Lab, s: u32| lab.dp.last_migration_id(server_ip(s)).unwrap();
    assert_eq!(last(&mut lab, 0), None);
    prepare(&mut lab, 0, mid(0, 0xffff_fff0), None);
    assert_eq!(last(&mut lab, 0), Some(mid(0, 0xffff_fff0)));
    prepare(&mut lab, 0, mid(0, 0xffff_ffe0), None);
    assert_eq!(last(&mut lab, 0), Some(mid(0, 0xffff_fff0)), "older id");
    prepare(&mut lab, 0, mid(0, 3), Some(1));
    assert_eq!(
        last(&mut lab, 0),
        Some(mid(0, 3)),
        "past the wrap, named target"
    );
    prepare(&mut lab, 0, mid(1, 100), None);
    assert_eq!(
        last(&mut lab, 0),
        Some(mid(0, 3)),
        "an id of another address"
    );
    assert_eq!(last(&mut lab, 1), None);
    prepare(&mut lab, 1, mid(1, 7), None);
    assert_eq!(last(&mut lab, 1), Some(mid(1, 7)));
    assert_eq!(last(&mut lab, 0), Some(mid(0, 3)));
    prepare(&mut lab, 9, mid(9, 1), None);
    assert_eq!(last(&mut lab, 9), None, "not a registered server");
}

/// A migration whose CONN_STATE_ACK has not passed the switch (lost,
/// delayed, or through the other program of a takeover in place): its
/// target owns the flow and may migrate it on. That next migration names
/// the first as its epoch, which proves the commit: its PREPARE_ACK takes
/// the entry still pending toward it (before, dropped as stale until the
/// first migration's CONN_STATE_ACK came, for good if it never would), and
/// its outcomes settle it. An ABORT decision proves it the same way.
#[test]
fn a_migration_from_a_pending_target_with_that_epoch_supersedes_the_entry() {
    let mut lab = setup();
    let sport = 44200;
    let a = maglev_server(&lab, sport, VIP);
    let b = 1 - a;
    let key = flow_key(sport);
    let (a1, b1, b2) = (mid(a, 1), mid(b, 1), mid(b, 2));
    let pa = |id, ep, o: u32, t: u32| {
        udp_from(
            server_ip(t),
            server_ip(o),
            &mig_epoch(Kind::PrepareAck, id, ep, sport, o, Some(t)),
        )
    };
    run(
        &mut lab,
        vec![
            client_to("SYN placed on a", sport, TCP_SYN, a, "fwd_new_flow"),
            prepared("PREPARE a1 (a->b)", a1, sport, a, b),
            relayed(
                "PREPARE_ACK a1 (a->b): pending toward b",
                b,
                a,
                mig(Kind::PrepareAck, a1, sport, a, Some(b)),
                "fwd_prepare_ack",
            ),
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::pending(b, a1))
    );
    // a1's CONN_STATE_ACK never passes.
    run(
        &mut lab,
        vec![
            Case {
                desc: "PREPARE_ACK b1 (b->a) naming epoch 0: dropped (proves nothing)",
                side: Side::Server,
                input: pa(b1, 0, b, a),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_prepare_ack_stale",
            },
            Case {
                desc: "PREPARE_ACK b1 (b->a) naming epoch a1: pending toward a",
                side: Side::Server,
                input: pa(b1, a1, b, a),
                verdict: XDP_REDIRECT,
                output: Some(udp_to_server(
                    b,
                    server_ip(a),
                    &mig_epoch(Kind::PrepareAck, b1, a1, sport, b, Some(a)),
                )),
                reason: "fwd_prepare_ack",
            },
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::pending(a, b1))
    );
    // The same proof settles an outcome over the pending entry: b1's ABORT
    // decision over a1's entry (b1's PREPARE_ACK lost here) makes b the owner.
    lab.dp
        .insert_migration(key, CMigration::pending(b, a1))
        .unwrap();
    run(
        &mut lab,
        vec![relayed(
            "ABORT decision b2 (b->a, epoch a1) from a: final on b",
            a,
            b,
            mig_epoch(Kind::Abort, b2, a1, sport, b, Some(a)),
            "fwd_tcpmig",
        )],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::owner(b, b2))
    );
    lab.dp
        .insert_migration(key, CMigration::pending(b, a1))
        .unwrap();
    run(
        &mut lab,
        vec![relayed(
            "CONN_STATE_ACK b2 (b->a, epoch a1) from a: final on a",
            a,
            b,
            mig_epoch(Kind::ConnStateAck, b2, a1, sport, b, Some(a)),
            "fwd_tcpmig",
        )],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::owner(a, b2))
    );
}

/// A client resets a connection just migrated and connects again from the
/// same port at once; the target's answer to a duplicate of the migration's
/// PREPARE arrives late (found by the harness property
/// `reconnecting_during_a_migration_never_strands_the_new_connection`,
/// 2 failing cases in ~50,000). The new connection is placed on the old
/// origin (the reset removed the entries); that late PREPARE_ACK (and
/// CONN_STATE_ACK) found no entry and a flow on the origin, and sent the new
/// connection to the old target, which reset it. Now a flow the program
/// made for a SYN takes them only after a PREPARE of its own.
#[test]
fn a_late_prepare_ack_of_a_closed_connection_leaves_a_new_one_on_its_tuple_alone() {
    let mut lab = setup();
    let sport = 44300;
    let a = maglev_server(&lab, sport, VIP);
    let b = 1 - a;
    let key = flow_key(sport);
    let (a1, a2) = (mid(a, 1), mid(a, 2));
    let pa = |id| mig(Kind::PrepareAck, id, sport, a, Some(b));
    run(
        &mut lab,
        vec![
            client_to("SYN placed on a", sport, TCP_SYN, a, "fwd_new_flow"),
            prepared("PREPARE a1 (a->b)", a1, sport, a, b),
            relayed(
                "PREPARE_ACK a1: pending toward b",
                b,
                a,
                pa(a1),
                "fwd_prepare_ack",
            ),
            relayed(
                "CONN_STATE_ACK a1: final on b",
                b,
                a,
                mig(Kind::ConnStateAck, a1, sport, a, Some(b)),
                "fwd_tcpmig",
            ),
            client_to(
                "the client's reset, to b",
                sport,
                TCP_RST,
                b,
                "fwd_migrated",
            ),
            client_to(
                "its new SYN: placed on a",
                sport,
                TCP_SYN,
                a,
                "fwd_new_flow",
            ),
            Case {
                desc: "a1's late PREPARE_ACK (a duplicate PREPARE's): dropped",
                side: Side::Server,
                input: udp_from(server_ip(b), server_ip(a), &pa(a1)),
                verdict: XDP_DROP,
                output: None,
                reason: "drop_prepare_ack_stale",
            },
            relayed(
                "a1's late CONN_STATE_ACK: forwarded, settles nothing",
                b,
                a,
                mig(Kind::ConnStateAck, a1, sport, a, Some(b)),
                "fwd_tcpmig",
            ),
            client_to(
                "the new connection stays on a",
                sport,
                TCP_ACK,
                a,
                "fwd_established",
            ),
        ],
    );
    assert_eq!(lab.dp.lookup_migration(key).unwrap(), None);
    // The new connection's own migration is taken.
    run(
        &mut lab,
        vec![
            prepared("PREPARE a2 (a->b)", a2, sport, a, b),
            relayed(
                "PREPARE_ACK a2: pending toward b",
                b,
                a,
                pa(a2),
                "fwd_prepare_ack",
            ),
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(key).unwrap(),
        Some(CMigration::pending(b, a2))
    );
}

#[test]
fn abort_decision_without_entry_leaves_a_tombstone() {
    let mut lab = setup();
    let sport = 44100;
    let a = maglev_server(&lab, sport, VIP);
    let b = 1 - a;
    let key = flow_key(sport);
    let id = mid(a, 5);
    let abort = mig(Kind::Abort, id, sport, a, Some(b));
    let ack = mig(Kind::PrepareAck, id, sport, a, Some(b));
    run(
        &mut lab,
        vec![
            client_to("SYN placed on a", sport, TCP_SYN, a, "fwd_new_flow"),
            relayed(
                "ABORT decision from b, no entry: forwarded to a",
                b,
                a,
                abort,
                "fwd_tcpmig",
            ),
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
            client_to("client data stays on a", sport, TCP_ACK, a, "fwd_migrated"),
            relayed(
                "a later migration a->b proceeds",
                b,
                a,
                mig(Kind::PrepareAck, mid(a, 6), sport, a, Some(b)),
                "fwd_prepare_ack",
            ),
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
    let okey = flow_key(other);
    lab.dp
        .insert_flow(
            okey,
            CFlow {
                server: b,
                service: 0,
                flags: 0,
                ..Default::default()
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
    lab.dp
        .set_server(4, server(SERVER_LIVE, 4, lab.sv))
        .unwrap();
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

/// A weighted round-robin target ring (pairs of target and alternate):
/// each PREPARE takes the next pair's target, or its alternate when the
/// target is the origin, so a server whose weight fills most of the ring
/// (and comes twice in a row) still finds a target for every migration of
/// its own.
#[test]
fn paired_target_ring_skips_the_origin_to_its_alternate() {
    let mut lab = setup();
    lab.dp
        .set_server(4, server(SERVER_LIVE, 4, lab.sv))
        .unwrap();
    // Targets 0 0 1 0 4 0 (weights 4:1:1), alternates of 0 alternating
    // 1 and 4, of 1 and 4 the server 0.
    lab.dp
        .write_ring(
            0,
            RING_TARGET,
            &CRing::from_slice(RING_PAIRED, &[0, 1, 0, 4, 1, 0, 0, 1, 4, 0, 0, 4]),
        )
        .unwrap();
    let sport = 45100;
    let target_of = |lab: &mut Lab, origin: u32, n: u32| {
        let m = mig(Kind::Prepare, mid(origin, n), sport, origin, None);
        let r = lab
            .dp
            .test_run(&udp_from(server_ip(origin), SWITCH_SV, &m), lab.sv, 1)
            .unwrap();
        assert_eq!(r.verdict, XDP_REDIRECT, "PREPARE {n} of origin {origin}");
        [0u32, 1, 4]
            .into_iter()
            .find(|s| r.packet == udp_to_server(*s, server_ip(origin), &m))
            .expect("steered to 0, 1 or 4")
    };
    // Two turns of the ring from origin 0: 1 and 4 three times each per turn.
    let from0: Vec<u32> = (0..12).map(|n| target_of(&mut lab, 0, n)).collect();
    assert!(!from0.contains(&0), "{from0:?}");
    let count = |v: &[u32], x: u32| v.iter().filter(|y| **y == x).count();
    assert_eq!((count(&from0, 1), count(&from0, 4)), (6, 6), "{from0:?}");
    // From origin 1: server 0 for its own pairs and as the alternate of 1.
    let from1: Vec<u32> = (0..6).map(|n| target_of(&mut lab, 1, n)).collect();
    assert_eq!((count(&from1, 0), count(&from1, 4)), (5, 1), "{from1:?}");
}

#[test]
fn owners_and_malformed_packets() {
    let mut lab = setup();
    let dead_key = flow_key(42000);
    lab.dp
        .insert_flow(
            dead_key,
            CFlow {
                server: 3,
                service: 0,
                flags: 0,
                ..Default::default()
            },
        )
        .unwrap();
    let drain_key = flow_key(42001);
    lab.dp
        .insert_flow(
            drain_key,
            CFlow {
                server: 2,
                service: 0,
                flags: 0,
                ..Default::default()
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
            client_to(
                "flow owned by a draining server is still forwarded",
                42001,
                TCP_ACK,
                2,
                "fwd_established",
            ),
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
    let k = |p: u16| flow_key(p);
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
                    ..Default::default()
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

/// Regression (stuck-after-migration, bench-skew): a connection migrates,
/// closes (FINs both ways: the flow is CLOSING, its entries linger), and a
/// new connection reuses the 4-tuple at once. Its SYN must get a flow entry
/// of its own (on the old connection's last owner, which is live), not just
/// follow the old connection's migration entry: that kept the flow
/// CLOSING, and the control plane's reaper removed the new connection's
/// entries `closed_linger` later, dropping every further client segment
/// (`drop_no_flow`) while the connection was in use.
#[test]
fn syn_reusing_a_closed_migrated_tuple_gets_its_own_flow() {
    let mut lab = setup();
    let sport = 40123;
    let owner = maglev_server(&lab, sport, VIP);
    let other = 1 - owner;
    let key = flow_key(sport);
    let m1 = mid(owner, 7);
    let server_fin = server_tcp(other, sport, TCP_ACK | TCP_FIN);
    run(
        &mut lab,
        vec![
            client_to(
                "first connection: SYN placed by Maglev",
                sport,
                TCP_SYN,
                owner,
                "fwd_new_flow",
            ),
            prepared("the PREPARE", m1, sport, owner, other),
            relayed(
                "PREPARE-ACK installs the migration entry toward the target",
                other,
                owner,
                mig(Kind::PrepareAck, m1, sport, owner, Some(other)),
                "fwd_prepare_ack",
            ),
            relayed(
                "CONN_STATE_ACK makes it final",
                other,
                owner,
                mig(Kind::ConnStateAck, m1, sport, owner, Some(other)),
                "fwd_tcpmig",
            ),
            Case {
                desc: "the target's FIN is noted",
                side: Side::Server,
                input: server_fin.clone(),
                verdict: XDP_PASS,
                output: None,
                reason: "pass_not_service",
            },
            client_to(
                "the client's FIN closes the flow (CLOSING)",
                sport,
                TCP_ACK | TCP_FIN,
                other,
                "fwd_migrated",
            ),
        ],
    );
    let flags = lab.dp.lookup_flow(key).unwrap().map(|f| f.flags);
    assert_eq!(
        flags.map(|f| f & FLOW_CLOSING),
        Some(FLOW_CLOSING),
        "flags {flags:?}"
    );
    run(
        &mut lab,
        vec![
            client_to(
                "a SYN reusing the closed tuple is a new flow on the last owner",
                sport,
                TCP_SYN,
                other,
                "fwd_new_flow",
            ),
            client_to(
                "the new connection's ACK follows its own flow entry",
                sport,
                TCP_ACK,
                other,
                "fwd_established",
            ),
        ],
    );
    assert_eq!(lab.dp.lookup_migration(key).unwrap(), None);
    let flow = lab.dp.lookup_flow(key).unwrap().expect("new flow entry");
    assert_eq!(
        (flow.server, flow.flags & FLOW_CLOSING),
        (other, 0),
        "the reaper must not take the new connection's entry"
    );
}

/// Regression: a client resets a migrated connection while a migration of it
/// is in flight, and at once opens a new one from the same port. The reset
/// removes the flow's entries; a TCPMig message of the old migration that
/// passes afterwards re-creates a migration entry without a flow entry (a
/// PREPARE_ACK: pending toward its target; an ABORT decision: a tombstone
/// on the origin). The new SYN followed that entry and made no flow entry:
/// the control plane's reaper (queued by the reset's CLOSED event) then
/// deleted the migration entry `closed_linger` later, and the live
/// connection's segments were placed anew ("recovered"), possibly on a
/// server that resets them. A pending entry also sent the SYN to a target
/// that buffers it for an import that never completes.
#[test]
fn syn_after_a_reset_ignores_a_migration_entry_the_old_migration_left() {
    use capybara_proto::Instant;
    use capybara_switchd::control::{ControlConfig, ControlPlane, TargetPolicy, VecSink};

    let mut lab = setup();
    // Four tuples placed on the same server `a`, each reset by its client
    // while a migration a -> b is under way; no new connection on the
    // fourth.
    let a = maglev_server(&lab, 41000, VIP);
    let b = 1 - a;
    let ports: Vec<u16> = (41000..42000)
        .filter(|p| maglev_server(&lab, *p, VIP) == a)
        .take(4)
        .collect();
    let (p_ack, p_done, p_abort, p_left) = (ports[0], ports[1], ports[2], ports[3]);
    for &p in &ports {
        run(
            &mut lab,
            vec![
                client_to("SYN placed on a", p, TCP_SYN, a, "fwd_new_flow"),
                client_to("handshake ACK", p, TCP_ACK, a, "fwd_established"),
                client_to("the client resets it", p, TCP_RST, a, "fwd_established"),
            ],
        );
        assert_eq!(lab.dp.lookup_migration(flow_key(p)).unwrap(), None);
        assert_eq!(lab.dp.lookup_flow(flow_key(p)).unwrap(), None);
    }
    // The old migrations' messages that pass the switch after the resets.
    let id = mid(a, 1);
    run(
        &mut lab,
        vec![
            relayed(
                "late PREPARE_ACK: a pending entry toward b, no flow entry",
                b,
                a,
                mig(Kind::PrepareAck, id, p_ack, a, Some(b)),
                "fwd_prepare_ack",
            ),
            relayed(
                "late PREPARE_ACK of another tuple",
                b,
                a,
                mig(Kind::PrepareAck, id, p_done, a, Some(b)),
                "fwd_prepare_ack",
            ),
            relayed(
                "its CONN_STATE_ACK: final on b, no flow entry",
                b,
                a,
                mig(Kind::ConnStateAck, id, p_done, a, Some(b)),
                "fwd_tcpmig",
            ),
            relayed(
                "late ABORT decision: a tombstone on a, no flow entry",
                b,
                a,
                mig(Kind::Abort, id, p_abort, a, Some(b)),
                "fwd_tcpmig",
            ),
            relayed(
                "late ABORT decision of the tuple nobody reuses",
                b,
                a,
                mig(Kind::Abort, id, p_left, a, Some(b)),
                "fwd_tcpmig",
            ),
        ],
    );
    assert_eq!(
        lab.dp.lookup_migration(flow_key(p_ack)).unwrap(),
        Some(CMigration::pending(b, id))
    );
    assert_eq!(
        lab.dp.lookup_migration(flow_key(p_done)).unwrap(),
        Some(CMigration::owner(b, id))
    );
    assert_eq!(
        lab.dp.lookup_migration(flow_key(p_abort)).unwrap(),
        Some(CMigration::owner(a, id))
    );
    // New connections from the same ports. A final entry names the old
    // connection's last owner: the new flow goes there. A pending entry
    // names a target that has imported nothing (it would buffer the SYN
    // for the import): the new flow is placed (Maglev: a).
    let expect = [(p_ack, a), (p_done, b), (p_abort, a)];
    for &(p, to) in &expect {
        run(
            &mut lab,
            vec![
                client_to(
                    "a SYN reusing the reset tuple is a new flow",
                    p,
                    TCP_SYN,
                    to,
                    "fwd_new_flow",
                ),
                client_to(
                    "the new connection's ACK follows its own flow entry",
                    p,
                    TCP_ACK,
                    to,
                    "fwd_established",
                ),
            ],
        );
        assert_eq!(
            lab.dp.lookup_migration(flow_key(p)).unwrap(),
            None,
            "port {p}"
        );
        let flow = lab.dp.lookup_flow(flow_key(p)).unwrap();
        assert_eq!(
            flow.map(|f| (f.server, f.flags)),
            Some((to, FLOW_ESTABLISHED | FLOW_UNPREPARED)),
            "port {p}"
        );
    }

    // The control plane's reaper, queued by the resets' CLOSED events,
    // runs `closed_linger` later: it removes what the old migration left
    // of the tuple nobody reused, and leaves the new connections alone.
    let Lab { _ns, dp, .. } = lab;
    let cfg = ControlConfig::new(std::time::Duration::from_secs(3), TargetPolicy::RoundRobin);
    let linger_ms = cfg.closed_linger.as_millis() as u64;
    let mut cp = ControlPlane::new(dp, cfg);
    let mut sink = VecSink::default();
    cp.flush_events(Instant::ZERO, &mut sink).unwrap();
    let closed = |p: u16| {
        sink.0
            .iter()
            .filter(|e| e.key == flow_key(p) && e.kind == EV_CLOSED)
            .count()
    };
    assert_eq!(ports.iter().map(|p| closed(*p)).collect::<Vec<_>>(), [1; 4]);
    cp.tick(Instant::from_millis(linger_ms - 1)).unwrap();
    assert!(cp.dp.lookup_migration(flow_key(p_left)).unwrap().is_some());
    cp.tick(Instant::from_millis(linger_ms + 1)).unwrap();
    assert_eq!(cp.dp.lookup_migration(flow_key(p_left)).unwrap(), None);
    assert_eq!(
        cp.reaped_total, 1,
        "the tombstone of the tuple nobody reused"
    );
    for &(p, to) in &expect {
        assert_eq!(
            cp.dp.lookup_migration(flow_key(p)).unwrap(),
            None,
            "port {p}"
        );
        assert_eq!(
            cp.dp.lookup_flow(flow_key(p)).unwrap().map(|f| f.server),
            Some(to),
            "port {p}: the reaper took the new connection's entry"
        );
    }
}

/// A retiring (deleted) service: its established flows are forwarded as
/// before, nothing new is placed: a SYN, or a stray segment, is answered
/// with a reset from the VIP (a reset is not answered); restored, it
/// places again.
#[test]
fn a_retiring_service_forwards_its_flows_and_places_nothing() {
    let mut lab = setup();
    let (open, new, stray) = (40201, 40202, 40203);
    let owner = maglev_server(&lab, open, VIP);
    let placing = |placement| CService {
        index: 0,
        placement,
        flags: 0,
    };
    // client_tcp sends seq 1000, and ack 2000 with ACK.
    let reset = |desc, sport, flags, seq, ack| Case {
        desc,
        side: Side::Client,
        input: client_tcp(VIP, sport, flags),
        verdict: XDP_TX,
        output: Some(tcp_reset_frame(
            CLIENT_MAC, CL_MAC, VIP, 80, CLIENT, sport, seq, ack,
        )),
        reason: "reset_retired",
    };
    run(
        &mut lab,
        vec![
            client_to("SYN placed", open, TCP_SYN, owner, "fwd_new_flow"),
            client_to("handshake ACK", open, TCP_ACK, owner, "fwd_established"),
        ],
    );
    lab.dp
        .set_service(CServiceKey::tcp(VIP, 80), placing(PLACE_NONE))
        .unwrap();
    run(
        &mut lab,
        vec![
            client_to(
                "retiring: the open connection is forwarded",
                open,
                TCP_ACK | TCP_PSH,
                owner,
                "fwd_established",
            ),
            reset(
                "retiring: a new SYN is reset (ACK = its SEQ + 1)",
                new,
                TCP_SYN,
                0,
                Some(1001),
            ),
            reset(
                "retiring: a segment without entry is reset (SEQ = its ACK), not recovered by Maglev",
                stray,
                TCP_ACK,
                2000,
                None,
            ),
            Case {
                desc: "retiring: data without entry: a bare reset (the payload cut off)",
                side: Side::Client,
                input: tcp_frame(
                    CL_MAC,
                    CLIENT_MAC,
                    CLIENT,
                    stray,
                    VIP,
                    80,
                    TCP_ACK | TCP_PSH,
                    &[7u8; 300],
                ),
                verdict: XDP_TX,
                output: Some(tcp_reset_frame(
                    CLIENT_MAC, CL_MAC, VIP, 80, CLIENT, stray, 2000, None,
                )),
                reason: "reset_retired",
            },
            reset(
                "retiring: a FIN without entry counts one (ACK = SEQ + 1)",
                stray,
                TCP_FIN,
                0,
                Some(1001),
            ),
            Case {
                desc: "retiring: a reset is not answered",
                side: Side::Client,
                input: client_tcp(VIP, stray, TCP_RST),
                verdict: XDP_PASS,
                output: None,
                reason: "pass_not_service",
            },
        ],
    );
    assert_eq!(lab.dp.lookup_flow(flow_key(new)).unwrap(), None);
    assert_eq!(lab.dp.lookup_flow(flow_key(stray)).unwrap(), None);
    lab.dp
        .set_service(CServiceKey::tcp(VIP, 80), placing(PLACE_MAGLEV))
        .unwrap();
    let s = maglev_server(&lab, new, VIP);
    run(
        &mut lab,
        vec![client_to(
            "restored: SYN placed again",
            new,
            TCP_SYN,
            s,
            "fwd_new_flow",
        )],
    );
}

/// A SYN whose placement finds no usable server (every Maglev slot names
/// nobody or a server that is not LIVE, an empty LWRR ring or one naming a
/// draining server) is dropped (`drop_no_server`), unless the control plane
/// marked the service `SVC_REFUSE`: then the VIP answers it with a reset,
/// "connection refused" (`reset_no_server`). Either way a non-SYN segment
/// without an entry is dropped, a SYN with RST is not answered, and an
/// established flow is still forwarded.
#[test]
fn a_syn_without_a_usable_server_is_refused_only_when_the_service_says_so() {
    let mut lab = setup();
    let (open, new, stray) = (40301, 40302, 40303);
    let owner = maglev_server(&lab, open, VIP);
    let key = CServiceKey::tcp(VIP, 80);
    let ring_key = CServiceKey::tcp(VIP_RING, 80);
    let svc = |index, placement, flags| CService {
        index,
        placement,
        flags,
    };
    let refused = |desc, dst, sport| Case {
        desc,
        side: Side::Client,
        input: client_tcp(dst, sport, TCP_SYN),
        verdict: XDP_TX,
        output: Some(tcp_reset_frame(
            CLIENT_MAC,
            CL_MAC,
            dst,
            80,
            CLIENT,
            sport,
            0,
            Some(1001),
        )),
        reason: "reset_no_server",
    };
    let dropped = |desc, dst, sport, flags, reason| Case {
        desc,
        side: Side::Client,
        input: client_tcp(dst, sport, flags),
        verdict: XDP_DROP,
        output: None,
        reason,
    };
    run(
        &mut lab,
        vec![
            client_to("SYN placed", open, TCP_SYN, owner, "fwd_new_flow"),
            client_to("handshake ACK", open, TCP_ACK, owner, "fwd_established"),
        ],
    );
    // The pool's last live member left: every slot names nobody.
    let nobody = vec![NO_SERVER; MAGLEV_SIZE as usize];
    lab.dp
        .write_maglev(0, &maglev::diff(&lab.maglev, &nobody))
        .unwrap();
    lab.dp
        .write_ring(1, RING_PLACEMENT, &CRing::from_slice(RING_ROTATE, &[]))
        .unwrap();
    run(
        &mut lab,
        vec![
            dropped(
                "no server, not marked: SYN dropped (it may be placed on retransmission)",
                VIP,
                new,
                TCP_SYN,
                "drop_no_server",
            ),
            dropped(
                "ring, no server, not marked: SYN dropped",
                VIP_RING,
                new,
                TCP_SYN,
                "drop_no_server",
            ),
        ],
    );
    lab.dp
        .set_service(key, svc(0, PLACE_MAGLEV, SVC_REFUSE))
        .unwrap();
    lab.dp
        .set_service(ring_key, svc(1, PLACE_RING, SVC_REFUSE))
        .unwrap();
    run(
        &mut lab,
        vec![
            refused("marked: SYN refused (ACK = its SEQ + 1)", VIP, new),
            dropped(
                "marked: a non-SYN without entry is still dropped",
                VIP,
                stray,
                TCP_ACK,
                "drop_no_server",
            ),
            dropped(
                "marked: SYN with RST is not answered",
                VIP,
                stray,
                TCP_SYN | TCP_RST,
                "drop_no_server",
            ),
            client_to(
                "marked: the open connection is forwarded",
                open,
                TCP_ACK | TCP_PSH,
                owner,
                "fwd_established",
            ),
            refused("ring, marked: SYN refused", VIP_RING, new),
            dropped(
                "ring, marked: a non-SYN without entry is still dropped",
                VIP_RING,
                stray,
                TCP_ACK,
                "drop_no_flow",
            ),
        ],
    );
    // Slots and rings naming servers that are not LIVE (s2 draining, s3
    // dead): refused too.
    let dead_only = maglev::build_table(
        &[Backend {
            id: 13,
            index: 3,
            weight: 1,
        }],
        MAGLEV_SIZE,
    );
    lab.dp
        .write_maglev(0, &maglev::diff(&nobody, &dead_only))
        .unwrap();
    lab.dp
        .write_ring(1, RING_PLACEMENT, &CRing::from_slice(RING_ROTATE, &[2]))
        .unwrap();
    run(
        &mut lab,
        vec![
            refused("marked, slot names a dead server: SYN refused", VIP, new),
            refused(
                "ring, marked, names a draining server: SYN refused",
                VIP_RING,
                new,
            ),
        ],
    );
    assert_eq!(lab.dp.lookup_flow(flow_key(new)).unwrap(), None);
    // A placeable table under a flag not yet cleared (the control plane
    // writes tables first): placed, never refused.
    lab.dp
        .write_maglev(0, &maglev::diff(&dead_only, &lab.maglev))
        .unwrap();
    let s = maglev_server(&lab, new, VIP);
    run(
        &mut lab,
        vec![client_to(
            "marked but placeable: SYN placed",
            new,
            TCP_SYN,
            s,
            "fwd_new_flow",
        )],
    );
    lab.dp.set_service(key, svc(0, PLACE_MAGLEV, 0)).unwrap();
}

/// Embryonic flows (a SYN, nothing after) are reaped once older than the
/// timeout, with their store mappings; flows that carried a client non-SYN
/// segment, migrated flows, half-closed flows, young SYNs and entries
/// restored from the store are never touched. Real program, real maps,
/// real SQLite store behind the real batching writer.
#[test]
fn embryonic_flows_are_reaped_with_their_store_mappings() {
    use capybara_proto::ServerId;
    use capybara_store::{FlowWriter, FlowWriterConfig, SqliteConfig, SqliteStore, Store};
    use capybara_switchd::control::{FlowEventSink, FlowUpdate};
    use capybara_switchd::embryonic::{monotonic_ns, EmbryonicReaper};
    use capybara_switchd::persist::StoreSink;
    use std::sync::Arc;
    use std::time::Duration;

    let mut lab = setup();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("capy-switchgc-embryonic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store: Arc<dyn Store> = Arc::new(
        rt.block_on(SqliteStore::open(SqliteConfig::at(dir.join("s.db"))))
            .unwrap(),
    );
    let writer = {
        let _g = rt.enter();
        Arc::new(FlowWriter::spawn(
            store.clone(),
            FlowWriterConfig::default(),
        ))
    };
    let mut sink = StoreSink::new(writer.clone());
    let fk = |sport: u16| FlowKey {
        client_ip: CLIENT,
        client_port: sport,
        service_ip: VIP,
        service_port: 80,
    };
    let ck = |sport: u16| CFlowKey::from(fk(sport));
    let (est, syn_only, retried, half_closed) = (45001u16, 45002u16, 45003u16, 45004u16);

    let before = monotonic_ns();
    let mut cases = Vec::new();
    for sport in [est, syn_only, retried, half_closed] {
        cases.push(Case {
            desc: "SYN placed",
            side: Side::Client,
            input: client_tcp(VIP, sport, TCP_SYN),
            verdict: XDP_REDIRECT,
            output: Some(to_server_tcp(
                maglev_server(&lab, sport, VIP),
                sport,
                TCP_SYN,
            )),
            reason: "fwd_new_flow",
        });
    }
    for (sport, flags, desc) in [
        (retried, TCP_SYN, "a retransmitted SYN does not establish"),
        (est, TCP_ACK, "the handshake ACK establishes"),
        (half_closed, TCP_ACK | TCP_FIN, "a FIN establishes too"),
    ] {
        cases.push(Case {
            desc,
            side: Side::Client,
            input: client_tcp(VIP, sport, flags),
            verdict: XDP_REDIRECT,
            output: Some(to_server_tcp(maglev_server(&lab, sport, VIP), sport, flags)),
            reason: "fwd_established",
        });
    }
    // A non-SYN without entry (switch restart, LRU eviction) is recovered
    // as an established flow: it is a live connection.
    let recovered = 45005u16;
    cases.push(Case {
        desc: "a recovered flow is established",
        side: Side::Client,
        input: client_tcp(VIP, recovered, TCP_ACK),
        verdict: XDP_REDIRECT,
        output: Some(to_server_tcp(
            maglev_server(&lab, recovered, VIP),
            recovered,
            TCP_ACK,
        )),
        reason: "fwd_recovered",
    });
    run(&mut lab, cases);
    let after = monotonic_ns();
    let flow = |lab: &mut Lab, sport| lab.dp.lookup_flow(ck(sport)).unwrap();
    let f = flow(&mut lab, syn_only).expect("SYN-only flow");
    assert_eq!(f.flags & FLOW_ESTABLISHED, 0);
    assert!(
        (before..=after).contains(&f.created_ns),
        "created_ns {} is CLOCK_MONOTONIC ({before}..={after})",
        f.created_ns
    );
    for sport in [est, half_closed, recovered] {
        let f = flow(&mut lab, sport).unwrap();
        assert_eq!(
            f.flags & FLOW_ESTABLISHED,
            FLOW_ESTABLISHED,
            "{sport}: {f:?}"
        );
    }
    assert_eq!(flow(&mut lab, retried).unwrap().flags & FLOW_ESTABLISHED, 0);

    // A SYN-only flow that a migration entry points at (never the case for
    // a real embryonic flow, but the reaper must check) and a flow restored
    // from the store (created by the control plane, created_ns 0).
    let (with_mig, restored) = (45006u16, 45007u16);
    lab.dp
        .insert_flow(
            ck(with_mig),
            CFlow {
                server: 0,
                service: 0,
                flags: 0,
                created_ns: before,
            },
        )
        .unwrap();
    lab.dp
        .insert_migration(ck(with_mig), CMigration::owner(1, 1))
        .unwrap();
    lab.dp
        .insert_flow(
            ck(restored),
            CFlow {
                server: 0,
                service: 0,
                flags: 0,
                created_ns: 0,
            },
        )
        .unwrap();

    // The data plane's NEW events become store mappings.
    let mut evs = Vec::new();
    lab.dp.drain_events(&mut evs).unwrap();
    let updates: Vec<FlowUpdate> = evs
        .iter()
        .map(|e| FlowUpdate {
            event: *e,
            key: FlowKey::from(e.key),
            owner: Some(ServerId(e.server + 1)),
        })
        .collect();
    assert_eq!(updates.len(), 5, "four SYNs and one recovery");
    sink.write_batch(&updates);
    rt.block_on(writer.flush(Duration::from_secs(5))).unwrap();
    assert!(rt
        .block_on(store.get_flow(&fk(syn_only)))
        .unwrap()
        .is_some());

    // The paced reaper (`tick`) starts passes from the real program's
    // new-flow counter: the four SYNs were counted there.
    let new_flows = capybara_switchd::abi::stat("fwd_new_flow");
    assert!(lab.dp.stat_counter(new_flows).unwrap() >= 4);
    let mut paced = EmbryonicReaper::new(Duration::from_secs(10), 16_384);
    assert_eq!(
        paced.tick(&mut lab.dp, monotonic_ns(), &mut sink).unwrap(),
        0
    );
    assert_eq!(
        paced.metrics.scanned_total, 0,
        "no walk before they are old"
    );

    // Too young: nothing goes.
    let mut reaper = EmbryonicReaper::new(Duration::from_secs(10), 16_384);
    assert_eq!(
        reaper.step(&mut lab.dp, monotonic_ns(), &mut sink).unwrap(),
        0
    );
    assert_eq!(
        reaper.metrics.passes_total, 1,
        "one step covers a small table"
    );
    assert_eq!(
        reaper.metrics.embryonic_last_pass, 4,
        "syn_only, retried, with_mig, restored"
    );
    // 11 s later (the clock is passed in): the two SYN-only flows go.
    let later = after + 11_000_000_000;
    assert_eq!(reaper.step(&mut lab.dp, later, &mut sink).unwrap(), 2);
    assert_eq!(
        reaper.metrics.spared_total, 1,
        "the one with a migration entry"
    );
    for sport in [syn_only, retried] {
        assert_eq!(flow(&mut lab, sport), None, "{sport} reaped");
    }
    for sport in [est, half_closed, recovered, with_mig, restored] {
        assert!(flow(&mut lab, sport).is_some(), "{sport} kept");
    }
    rt.block_on(writer.flush(Duration::from_secs(5))).unwrap();
    for sport in [syn_only, retried] {
        assert_eq!(
            rt.block_on(store.get_flow(&fk(sport))).unwrap(),
            None,
            "{sport}"
        );
    }
    for sport in [est, half_closed, recovered] {
        assert!(
            rt.block_on(store.get_flow(&fk(sport))).unwrap().is_some(),
            "{sport}"
        );
    }

    // A reaped client that tries again gets a fresh flow.
    let again = maglev_server(&lab, syn_only, VIP);
    run(
        &mut lab,
        vec![Case {
            desc: "a SYN after the reap is placed again",
            side: Side::Client,
            input: client_tcp(VIP, syn_only, TCP_SYN),
            verdict: XDP_REDIRECT,
            output: Some(to_server_tcp(again, syn_only, TCP_SYN)),
            reason: "fwd_new_flow",
        }],
    );

    // A flood: 1,500 old SYN-only entries among 500 established ones, in
    // one bounded step per 4,096 entries.
    let k = |p: u16| CFlowKey::from(fk(20_000 + p));
    let keys: Vec<CFlowKey> = (0..2000u16).map(k).collect();
    let vals: Vec<CFlow> = (0..2000u16)
        .map(|p| CFlow {
            server: u32::from(p % 2),
            service: 0,
            flags: if p % 4 == 0 { FLOW_ESTABLISHED } else { 0 },
            created_ns: 1,
        })
        .collect();
    lab.dp.insert_flows_batch(&keys, &vals).unwrap();
    let reaped_before = reaper.metrics.reaped_total;
    let passes = reaper.metrics.passes_total;
    let mut steps = 0;
    // Old enough for the flood's entries only (created at 1 ns), not for
    // the flows made above (created at `before` or later).
    let flood_clock = before + 10_000_000_000 - 1;
    while reaper.metrics.passes_total == passes {
        reaper.step(&mut lab.dp, flood_clock, &mut sink).unwrap();
        steps += 1;
        assert!(steps < 10, "the pass must end");
    }
    assert_eq!(reaper.metrics.reaped_total - reaped_before, 1500);
    for p in 0..2000u16 {
        assert_eq!(
            lab.dp.lookup_flow(k(p)).unwrap().is_some(),
            p % 4 == 0,
            "flow {p}"
        );
    }
    rt.block_on(writer.close(Duration::from_secs(5))).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Maglev table is written through a shared mapping of the map, not
/// with system calls (src/bpf.rs, `MaglevMem`): after placement changes
/// (s0 leaves, as in a drain; s0 comes back) the kernel reads exactly the
/// table user space computed, slot for slot, and the program places new
/// flows by it; a delta with a bad slot writes nothing.
#[test]
fn maglev_table_written_through_the_mapping_is_what_the_program_reads() {
    let mut lab = setup();
    let both = lab.maglev.clone();
    assert_eq!(lab.dp.maglev_table(0).unwrap(), both, "initial table");
    // Service 1 (ring placement) has no table: its row is untouched.
    assert!(lab.dp.maglev_table(1).unwrap().iter().all(|v| *v == 0));

    // s0 leaves placement (a drain): half of the slots change.
    let only_s1 = maglev::build_table(
        &[Backend {
            id: 11,
            index: 1,
            weight: 1,
        }],
        MAGLEV_SIZE,
    );
    let delta = maglev::diff(&both, &only_s1);
    assert!(
        delta.len() > 30_000 && delta.len() < 35_000,
        "{}",
        delta.len()
    );
    let t = std::time::Instant::now();
    lab.dp.write_maglev(0, &delta).unwrap();
    eprintln!(
        "{} slots written through the mapping in {:?}",
        delta.len(),
        t.elapsed()
    );
    assert_eq!(lab.dp.maglev_table(0).unwrap(), only_s1, "after s0 left");
    assert!(lab.dp.maglev_table(1).unwrap().iter().all(|v| *v == 0));
    lab.maglev = only_s1.clone();
    // Ports Maglev had put on s0 now go to s1.
    let moved: Vec<u16> = (41000..42000u16)
        .filter(|p| {
            let k = FlowKey::from(flow_key(*p));
            both[(maglev::flow_hash(&k) % MAGLEV_SIZE) as usize] == 0
        })
        .take(20)
        .collect();
    assert_eq!(moved.len(), 20);
    run(
        &mut lab,
        moved
            .iter()
            .map(|p| {
                client_to(
                    "SYN placed by the new table",
                    *p,
                    TCP_SYN,
                    1,
                    "fwd_new_flow",
                )
            })
            .collect(),
    );

    // A delta with a slot out of range is refused before any store.
    let bad = [(0u32, 0u32), (MAGLEV_SIZE, 0)];
    assert!(lab.dp.write_maglev(0, &bad).is_err());
    assert!(lab.dp.write_maglev(MAX_SERVICES, &[(0, 0)]).is_err());
    assert_eq!(lab.dp.maglev_table(0).unwrap(), only_s1, "bad delta wrote");

    // s0 back (undrain): the original table, slot for slot.
    lab.dp
        .write_maglev(0, &maglev::diff(&only_s1, &both))
        .unwrap();
    assert_eq!(lab.dp.maglev_table(0).unwrap(), both, "after s0 came back");
    lab.maglev = both;
    let p = (42000..43000u16)
        .find(|p| maglev_server(&lab, *p, VIP) == 0)
        .unwrap();
    run(
        &mut lab,
        vec![client_to(
            "SYN placed on s0 again",
            p,
            TCP_SYN,
            0,
            "fwd_new_flow",
        )],
    );
}

/// The pool monitor's load is request packets (TCP payload), not every
/// packet: a bare ACK or a handshake packet counts in `packets` only.
#[test]
fn pool_monitor_counts_request_packets() {
    let mut lab = setup();
    let sport = 40777;
    let owner = maglev_server(&lab, sport, VIP);
    let request = |payload: &'static [u8]| Case {
        desc: "a request carries payload",
        side: Side::Client,
        input: tcp_frame(CL_MAC, CLIENT_MAC, CLIENT, sport, VIP, 80, TCP_ACK, payload),
        verdict: XDP_REDIRECT,
        output: Some(tcp_frame(
            server_mac(owner),
            SV_MAC,
            CLIENT,
            sport,
            server_ip(owner),
            80,
            TCP_ACK,
            payload,
        )),
        reason: "fwd_established",
    };
    let packets0 = lab.dp.server_packets().unwrap()[owner as usize];
    let requests0 = lab.dp.server_request_packets().unwrap()[owner as usize];
    run(
        &mut lab,
        vec![
            client_to("SYN", sport, TCP_SYN, owner, "fwd_new_flow"),
            client_to("bare ACK", sport, TCP_ACK, owner, "fwd_established"),
            request(b"GET / HTTP/1.1\r\n\r\n"),
            client_to("another bare ACK", sport, TCP_ACK, owner, "fwd_established"),
            request(b"x"),
        ],
    );
    let packets = lab.dp.server_packets().unwrap()[owner as usize] - packets0;
    let requests = lab.dp.server_request_packets().unwrap()[owner as usize] - requests0;
    assert_eq!((packets, requests), (5, 2));
}
