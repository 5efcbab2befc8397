//! A takeover in place keeps the migrations of the predecessor (real
//! programs and pinned links; root, a throw-away network namespace, pins in
//! a directory unique to the test under /sys/fs/bpf, removed on every exit
//! path): docs/SWITCHD.md, HA, "Migrations across a takeover".
//!
//! The predecessor (a switchd killed with -9: its links pinned, its program
//! forwarding) holds migration entries the store cannot have: a migration
//! in flight (pending toward its target), a finished one whose owner its
//! writer had not persisted, a tombstone, and a PREPARE steering memory.
//! The successor's tables are the store's copy, with other server and
//! service indexes (a standby numbers servers in its own order). After
//! `attach_pinned` and `finish_adoption`:
//! - every entry is in the successor's table with its server translated
//!   (by data address), and the connection in flight goes on reaching its
//!   target, whose CONN_STATE_ACK then settles it as it would have at the
//!   predecessor (MIGRATED event for the store);
//! - what the predecessor's program did between the copy and the last
//!   link's switch (a CONN_STATE_ACK, a client's reset, a new connection
//!   on a closed migrated 4-tuple) is applied;
//! - the owners the store lacked are sent to it (MIGRATED events);
//! - a retransmitted PREPARE reaches the target its first copy reached.
//!
//! Before this copy (flows only) the connection in flight went back to its
//! origin, which had handed it over: broken (this test failed there on the
//! first assertion: no migration entry).

#[allow(unused_imports)]
mod support;

use std::path::PathBuf;
use support::*;

use capybara_switchd::bpf::{on_bpffs, Attached, LinkPins};

/// Removes the test's pin root, also when the test panics.
struct PinRoot(PathBuf);

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Where a test's predecessor and successor run: a throw-away namespace
/// with a client-side and a server-side interface, and a pin directory of
/// its own (owned).
struct Place {
    _root: PinRoot,
    ns: TestNetns,
    pins: LinkPins,
    cl: u32,
    sv: u32,
}

/// `None` (skipped) unless root. `tag`: the interfaces' and pins' prefix.
fn place(tag: &str) -> Option<Place> {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root");
        return None;
    }
    assert!(
        on_bpffs(std::path::Path::new("/sys/fs/bpf")),
        "/sys/fs/bpf is not bpffs"
    );
    let root = PinRoot(PathBuf::from(format!(
        "/sys/fs/bpf/capy-test-{tag}-{}",
        std::process::id()
    )));
    let (c, s) = (format!("{tag}0"), format!("{tag}1"));
    let ns = TestNetns::enter(&[c.as_str(), s.as_str()]).expect("netns");
    let (cl, sv) = (ns.ifindex(&c).unwrap(), ns.ifindex(&s).unwrap());
    let mut pins = LinkPins::open(&root.0, "test").expect("pin dir");
    assert!(pins.try_own().unwrap());
    Some(Place {
        _root: root,
        ns,
        pins,
        cl,
        sv,
    })
}

/// Logical servers 0, 1, 2 (support's `server_ip(i)`, `server_mac(i)`) at
/// these indexes in the predecessor's tables, and at others in the
/// successor's.
const OLD_IDX: [u32; 3] = [0, 1, 2];
const NEW_IDX: [u32; 3] = [7, 5, 3];
const OLD_SVC: u32 = 0;
const NEW_SVC: u32 = 2;

/// Servers, the Maglev service VIP:80 at index `svc` (every slot on
/// server 0) and a migration-target ring of `targets` (logical servers).
fn configure(dp: &mut BpfDataPlane, cl: u32, sv: u32, idx: &[u32; 3], svc: u32, targets: &[u32]) {
    set_switch(dp, cl, sv);
    for (i, &at) in idx.iter().enumerate() {
        dp.set_server(at, server(SERVER_LIVE, i as u32, sv))
            .unwrap();
    }
    dp.set_service(
        CServiceKey::tcp(VIP, 80),
        CService {
            index: svc,
            placement: PLACE_MAGLEV,
            flags: 0,
        },
    )
    .unwrap();
    let table = vec![idx[0]; MAGLEV_SIZE as usize];
    let delta = maglev::diff(&[NO_SERVER; 0], &table);
    dp.write_maglev(svc, &delta).unwrap();
    let ring: Vec<u32> = targets.iter().map(|&t| idx[t as usize]).collect();
    dp.write_ring(svc, RING_TARGET, &CRing::from_slice(RING_ROTATE, &ring))
        .unwrap();
}

