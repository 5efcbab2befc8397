//! Scenario tests of the migration protocol on the virtual-clock harness:
//! origin, target(s), switch model, fake stacks.

mod common;

use capybara_tcpmig::*;
use common::*;

const N: usize = 3000; // snapshot bytes: 7 fragments at MTU 576

fn done_out(w: &World) -> bool {
    w.events(ORIGIN)
        .iter()
        .any(|e| matches!(e, Event::MigratedOut { .. }))
}

fn resumed(w: &World) -> Option<Reason> {
    w.events(ORIGIN).iter().find_map(|e| match e {
        Event::Resumed { reason, .. } => Some(*reason),
        _ => None,
    })
}

/// Completed: the target owns the flow with the origin's exact bytes.
fn assert_migrated(w: &World, target: std::net::Ipv4Addr) {
    w.assert_one_owner();
    assert_eq!(w.owners(), vec![target]);
    assert!(done_out(w), "no MigratedOut: {:?}", w.events(ORIGIN));
    let t = w.hosts.iter().find(|h| h.addr == target).unwrap();
    assert_eq!(
        t.stack.imported,
        vec![blob(N)],
        "snapshot not delivered intact"
    );
    assert_eq!(t.stack.conns[&flow()].blob, blob(N));
    assert_eq!(
        w.switch.entries[&flow()],
        Entry {
            owner: target,
            id: w.switch.entries[&flow()].id,
            pending: false
        }
    );
}

/// Aborted: the origin still (again) owns the flow, and the switch agrees.
fn assert_origin_kept(w: &World) {
    w.assert_one_owner();
    assert_eq!(w.owners(), vec![ORIGIN]);
    assert_eq!(w.switch.route(&flow()), ORIGIN);
}

#[test]
fn happy_path_switch_chooses_target() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    let id = w.migrate(None);
    w.settle();
    assert_migrated(&w, TARGET);
    assert_eq!(w.max_owners_seen, 1);
    let tel = w.events(ORIGIN).iter().find_map(|e| match e {
        Event::MigratedOut { target, id: i, .. } => {
            assert_eq!((*target, *i), (TARGET, id));
            telemetry_of(&w, ORIGIN, id)
        }
        _ => None,
    });
    let tel = tel.unwrap();
    for (name, t) in [
        ("prepare_sent", tel.prepare_sent),
        ("prepare_ack_received", tel.prepare_ack_received),
        ("export_done", tel.export_done),
        ("state_sent", tel.state_sent),
        ("state_ack_received", tel.state_ack_received),
    ] {
        assert!(t.is_some(), "{name} missing");
    }
    assert!(
        tel.prepare_sent <= tel.prepare_ack_received && tel.state_sent <= tel.state_ack_received
    );
    assert_eq!(tel.snapshot_bytes, N as u64);
    assert_eq!(tel.fragments, 7);
    assert_eq!(tel.retransmissions, 0);
    // Four hops of 5 us for PREPARE/ACK, four more for the state and its ack.
    assert_eq!(tel.total_origin(), Some(Duration::from_micros(40)));
    let tin = w.events(TARGET).iter().find_map(|e| match e {
        Event::MigratedIn { origin, id: i, .. } => {
            assert_eq!((*origin, *i), (ORIGIN, id));
            telemetry_of(&w, TARGET, id)
        }
        _ => None,
    });
    let tin = tin.unwrap();
    assert!(
        tin.prepare_received.is_some() && tin.state_received.is_some() && tin.import_done.is_some()
    );
    assert!(tin.replayed.is_some());
    let o = w.hosts[0].engine.counters();
    assert_eq!(o.tx.get(Kind::Prepare), 1);
    assert_eq!(o.tx.get(Kind::ConnState), 7);
    assert_eq!(o.rx.get(Kind::ConnStateAck), 1);
    assert_eq!(o.migrated_out, 1);
    // Everything expired after linger.
    assert_eq!(w.hosts[0].engine.records(), 0);
    assert_eq!(w.hosts[1].engine.records(), 0);
}