fn flow(idx: &[u32; 3], svc: u32, server: u32) -> CFlow {
    CFlow {
        server: idx[server as usize],
        service: svc as u16,
        flags: FLOW_ESTABLISHED | FLOW_MIGRATED,
        created_ns: 0,
    }
}

fn events(dp: &mut BpfDataPlane) -> Vec<(CFlowKey, u32, u32, u32)> {
    let mut evs = Vec::new();
    dp.drain_events(&mut evs).unwrap();
    evs.iter()
        .map(|e| (e.key, e.kind, e.server, e.prev_server))
        .collect()
}

/// Runs `input` through `dp`'s program and checks it leaves as `output`.
fn expect_redirect(dp: &BpfDataPlane, ingress: u32, input: &[u8], output: &[u8], what: &str) {
    let r = dp.test_run(input, ingress, 1).unwrap();
    assert_eq!(r.verdict, XDP_REDIRECT, "{what}: verdict");
    assert_eq!(hex(&r.packet), hex(output), "{what}: output packet");
}

/// Attaches `dp`'s program to `links`, each a new pinned link.
fn attach_new(dp: &mut BpfDataPlane, pins: &LinkPins, links: [u32; 2]) {
    for i in links {
        assert_eq!(
            dp.attach_pinned(i, &pins.link_path(i)).unwrap(),
            Attached::New { pinned: true }
        );
    }
}

/// Attaches the successor `dp` to `link`, replacing the predecessor's
/// program in place (`what`: the link's side, for the message).
fn replace_in_place(dp: &mut BpfDataPlane, pins: &LinkPins, link: u32, what: &str) {
    match dp.attach_pinned(link, &pins.link_path(link)).unwrap() {
        Attached::Replaced { .. } => {}
        other => panic!("expected the {what} link replaced in place, got {other:?}"),
    }
}

#[test]
fn migration_entries_survive_a_takeover_in_place_translated() {
    let Some(Place {
        _root,
        ns,
        mut pins,
        cl,
        sv,
    }) = place("tm")
    else {
        return;
    };

    // in flight: placed on 0, migrating to 1 (pending).
    let (inflight, m_inflight) = (flow_key(1001), mid(0, 1));
    // finished: placed on 0, migrated to 2; the store still says 0.
    let (finished, m_finished) = (flow_key(1002), mid(0, 2));
    // late: placed after the last sync, on 1, migrating to 2.
    let (late, m_late) = (flow_key(1003), mid(1, 1));
    // tombstone: an aborted migration of 0's, final on 0.
    let (tomb, m_tomb) = (flow_key(1004), mid(0, 3));
    // reset: migrated from 0 to 1; its client resets it during the takeover.
    let (reset, m_reset) = (flow_key(1005), mid(0, 4));
    // reused: migrated from 0 to 1 and closed (CLOSING); a new connection
    // on its 4-tuple starts during the takeover.
    let (reused, m_reused) = (flow_key(1007), mid(0, 6));
    // steered: a PREPARE of 0 for port 1006, steered to 1.
    let m_steered = mid(0, 5);

    let mut old = BpfDataPlane::load(BpfOptions::small()).unwrap();
    configure(&mut old, cl, sv, &OLD_IDX, OLD_SVC, &[1]);
    attach_new(&mut old, &pins, [cl, sv]);
    for (k, s) in [
        (inflight, 0),
        (finished, 0),
        (late, 1),
        (tomb, 0),
        (reset, 0),
        (reused, 0),
    ] {
        old.insert_flow(k, flow(&OLD_IDX, OLD_SVC, s)).unwrap();
    }
    let mut closing = flow(&OLD_IDX, OLD_SVC, 0);
    closing.flags |= FLOW_CLOSING | FLOW_FIN_CLIENT | FLOW_FIN_SERVER;
    old.insert_flow(reused, closing).unwrap();
    old.insert_migration(reused, CMigration::owner(OLD_IDX[1], m_reused))
        .unwrap();
    old.insert_migration(inflight, CMigration::pending(OLD_IDX[1], m_inflight))
        .unwrap();
    old.insert_migration(finished, CMigration::owner(OLD_IDX[2], m_finished))
        .unwrap();
    old.insert_migration(late, CMigration::pending(OLD_IDX[2], m_late))
        .unwrap();
    old.insert_migration(tomb, CMigration::owner(OLD_IDX[0], m_tomb))
        .unwrap();
    old.insert_migration(reset, CMigration::owner(OLD_IDX[1], m_reset))
        .unwrap();
    let prepare = mig(Kind::Prepare, m_steered, 1006, 0, None);
    expect_redirect(
        &old,
        sv,
        &udp_from(server_ip(0), SWITCH_SV, &prepare),
        &udp_to_server(1, server_ip(0), &prepare),
        "the predecessor steers the first PREPARE",
    );
    // The process dies: its links stay pinned, its program forwards on
    // (kept here to play what passes it before the last switch).
    old.release_links();
    let _ = events(&mut old);

    // The successor: the store's flows (owners as last persisted), its own
    // indexes, and a target ring that would pick server 2.
    let mut new = BpfDataPlane::load(BpfOptions::small()).unwrap();
    configure(&mut new, cl, sv, &NEW_IDX, NEW_SVC, &[2]);
    for (k, s) in [
        (inflight, 0),
        (finished, 0),
        (tomb, 0),
        (reset, 1),
        (reused, 1),
    ] {
        let mut f = flow(&NEW_IDX, NEW_SVC, s);
        f.flags = FLOW_ESTABLISHED;
        new.insert_flow(k, f).unwrap();
    }
    replace_in_place(&mut new, &pins, cl, "client");
    let copied = new.adopted();
    assert_eq!(
        new.lookup_migration(inflight).unwrap(),
        Some(CMigration::pending(NEW_IDX[1], m_inflight)),
        "the migration in flight is copied, its target translated: {copied:?}"
    );

    // Between the copy and the server link's switch the predecessor's
    // program still runs there: the target's CONN_STATE_ACK of the
    // migration in flight passes it, and a client resets `reset`.
    let csa = mig(Kind::ConnStateAck, m_inflight, 1001, 0, Some(1));
    expect_redirect(
        &old,
        sv,
        &udp_from(server_ip(1), server_ip(0), &csa),
        &direct(1, 0, &csa),
        "CONN_STATE_ACK through the predecessor",
    );
    let r = old
        .test_run(&client_tcp(VIP, 1005, TCP_RST), cl, 1)
        .unwrap();
    assert_eq!(
        r.verdict, XDP_REDIRECT,
        "the client's reset reaches its owner"
    );
    expect_redirect(
        &old,
        cl,
        &client_tcp(VIP, 1007, TCP_SYN),
        &to_server_tcp(1, 1007, TCP_SYN),
        "a new connection on a closed migrated 4-tuple, to its last owner",
    );
    replace_in_place(&mut new, &pins, sv, "server");
    let a = new.finish_adoption().unwrap();
    eprintln!("adopted: {a:?}");
    drop(old);
    assert_eq!(a.flows, 1, "the flow placed after the last sync");
    assert_eq!(a.migrations, 6);
    assert_eq!(a.migrations_pending, 2);
    assert_eq!(a.migrations_skipped, 0);
    assert_eq!(a.prepare_targets, 1);
    // The last migration id of each origin, for REGISTER_ACK: origin 0's
    // newest is a migration entry's (its PREPARE never passed this
    // program), origin 1's only id is its pending migration's.
    assert_eq!(a.origin_ids, 2);
    assert_eq!(new.last_migration_id(server_ip(0)).unwrap(), Some(m_reused));
    assert_eq!(new.last_migration_id(server_ip(1)).unwrap(), Some(m_late));
    assert_eq!(
        a.settled_late, 3,
        "the CONN_STATE_ACK, the reset and the reused 4-tuple"
    );
    assert_eq!(
        a.owner_events, 2,
        "the finished migration and the settled one"
    );

    // Every entry, translated.
    let entry = |dp: &mut BpfDataPlane, k| dp.lookup_migration(k).unwrap();
    assert_eq!(
        entry(&mut new, inflight),
        Some(CMigration::owner(NEW_IDX[1], m_inflight)),
        "settled by the CONN_STATE_ACK that passed the predecessor after the copy"
    );
    assert_eq!(
        entry(&mut new, finished),
        Some(CMigration::owner(NEW_IDX[2], m_finished))
    );
    assert_eq!(
        entry(&mut new, late),
        Some(CMigration::pending(NEW_IDX[2], m_late))
    );
    assert_eq!(
        entry(&mut new, tomb),
        Some(CMigration::owner(NEW_IDX[0], m_tomb))
    );
    assert_eq!(entry(&mut new, reset), None, "reset there: gone here too");
    assert_eq!(new.lookup_flow(reset).unwrap(), None);
    assert_eq!(entry(&mut new, reused), None, "the old connection's entry");
    let f = new
        .lookup_flow(reused)
        .unwrap()
        .expect("the new connection");
    assert_eq!(
        (f.server, f.flags & FLOW_CLOSING),
        (NEW_IDX[1], 0),
        "the new connection, where the predecessor placed it"
    );
    let f = new.lookup_flow(late).unwrap().expect("late flow adopted");
    assert_eq!((f.server, f.service), (NEW_IDX[1], NEW_SVC as u16));

    // The store learns the owners it lacked, and the reset.
    let mut evs = events(&mut new);
    evs.sort_by_key(|e| e.0.client_port);
    assert_eq!(
        evs,
        vec![
            (inflight, EV_MIGRATED, NEW_IDX[1], NEW_IDX[0]),
            (finished, EV_MIGRATED, NEW_IDX[2], NEW_IDX[0]),
            (reset, EV_CLOSED, NEW_IDX[1], NEW_IDX[1]),
            // Closed at the copy (its FINs merged), then a new connection
            // on its 4-tuple: the store deletes it and learns the new one.
            (reused, EV_CLOSED, NEW_IDX[1], NEW_IDX[1]),
            (reused, EV_NEW, NEW_IDX[1], NEW_IDX[1]),
        ]
    );

    // The successor's program forwards as the predecessor's would have.
    expect_redirect(
        &new,
        cl,
        &client_tcp(VIP, 1003, TCP_ACK),
        &to_server_tcp(2, 1003, TCP_ACK),
        "the connection in flight reaches its target",
    );
    expect_redirect(
        &new,
        cl,
        &client_tcp(VIP, 1001, TCP_ACK),
        &to_server_tcp(1, 1001, TCP_ACK),
        "the settled one its new owner",
    );
    expect_redirect(
        &new,
        cl,
        &client_tcp(VIP, 1002, TCP_ACK),
        &to_server_tcp(2, 1002, TCP_ACK),
        "the finished one its owner",
    );
    let csa = mig(Kind::ConnStateAck, m_late, 1003, 1, Some(2));
    expect_redirect(
        &new,
        sv,
        &udp_from(server_ip(2), server_ip(1), &csa),
        &direct(2, 1, &csa),
        "CONN_STATE_ACK of the migration in flight",
    );
    assert_eq!(
        entry(&mut new, late),
        Some(CMigration::owner(NEW_IDX[2], m_late)),
        "the target committed: final"
    );
    assert_eq!(
        events(&mut new),
        vec![(late, EV_MIGRATED, NEW_IDX[2], NEW_IDX[1])],
        "the store hears of it as from the predecessor"
    );
    expect_redirect(
        &new,
        sv,
        &udp_from(server_ip(0), SWITCH_SV, &prepare),
        &udp_to_server(1, server_ip(0), &prepare),
        "a retransmitted PREPARE reaches the first one's target, not the ring's",
    );

    new.detach_all();
    pins.disown();
    pins.remove_if_unused();
    drop(ns);
}