#[test]
fn explicit_target_and_second_candidate_untouched() {
    let mut w = World::serving(N, &[TARGET, TARGET2], Box::new(NoFaults));
    w.migrate(Some(TARGET2));
    w.settle();
    assert_migrated(&w, TARGET2);
    assert_eq!(w.hosts[1].engine.counters().rx.total(), 0);
}

#[test]
fn client_segments_during_migration_are_replayed_in_order() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.origin().stack.manual_export = true;
    let id = w.migrate(None);
    w.run_for(Duration::from_micros(100));
    // PREPARE_ACK passed the switch: the flow goes to the target now.
    assert_eq!(w.switch.route(&flow()), TARGET);
    let segs: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 100 + usize::from(i)]).collect();
    for s in &segs {
        w.client_send(s);
    }
    w.run_for(Duration::from_micros(100));
    assert_eq!(w.host(TARGET).stack.strays, 0);
    let now = w.now;
    w.origin()
        .engine
        .provide_snapshot(now, id, blob(N))
        .unwrap();
    w.origin().stack.pending_exports.clear();
    w.flush();
    w.settle();
    assert_migrated(&w, TARGET);
    assert_eq!(w.host(TARGET).stack.conns[&flow()].received, segs);
    w.client_send(b"after");
    w.run_for(Duration::from_millis(1));
    assert_eq!(
        w.host(TARGET).stack.conns[&flow()].received.last().unwrap(),
        b"after"
    );
    let c = w.host(TARGET).engine.counters();
    assert_eq!(c.segments_buffered, 5);
}

#[test]
fn every_kind_lost_once_still_completes() {
    for (kind, fate) in [
        (Kind::Prepare, Fate::DropBeforeSwitch),
        (Kind::PrepareAck, Fate::DropBeforeSwitch),
        (Kind::PrepareAck, Fate::DropAfterSwitch),
        (Kind::ConnState, Fate::DropBeforeSwitch),
        (Kind::ConnStateAck, Fate::DropBeforeSwitch),
        (Kind::ConnStateAck, Fate::DropAfterSwitch),
    ] {
        for nth in [0, 6] {
            if kind != Kind::ConnState && nth != 0 {
                continue;
            }
            let mut w = World::serving(N, &[TARGET], Box::new(OnKind::new(kind, nth, fate)));
            w.migrate(None);
            w.settle();
            assert_migrated(&w, TARGET);
            let o = w.hosts[0].engine.counters();
            assert!(o.retransmissions > 0, "{kind} {nth}: no retransmission");
        }
    }
}

#[test]
fn duplicates_and_reordering_of_every_kind_are_idempotent() {
    for kind in Kind::ALL {
        for fate in [Fate::Duplicate, Fate::Delay(50)] {
            let mut w = World::serving(N, &[TARGET], Box::new(AllOfKind(kind, None, fate)));
            w.migrate(None);
            w.settle();
            assert_migrated(&w, TARGET);
            assert_eq!(w.hosts[1].stack.imported.len(), 1, "{kind}: imported twice");
            assert_eq!(w.events(ORIGIN).len(), 2, "{kind}: {:?}", w.events(ORIGIN));
        }
    }
}

#[test]
fn reject_keeps_origin_serving() {
    for lost in [false, true] {
        let plan: Box<dyn FaultPlan> = if lost {
            Box::new(OnKind::new(Kind::Reject, 0, Fate::DropAfterSwitch))
        } else {
            Box::new(NoFaults)
        };
        let mut w = World::serving(N, &[TARGET], plan);
        w.host(TARGET).engine.set_draining(true);
        w.migrate(None);
        w.settle();
        assert_eq!(resumed(&w), Some(Reason::Draining));
        assert_origin_kept(&w);
        assert!(w.switch.entries.is_empty());
        // A lost REJECT is recovered by the PREPARE retransmission; the origin
        // counts only the one that reached it.
        assert_eq!(w.hosts[0].engine.counters().rejects_received, 1);
        assert!(w.hosts[1].engine.counters().rejects_sent >= 1);
    }
}