/// The store keeps no FIN flags: a flow the predecessor saw half-closed or
/// closed is in the successor's table (the store's copy) as open. Without
/// the merge, a closed flow was never reaped (its CLOSED event went to the
/// dead process) and a half-closed one never closed (its other FIN alone
/// does not make it CLOSING here); a closed flow the store lacked was
/// copied CLOSING but never queued for the reaper either.
#[test]
fn fins_the_predecessor_saw_survive_a_takeover() {
    let Some(Place {
        _root,
        ns,
        mut pins,
        cl,
        sv,
    }) = place("tf")
    else {
        return;
    };

    // half: the client sent its FIN; closed: both did; closed_late: both
    // did, and the store never had it.
    let (half, closed, closed_late) = (flow_key(1008), flow_key(1009), flow_key(1010));
    let mut old = BpfDataPlane::load(BpfOptions::small()).unwrap();
    configure(&mut old, cl, sv, &OLD_IDX, OLD_SVC, &[1]);
    for i in [cl, sv] {
        old.attach_pinned(i, &pins.link_path(i)).unwrap();
    }
    let both = FLOW_CLOSING | FLOW_FIN_CLIENT | FLOW_FIN_SERVER;
    for (k, flags) in [(half, FLOW_FIN_CLIENT), (closed, both), (closed_late, both)] {
        let mut f = flow(&OLD_IDX, OLD_SVC, 0);
        f.flags = FLOW_ESTABLISHED | flags;
        old.insert_flow(k, f).unwrap();
    }
    old.release_links();
    let _ = events(&mut old);

    let mut new = BpfDataPlane::load(BpfOptions::small()).unwrap();
    configure(&mut new, cl, sv, &NEW_IDX, NEW_SVC, &[2]);
    for k in [half, closed] {
        let mut f = flow(&NEW_IDX, NEW_SVC, 0);
        f.flags = FLOW_ESTABLISHED;
        new.insert_flow(k, f).unwrap();
    }
    for i in [cl, sv] {
        match new.attach_pinned(i, &pins.link_path(i)).unwrap() {
            Attached::Replaced { .. } => {}
            other => panic!("expected the link replaced in place, got {other:?}"),
        }
    }
    let a = new.finish_adoption().unwrap();
    drop(old);
    assert_eq!(
        (a.flows, a.fins_merged, a.closed),
        (1, 2, 2),
        "closed_late copied; half and closed merged; closed and closed_late queued: {a:?}"
    );
    let flags = |dp: &mut BpfDataPlane, k| dp.lookup_flow(k).unwrap().expect("flow").flags;
    assert_eq!(
        flags(&mut new, half) & both,
        FLOW_FIN_CLIENT,
        "half-closed, not closed"
    );
    assert_eq!(flags(&mut new, closed) & both, both);
    assert_eq!(flags(&mut new, closed_late) & both, both);
    let mut evs = events(&mut new);
    evs.sort_by_key(|e| e.0.client_port);
    assert_eq!(
        evs,
        vec![
            (closed, EV_CLOSED, NEW_IDX[0], NEW_IDX[0]),
            (closed_late, EV_CLOSED, NEW_IDX[0], NEW_IDX[0]),
        ],
        "the reaper and the store hear of both closes"
    );

    // The half-closed flow closes with its server's FIN at the successor.
    new.test_run(&server_tcp(0, 1008, TCP_FIN | TCP_ACK), sv, 1)
        .unwrap();
    assert_eq!(flags(&mut new, half) & both, both);
    assert_eq!(
        events(&mut new),
        vec![(half, EV_CLOSED, NEW_IDX[0], NEW_IDX[0])]
    );

    new.detach_all();
    pins.disown();
    pins.remove_if_unused();
    drop(ns);
}

/// Until the last link runs the successor's program, both programs
/// forward: one migration's PREPARE_ACK can pass one and its
/// CONN_STATE_ACK (or the target's ABORT decision) the other. Found by
/// `tests/tests/takeover_churn_lab.rs` (connections migrated every 5 ms
/// through a takeover in place): in about one run of four, most migrations
/// failed after the takeover (21,719 PREPARE_ACKs dropped as stale, 6,274
/// aborts in 7 s), because entries stayed pending for good: the program
/// that saw the settling message had no pending entry to settle (the
/// copy's final entry, or none), and the end of the adoption either
/// applied the predecessor's pending entry over it or left this program's
/// own pending entry alone. Each split must end final where the
/// migration ended, and the flow's next migration must be taken.
#[test]
fn a_migration_split_between_the_two_programs_settles_where_it_ended() {
    let Some(Place {
        _root,
        ns,
        mut pins,
        cl,
        sv,
    }) = place("ts")
    else {
        return;
    };
    // Four connections placed on 0; the first three came back to 0 from 1
    // earlier (final entries on 0 with 1's ids: their epochs), the fourth
    // never migrated. Each migrates from 0 to 1 during the takeover.
    // ack_old: PREPARE_ACK through the predecessor, CONN_STATE_ACK through
    // the successor; ack_new: the other way; aborted: PREPARE_ACK through
    // the successor, the target's ABORT decision through the predecessor;
    // first: like ack_old, without an entry before.
    let (ack_old, ack_new, aborted, first) = (
        flow_key(2001),
        flow_key(2002),
        flow_key(2003),
        flow_key(2004),
    );
    let epoch = |n: u32| mid(1, n);
    let m = |n: u32| mid(0, 10 + n);
    let mut old = BpfDataPlane::load(BpfOptions::small()).unwrap();
    configure(&mut old, cl, sv, &OLD_IDX, OLD_SVC, &[1]);
    attach_new(&mut old, &pins, [cl, sv]);
    for (n, k) in [ack_old, ack_new, aborted, first].into_iter().enumerate() {
        old.insert_flow(k, flow(&OLD_IDX, OLD_SVC, 0)).unwrap();
        if n < 3 {
            old.insert_migration(k, CMigration::owner(OLD_IDX[0], epoch(n as u32)))
                .unwrap();
        }
    }
    old.release_links();
    let _ = events(&mut old);

    let mut new = BpfDataPlane::load(BpfOptions::small()).unwrap();
    configure(&mut new, cl, sv, &NEW_IDX, NEW_SVC, &[1]);
    for k in [ack_old, ack_new, aborted, first] {
        new.insert_flow(k, flow(&NEW_IDX, NEW_SVC, 0)).unwrap();
    }
    replace_in_place(&mut new, &pins, cl, "client");
    // The messages of each migration (origin 0, target 1), through the
    // program named.
    let pass = |dp: &BpfDataPlane, kind: Kind, n: u32, port: u16, ep: u64, what: &str| {
        let msg = mig_epoch(kind, m(n), ep, port, 0, Some(1));
        let (from, to) = match kind {
            Kind::ConnStateAck | Kind::PrepareAck | Kind::Abort => (1, 0),
            _ => (0, 1),
        };
        expect_redirect(
            dp,
            sv,
            &udp_from(server_ip(from), server_ip(to), &msg),
            &direct(from, to, &msg),
            what,
        );
    };
    pass(
        &old,
        Kind::PrepareAck,
        0,
        2001,
        epoch(0),
        "ack_old: PREPARE_ACK (predecessor)",
    );
    pass(
        &new,
        Kind::ConnStateAck,
        0,
        2001,
        epoch(0),
        "ack_old: CONN_STATE_ACK (successor)",
    );
    pass(
        &new,
        Kind::PrepareAck,
        1,
        2002,
        epoch(1),
        "ack_new: PREPARE_ACK (successor)",
    );
    pass(
        &old,
        Kind::ConnStateAck,
        1,
        2002,
        epoch(1),
        "ack_new: CONN_STATE_ACK (predecessor)",
    );
    pass(
        &new,
        Kind::PrepareAck,
        2,
        2003,
        epoch(2),
        "aborted: PREPARE_ACK (successor)",
    );
    pass(
        &old,
        Kind::Abort,
        2,
        2003,
        epoch(2),
        "aborted: ABORT decision (predecessor)",
    );
    pass(
        &old,
        Kind::PrepareAck,
        3,
        2004,
        0,
        "first: PREPARE_ACK (predecessor)",
    );
    pass(
        &new,
        Kind::ConnStateAck,
        3,
        2004,
        0,
        "first: CONN_STATE_ACK (successor)",
    );
    replace_in_place(&mut new, &pins, sv, "server");
    let a = new.finish_adoption().unwrap();
    eprintln!("adopted: {a:?}");
    drop(old);

    let entry = |dp: &mut BpfDataPlane, k| dp.lookup_migration(k).unwrap();
    assert_eq!(
        entry(&mut new, ack_old),
        Some(CMigration::owner(NEW_IDX[1], m(0))),
        "ack_old: final on the target"
    );
    assert_eq!(
        entry(&mut new, ack_new),
        Some(CMigration::owner(NEW_IDX[1], m(1))),
        "ack_new: final on the target"
    );
    assert_eq!(
        entry(&mut new, aborted),
        Some(CMigration::owner(NEW_IDX[0], m(2))),
        "aborted: final on the origin"
    );
    assert_eq!(
        entry(&mut new, first),
        Some(CMigration::owner(NEW_IDX[1], m(3))),
        "first: final on the target"
    );
    // The store hears of the three moves (their events went to the
    // predecessor's process, or come from this program).
    let mut evs: Vec<_> = events(&mut new)
        .into_iter()
        .filter(|e| e.1 == EV_MIGRATED)
        .map(|e| (e.0.client_port, e.2))
        .collect();
    evs.sort();
    evs.dedup();
    let ports: Vec<u16> = [2001u16, 2002, 2004].iter().map(|p| p.to_be()).collect();
    assert_eq!(
        evs,
        ports.iter().map(|&p| (p, NEW_IDX[1])).collect::<Vec<_>>(),
        "MIGRATED events for the store"
    );

    // The next migration of each (back from 1 to 0; from 0 again for the
    // aborted one) is taken: its PREPARE_ACK installs a pending entry.
    for (k, port, origin, target, ep) in [
        (ack_old, 2001u16, 1u32, 0u32, m(0)),
        (ack_new, 2002, 1, 0, m(1)),
        (aborted, 2003, 0, 1, epoch(2)),
        (first, 2004, 1, 0, m(3)),
    ] {
        let next = mid(origin, 40 + u32::from(port - 2000));
        let pa = mig_epoch(Kind::PrepareAck, next, ep, port, origin, Some(target));
        expect_redirect(
            &new,
            sv,
            &udp_from(server_ip(target), server_ip(origin), &pa),
            &direct(target, origin, &pa),
            &format!("port {port}: the next migration's PREPARE_ACK"),
        );
        assert_eq!(
            entry(&mut new, k),
            Some(CMigration::pending(NEW_IDX[target as usize], next)),
            "port {port}: pending toward the next target"
        );
    }

    new.detach_all();
    pins.disown();
    pins.remove_if_unused();
    drop(ns);
}