#[test]
fn policy_hook_and_capacity_rejects() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.host(TARGET)
        .engine
        .set_accept_hook(Some(Box::new(|_, _| Err(Reason::Policy))));
    w.migrate(None);
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::Policy));
    assert_origin_kept(&w);

    let mut w = World::with_config(&[TARGET], Box::new(NoFaults), |a| {
        let mut c = config(a);
        c.max_concurrent_in = 1;
        c
    });
    let mut f2 = flow();
    f2.client_port += 1;
    for f in [flow(), f2] {
        w.hosts[0].stack.conns.insert(
            f,
            Conn {
                state: ConnState::Active,
                blob: blob(N),
                received: vec![],
            },
        );
    }
    w.hosts[0].stack.manual_export = true;
    let now = w.now;
    w.hosts[0].engine.migrate_out(now, flow(), None).unwrap();
    w.hosts[0].engine.migrate_out(now, f2, None).unwrap();
    w.flush();
    w.run_for(Duration::from_millis(1));
    assert!(w.events(ORIGIN).iter().any(|e| matches!(
        e,
        Event::Resumed {
            reason: Reason::NoCapacity,
            ..
        }
    )));
}

#[test]
fn deadline_before_prepare_ack_origin_keeps_flow() {
    // PREPAREs never arrive.
    let mut w = World::serving(
        N,
        &[TARGET],
        Box::new(AllOfKind(Kind::Prepare, None, Fate::DropBeforeSwitch)),
    );
    w.migrate(None);
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::Timeout));
    assert_origin_kept(&w);

    // Every PREPARE_ACK passes the switch (flow redirected) but is lost:
    // the origin resumes, asks the switch to steer its ABORT to the
    // pending target, the target lets go and its decision resets the entry.
    let mut w = World::serving(
        N,
        &[TARGET],
        Box::new(AllOfKind(Kind::PrepareAck, None, Fate::DropAfterSwitch)),
    );
    w.migrate(None);
    w.run_for(Duration::from_millis(49));
    assert_eq!(w.switch.route(&flow()), TARGET);
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::Timeout));
    assert_origin_kept(&w);
    assert!(w
        .events(TARGET)
        .iter()
        .any(|e| matches!(e, Event::AbortedIn { .. })));
    assert!(!w.switch.entries[&flow()].pending);
}

#[test]
fn deadline_while_exporting_origin_keeps_flow() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.origin().stack.manual_export = true;
    let id = w.migrate(None);
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::Timeout));
    assert_origin_kept(&w);
    let now = w.now;
    assert!(w
        .origin()
        .engine
        .provide_snapshot(now, id, blob(N))
        .is_err());
}

#[test]
fn deadline_while_sending_state_asks_target_and_origin_keeps_flow() {
    // The state never gets through: the target never commits; asked, it
    // lets go and the origin resumes.
    let mut w = World::serving(
        N,
        &[TARGET],
        Box::new(AllOfKind(Kind::ConnState, None, Fate::DropBeforeSwitch)),
    );
    w.migrate(None);
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::Timeout));
    assert_origin_kept(&w);
    assert!(w.hosts[0].engine.counters().aborts_sent >= 1);
}

#[test]
fn deadline_after_target_committed_target_keeps_flow() {
    // The target imported but its acks are lost past the origin's deadline:
    // the origin is in doubt, asks, and learns the target owns the flow.
    let mut w = World::serving(
        N,
        &[TARGET],
        Box::new(FirstK::new(Kind::ConnStateAck, 10, Fate::DropBeforeSwitch)),
    );
    w.migrate(None);
    w.settle();
    assert_migrated(&w, TARGET);
    assert!(
        w.hosts[0].engine.counters().aborts_sent >= 1,
        "origin never was in doubt"
    );
    assert!(resumed(&w).is_none());
}

#[test]
fn acks_lost_forever_origin_reports_lost_never_two_owners() {
    let mut w = World::serving(
        N,
        &[TARGET],
        Box::new(AllOfKind(Kind::ConnStateAck, None, Fate::DropBeforeSwitch)),
    );
    w.migrate(None);
    w.settle();
    assert!(w
        .events(ORIGIN)
        .iter()
        .any(|e| matches!(e, Event::Lost { .. })));
    w.assert_one_owner();
    assert_eq!(w.owners(), vec![TARGET]);
}

#[test]
fn import_failure_returns_flow_to_origin() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.host(TARGET).stack.fail_import = true;
    w.migrate(None);
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::ImportFailed));
    assert_origin_kept(&w);
}

#[test]
fn target_deadline_before_origin_deadline_is_also_consistent() {
    // The target gives up first while the origin is still sending.
    let mut w = World::with_config(
        &[TARGET],
        Box::new(AllOfKind(Kind::ConnState, None, Fate::DropBeforeSwitch)),
        |a| {
            let mut c = config(a);
            c.target_deadline = Duration::from_millis(10);
            c
        },
    );
    w.hosts[0].stack.conns.insert(
        flow(),
        Conn {
            state: ConnState::Active,
            blob: blob(N),
            received: vec![],
        },
    );
    w.migrate(None);
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::Timeout));
    assert_origin_kept(&w);
}

#[test]
fn origin_dies_mid_migration() {
    // Before the state: the target gives up; nobody owns (host failure).
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.origin().stack.manual_export = true;
    w.migrate(None);
    w.run_for(Duration::from_micros(100));
    w.kill(ORIGIN);
    w.settle();
    w.switch.server_dead(ORIGIN);
    w.assert_one_owner();
    assert!(w.owners().is_empty());
    assert!(w.events(TARGET).iter().any(|e| matches!(
        e,
        Event::AbortedIn {
            reason: Reason::Timeout,
            ..
        }
    )));

    // After the state left: the target commits and owns the flow.
    let mut w = World::serving(
        N,
        &[TARGET],
        Box::new(AllOfKind(Kind::ConnStateAck, None, Fate::DropBeforeSwitch)),
    );
    w.migrate(None);
    w.run_for(Duration::from_micros(60));
    w.kill(ORIGIN);
    w.settle();
    w.assert_one_owner();
    assert_eq!(w.owners(), vec![TARGET]);
}

#[test]
fn target_dies_mid_migration() {
    // Before PREPARE_ACK: the origin times out and keeps the flow.
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.kill(TARGET);
    w.migrate(None);
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::Timeout));
    assert_origin_kept(&w);

    // After PREPARE_ACK, before the state: the origin cannot know whether
    // the target committed, so the connection is lost (host failure, seed
    // §4.2); never two owners.
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.origin().stack.manual_export = true;
    let id = w.migrate(None);
    w.run_for(Duration::from_micros(100));
    w.kill(TARGET);
    let now = w.now;
    w.origin()
        .engine
        .provide_snapshot(now, id, blob(N))
        .unwrap();
    w.origin().stack.pending_exports.clear();
    w.flush();
    w.settle();
    assert!(w
        .events(ORIGIN)
        .iter()
        .any(|e| matches!(e, Event::Lost { .. })));
    w.switch.server_dead(TARGET);
    w.assert_one_owner();
    assert!(w.owners().is_empty());
}

#[test]
fn buffer_overflow_drops_beyond_the_bound_and_connection_survives() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.origin().stack.manual_export = true;
    let id = w.migrate(None);
    w.run_for(Duration::from_micros(100));
    let segs: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 1000]).collect();
    for s in &segs {
        w.client_send(s);
    }
    w.run_for(Duration::from_micros(100));
    assert_eq!(w.host(TARGET).stack.buffer_drops, 6, "bound is 4096 bytes");
    let now = w.now;
    w.origin()
        .engine
        .provide_snapshot(now, id, blob(N))
        .unwrap();
    w.origin().stack.pending_exports.clear();
    w.flush();
    w.settle();
    assert_migrated(&w, TARGET);
    assert_eq!(
        w.host(TARGET).stack.conns[&flow()].received,
        segs[..4].to_vec()
    );
    let c = *w.host(TARGET).engine.counters();
    assert_eq!((c.segments_buffered, c.segments_dropped), (4, 6));
}