/// Several migrations of one flow during the adoption window (found by
/// `tests/tests/takeover_churn_lab.rs` in CI: 24 entries stuck pending, every
/// later migration refused as stale). The copy holds a migration M in
/// flight (pending toward 0); the predecessor then sees M settle and the
/// flow's next migrations begin, and the successor sees an outcome of a
/// migration whose PREPARE_ACK passed only the predecessor (its own entry
/// is the copy's, pending M). Four flows:
/// - commit: N (0 -> 1, epoch M) pending at the predecessor, its
///   CONN_STATE_ACK through the successor (taken over M's pending entry:
///   the epoch proves M committed);
/// - abort: the same, the target's ABORT decision of N through the
///   successor;
/// - commit2: N settled at the predecessor too, then P (1 -> 0, epoch N)
///   pending there and P's CONN_STATE_ACK through the successor (it cannot
///   apply it to M's entry: remembered, applied by finish_adoption);
/// - abort2: the same, P's ABORT decision through the successor.
///
/// Before: finish_adoption applied the predecessor's pending entry (N or
/// P) over the copy's, and nothing would settle it any more.
#[test]
fn outcomes_of_migrations_begun_at_the_predecessor_after_the_copy_settle_their_entries() {
    let Some(Place {
        _root,
        ns,
        mut pins,
        cl,
        sv,
    }) = place("tc")
    else {
        return;
    };
    let (commit, abort, commit2, abort2) = (3001u16, 3002u16, 3003u16, 3004u16);
    let ports = [commit, abort, commit2, abort2];
    // Per flow (i = 0..3): E (0 -> 1) gave 1 the flow before the test, M
    // (1 -> 0, epoch E) is in flight at the copy, N (0 -> 1, epoch M),
    // P (1 -> 0, epoch N).
    let e_id = |i: u32| mid(0, 100 + i);
    let m_id = |i: u32| mid(1, 200 + i);
    let n_id = |i: u32| mid(0, 300 + i);
    let p_id = |i: u32| mid(1, 400 + i);
    let mut old = BpfDataPlane::load(BpfOptions::small()).unwrap();
    configure(&mut old, cl, sv, &OLD_IDX, OLD_SVC, &[0, 1]);
    attach_new(&mut old, &pins, [cl, sv]);
    for (i, &port) in ports.iter().enumerate() {
        let k = flow_key(port);
        old.insert_flow(k, flow(&OLD_IDX, OLD_SVC, 0)).unwrap();
        old.insert_migration(k, CMigration::pending(OLD_IDX[0], m_id(i as u32)))
            .unwrap();
    }
    old.release_links();
    let _ = events(&mut old);

    // The message `kind` of migration `id` (epoch `ep`) from `origin` to
    // `target` of the flow on `port`, through `dp`'s program.
    let pass = |dp: &BpfDataPlane,
                kind: Kind,
                id: u64,
                ep: u64,
                port: u16,
                origin: u32,
                target: u32,
                what: &str| {
        let msg = mig_epoch(kind, id, ep, port, origin, Some(target));
        expect_redirect(
            dp,
            sv,
            &udp_from(server_ip(target), server_ip(origin), &msg),
            &direct(target, origin, &msg),
            what,
        );
    };
    let mut new = BpfDataPlane::load(BpfOptions::small()).unwrap();
    configure(&mut new, cl, sv, &NEW_IDX, NEW_SVC, &[0, 1]);
    for &port in &ports {
        new.insert_flow(flow_key(port), flow(&NEW_IDX, NEW_SVC, 0))
            .unwrap();
    }
    // The copy: every flow's entry pending M toward 0.
    replace_in_place(&mut new, &pins, cl, "client");
    for (i, &port) in ports.iter().enumerate() {
        let i = i as u32;
        pass(
            &old,
            Kind::ConnStateAck,
            m_id(i),
            e_id(i),
            port,
            1,
            0,
            "M's CONN_STATE_ACK (predecessor)",
        );
        pass(
            &old,
            Kind::PrepareAck,
            n_id(i),
            m_id(i),
            port,
            0,
            1,
            "N's PREPARE_ACK (predecessor)",
        );
        if port == commit2 || port == abort2 {
            pass(
                &old,
                Kind::ConnStateAck,
                n_id(i),
                m_id(i),
                port,
                0,
                1,
                "N's CONN_STATE_ACK (predecessor)",
            );
            pass(
                &old,
                Kind::PrepareAck,
                p_id(i),
                n_id(i),
                port,
                1,
                0,
                "P's PREPARE_ACK (predecessor)",
            );
        }
    }
    pass(
        &new,
        Kind::ConnStateAck,
        n_id(0),
        m_id(0),
        commit,
        0,
        1,
        "commit: N's CONN_STATE_ACK (successor)",
    );
    pass(
        &new,
        Kind::Abort,
        n_id(1),
        m_id(1),
        abort,
        0,
        1,
        "abort: N's ABORT decision (successor)",
    );
    pass(
        &new,
        Kind::ConnStateAck,
        p_id(2),
        n_id(2),
        commit2,
        1,
        0,
        "commit2: P's CONN_STATE_ACK (successor)",
    );
    pass(
        &new,
        Kind::Abort,
        p_id(3),
        n_id(3),
        abort2,
        1,
        0,
        "abort2: P's ABORT decision (successor)",
    );
    replace_in_place(&mut new, &pins, sv, "server");
    let a = new.finish_adoption().unwrap();
    eprintln!("adopted: {a:?}");
    drop(old);

    let want = [
        (
            commit,
            CMigration::owner(NEW_IDX[1], n_id(0)),
            "commit: final on N's target",
        ),
        (
            abort,
            CMigration::owner(NEW_IDX[0], n_id(1)),
            "abort: final on N's origin",
        ),
        (
            commit2,
            CMigration::owner(NEW_IDX[0], p_id(2)),
            "commit2: final on P's target",
        ),
        (
            abort2,
            CMigration::owner(NEW_IDX[1], p_id(3)),
            "abort2: final on P's origin",
        ),
    ];
    for (port, entry, what) in want {
        assert_eq!(
            new.lookup_migration(flow_key(port)).unwrap(),
            Some(entry),
            "{what}"
        );
    }
    // The next migration of each, from its owner, is taken.
    for (i, (port, entry, _)) in want.into_iter().enumerate() {
        let owner = NEW_IDX.iter().position(|&x| x == entry.server).unwrap() as u32;
        let next = mid(owner, 500 + i as u32);
        let pa = mig_epoch(
            Kind::PrepareAck,
            next,
            entry.migration_id,
            port,
            owner,
            Some(1 - owner),
        );
        expect_redirect(
            &new,
            sv,
            &udp_from(server_ip(1 - owner), server_ip(owner), &pa),
            &direct(1 - owner, owner, &pa),
            &format!("port {port}: the next migration's PREPARE_ACK"),
        );
        assert_eq!(
            new.lookup_migration(flow_key(port)).unwrap(),
            Some(CMigration::pending(NEW_IDX[1 - owner as usize], next)),
            "port {port}: pending toward the next target"
        );
    }

    new.detach_all();
    pins.disown();
    pins.remove_if_unused();
    drop(ns);
}