#[test]
fn drop_mode_drops_every_segment() {
    let mut w = World::with_config(&[TARGET], Box::new(NoFaults), |a| {
        let mut c = config(a);
        c.buffer_mode = BufferMode::Drop;
        c
    });
    w.hosts[0].stack.conns.insert(
        flow(),
        Conn {
            state: ConnState::Active,
            blob: blob(N),
            received: vec![],
        },
    );
    w.origin().stack.manual_export = true;
    let id = w.migrate(None);
    w.run_for(Duration::from_micros(100));
    for i in 0..3u8 {
        w.client_send(&[i; 10]);
    }
    w.run_for(Duration::from_micros(100));
    let now = w.now;
    w.origin()
        .engine
        .provide_snapshot(now, id, blob(N))
        .unwrap();
    w.origin().stack.pending_exports.clear();
    w.flush();
    w.settle();
    assert_migrated(&w, TARGET);
    assert!(w.host(TARGET).stack.conns[&flow()].received.is_empty());
    assert_eq!(w.host(TARGET).engine.counters().segments_dropped, 3);
}

#[test]
fn migrate_there_and_back() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.migrate(None);
    w.run_for(Duration::from_millis(5));
    assert_eq!(w.owners(), vec![TARGET]);
    // Now the target migrates the flow back to the origin.
    let now = w.now;
    w.host(TARGET)
        .engine
        .migrate_out(now, flow(), Some(ORIGIN))
        .unwrap();
    w.flush();
    w.settle();
    w.assert_one_owner();
    assert_eq!(w.owners(), vec![ORIGIN]);
    assert_eq!(w.switch.entries[&flow()].owner, ORIGIN);
    assert_eq!(w.hosts[0].stack.conns[&flow()].blob, blob(N));
}

/// TCPMig v2: a host's ownership epoch of a flow is the id of the
/// migration that brought the flow to it (0 for its placement); it moves on
/// with every owner change and is forgotten when the flow leaves or closes.
#[test]
fn ownership_epoch_follows_the_flow() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    assert_eq!(w.host(ORIGIN).engine.epoch(&flow()), 0);
    let there = w.migrate(None);
    w.run_for(Duration::from_millis(5));
    assert_eq!(w.owners(), vec![TARGET]);
    assert_eq!(w.host(TARGET).engine.epoch(&flow()), there.0);
    assert_eq!(w.host(ORIGIN).engine.epoch(&flow()), 0, "migrated out");
    let now = w.now;
    let back = w
        .host(TARGET)
        .engine
        .migrate_out(now, flow(), Some(ORIGIN))
        .unwrap();
    w.flush();
    w.settle();
    assert_eq!(w.owners(), vec![ORIGIN]);
    assert_eq!(w.switch.entries[&flow()].id, back.0);
    assert_eq!(w.host(ORIGIN).engine.epoch(&flow()), back.0);
    assert_eq!(w.host(TARGET).engine.epoch(&flow()), 0);
    // And away again: the switch takes the PREPARE_ACK only because it
    // names `back`, the entry's id (v1 compared ids of one origin only).
    let again = w.migrate(Some(TARGET));
    w.settle();
    assert_eq!(w.owners(), vec![TARGET]);
    assert_eq!(w.switch.entries[&flow()].id, again.0);
    assert_eq!(w.host(TARGET).engine.epoch(&flow()), again.0);
    w.host(TARGET).engine.forget_flow(&flow());
    assert_eq!(w.host(TARGET).engine.epoch(&flow()), 0, "closed");
}

#[test]
fn empty_and_large_snapshots() {
    for n in [0usize, 1, 488, 489, 60_000] {
        let mut w = World::serving(n, &[TARGET], Box::new(NoFaults));
        w.migrate(None);
        w.settle();
        w.assert_one_owner();
        assert_eq!(w.owners(), vec![TARGET]);
        assert_eq!(w.hosts[1].stack.imported, vec![blob(n)], "n = {n}");
    }
}

#[test]
fn oversized_snapshot_is_refused_and_origin_resumes() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.origin().stack.manual_export = true;
    let id = w.migrate(None);
    w.run_for(Duration::from_micros(100));
    let now = w.now;
    let err = w
        .origin()
        .engine
        .provide_snapshot(now, id, vec![0; 64 * 1024 + 1])
        .unwrap_err();
    assert!(matches!(err, MigError::SnapshotTooLarge { .. }), "{err}");
    w.origin().stack.pending_exports.clear();
    w.flush();
    w.settle();
    // The report names the cause (was `cancelled`, misleading operators).
    assert_eq!(resumed(&w), Some(Reason::SnapshotTooLarge));
    assert_origin_kept(&w);
}

/// The size known before the export (`refuse_snapshot_over_limit`): within
/// the limit nothing changes (the export goes on), over it the origin
/// resumes with the same reason as a refusal after the export, and no
/// state is ever sent.
#[test]
fn snapshot_known_oversized_before_the_export_is_refused_the_same_way() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.origin().stack.manual_export = true;
    let id = w.migrate(None);
    w.run_for(Duration::from_micros(100));
    let now = w.now;
    let max = w.origin().engine.config().max_snapshot_bytes;
    w.origin()
        .engine
        .refuse_snapshot_over_limit(now, id, max)
        .expect("within the limit");
    let err = w
        .origin()
        .engine
        .refuse_snapshot_over_limit(now, id, max + 1)
        .unwrap_err();
    assert!(
        matches!(err, MigError::SnapshotTooLarge { len, max: m } if len == max + 1 && m == max),
        "{err}"
    );
    // Not exporting any more: a second refusal is a typed error.
    let again = w
        .origin()
        .engine
        .refuse_snapshot_over_limit(now, id, max + 1)
        .unwrap_err();
    assert!(matches!(again, MigError::WrongState { .. }), "{again}");
    w.origin().stack.pending_exports.clear();
    w.flush();
    w.settle();
    assert_eq!(resumed(&w), Some(Reason::SnapshotTooLarge));
    assert_eq!(w.origin().engine.counters().tx.get(Kind::ConnState), 0);
    assert_origin_kept(&w);
}

#[test]
fn api_misuse_is_a_typed_error() {
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    let now = w.now;
    let e = &mut w.origin().engine;
    assert!(matches!(
        e.migrate_out(now, flow(), Some(ORIGIN)),
        Err(MigError::TargetIsSelf(_))
    ));
    let id = e.migrate_out(now, flow(), None).unwrap();
    assert!(matches!(
        e.migrate_out(now, flow(), None),
        Err(MigError::FlowBusy(_))
    ));
    assert!(matches!(
        e.provide_snapshot(now, id, vec![]),
        Err(MigError::WrongState { .. })
    ));
    assert!(matches!(
        e.import_done(now, id, |_| {}),
        Err(MigError::WrongState { .. })
    ));
    assert!(matches!(
        e.import_failed(now, MigrationId(7)),
        Err(MigError::UnknownMigration(_))
    ));
    let msg = e.provide_snapshot(now, id, vec![]).unwrap_err().to_string();
    assert!(
        msg.contains("preparing") && msg.contains("exporting"),
        "{msg}"
    );
}

#[test]
fn bad_mac_version_and_garbage_are_counted_and_dropped() {
    use capybara_proto::tcpmig::TcpMigRepr;
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    let now = w.now;
    let repr = TcpMigRepr {
        kind: Kind::Prepare,
        migration_id: 1,
        flow: flow(),
        origin: ORIGIN,
        target: TARGET,
        seq: 0,
        frag_index: 0,
        frag_count: 1,
        reason: Reason::None,
        epoch: 0,
        payload: &[],
    };
    let mut buf = [0u8; 128];
    let other = MigrationKey::from_bytes(&[1; 32]).unwrap();
    let n = repr.emit_with_mac(&mut buf, &other).unwrap();
    let t = &mut w.host(TARGET).engine;
    assert_eq!(
        t.handle_message(now, ORIGIN, &buf[..n]),
        Err(RxError::BadMac)
    );
    let mut v = buf;
    v[2] = 9;
    assert!(matches!(
        t.handle_message(now, ORIGIN, &v[..n]),
        Err(RxError::BadVersion(_))
    ));
    // A TCPMig v1 datagram (44-byte header, no epoch): refused by version
    // before its layout is read, whatever its MAC.
    let mut v1 = [0u8; 60];
    v1[..44].copy_from_slice(&buf[..44]);
    v1[2] = 1;
    assert!(matches!(
        t.handle_message(now, ORIGIN, &v1[..]),
        Err(RxError::BadVersion(
            capybara_proto::tcpmig::TcpMigError::UnsupportedVersion { found: 1 }
        ))
    ));
    assert!(matches!(
        t.handle_message(now, ORIGIN, &buf[..10]),
        Err(RxError::Malformed(_))
    ));
    let c = t.counters();
    assert_eq!((c.bad_mac, c.bad_version, c.malformed), (1, 2, 1));
    assert_eq!(t.records(), 0);
    assert!(t.poll_transmit(now, &mut buf).is_none());
}

#[test]
fn origin_snapshot_is_handed_back_on_resume_and_recycled_after_delivery() {
    // Resumed after the state went out: the engine held the only copy and
    // hands it back once, for the local re-import.
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.host(TARGET).stack.fail_import = true;
    let id = w.migrate(None);
    // Not `settle`: the record (and what it holds) expires after `linger`.
    while resumed(&w).is_none() {
        let limit = w.now + Duration::from_secs(1);
        assert!(w.step(limit), "no resume");
    }
    assert_eq!(resumed(&w), Some(Reason::ImportFailed));
    let e = &mut w.origin().engine;
    assert_eq!(e.take_resumed_snapshot(id), Some(blob(N)));
    assert_eq!(e.take_resumed_snapshot(id), None);

    // Refused: the snapshot comes back with the error, the engine keeps none.
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    w.origin().stack.manual_export = true;
    let id = w.migrate(None);
    w.run_for(Duration::from_micros(100));
    let now = w.now;
    let (err, back) = w
        .origin()
        .engine
        .offer_snapshot(now, id, vec![3; 64 * 1024 + 1])
        .unwrap_err();
    assert!(matches!(err, MigError::SnapshotTooLarge { .. }), "{err}");
    assert_eq!(back, vec![3; 64 * 1024 + 1]);
    assert_eq!(w.origin().engine.take_resumed_snapshot(id), None);

    // Delivered: nothing to hand back, and the buffer serves the next export.
    let mut w = World::serving(N, &[TARGET], Box::new(NoFaults));
    let id = w.migrate(None);
    while !done_out(&w) {
        let limit = w.now + Duration::from_secs(1);
        assert!(w.step(limit), "not migrated");
    }
    assert_eq!(w.origin().engine.take_resumed_snapshot(id), None);
    w.settle();
    assert_migrated(&w, TARGET);
    let e = &mut w.origin().engine;
    let buf = e.snapshot_buffer();
    assert!(buf.is_empty() && buf.capacity() >= N, "{}", buf.capacity());
    assert_eq!(e.snapshot_buffer().capacity(), 0, "one buffer was spare");
}

/// The telemetry host `a` read when migration `id` finished there.
fn telemetry_of(w: &World, a: std::net::Ipv4Addr, id: MigrationId) -> Option<Telemetry> {
    let h = w.hosts.iter().find(|h| h.addr == a)?;
    h.stack
        .telemetry
        .iter()
        .find(|(i, _)| *i == id)
        .map(|&(_, t)| t)
}
