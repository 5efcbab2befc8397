//! A migration still pending toward a server that died goes back to its
//! origin when the dead server's entries are removed (end of its
//! `dead_flow_grace`), instead of being removed with them
//! (`DataPlane::remove_flows_of`; docs/MIGRATION.md, "What the switch must
//! do"). The origin is then the one owner: it resumed the connection (its
//! deadline passed before it sent the snapshot: the PREPARE_ACK had passed
//! the switch, the target died) or gave it up as `Lost` and resets the
//! client's next segment. Before (2026-11-24) the entry and the flow entry
//! were removed, the client's next segment was placed again by Maglev, and
//! a connection its origin still served was reset by whichever other
//! server Maglev picked (or went on, by luck, when Maglev picked the
//! origin).
//!
//! Needs root (CAP_BPF) for the real program (BPF_PROG_TEST_RUN on dummy
//! interfaces, as tests/dataplane.rs); the in-memory backend is checked
//! the same way.

#[allow(unused_imports)]
mod support;

use capybara_switchd::dataplane::MemDataPlane;
use support::*;

fn flow_on(server: u32) -> CFlow {
    CFlow {
        server,
        service: 0,
        flags: FLOW_ESTABLISHED,
        created_ns: 0,
    }
}

/// Three flows of dead server 1: pending toward it from live origin 0
/// (`back`), pending toward it from dead origin 3 (`orphan`), final on it
/// (`owned`). Marks server 1 dead, removes its flows and checks what is
/// left.
fn check(dp: &mut dyn DataPlane, ifindex: u32, back: u16, installed_by_packet: bool) {
    let (orphan, owned) = (back + 1, back + 2);
    let m_back = mid(0, 7);
    if !installed_by_packet {
        dp.insert_flow(flow_key(back), flow_on(0)).unwrap();
        dp.insert_migration(flow_key(back), CMigration::pending(1, m_back))
            .unwrap();
    }
    dp.insert_flow(flow_key(orphan), flow_on(3)).unwrap();
    dp.insert_migration(flow_key(orphan), CMigration::pending(1, mid(3, 2)))
        .unwrap();
    dp.insert_flow(flow_key(owned), flow_on(0)).unwrap();
    dp.insert_migration(flow_key(owned), CMigration::owner(1, mid(0, 3)))
        .unwrap();

    dp.set_server(1, server(SERVER_DEAD, 1, ifindex)).unwrap();
    let mut removed = dp.remove_flows_of(1).unwrap();
    removed.sort_by_key(|k| k.client_port);
    assert_eq!(
        removed,
        vec![flow_key(orphan), flow_key(owned)],
        "removed: the flow pending from a dead origin and the one owned by the dead server"
    );
    assert_eq!(
        dp.lookup_migration(flow_key(back)).unwrap(),
        Some(CMigration::owner(0, m_back)),
        "the migration pending toward the dead target is final on its live origin"
    );
    assert_eq!(
        dp.lookup_flow(flow_key(back)).unwrap().map(|f| f.server),
        Some(0),
        "its flow entry stays"
    );
    for k in [orphan, owned] {
        assert_eq!(dp.lookup_migration(flow_key(k)).unwrap(), None);
        assert_eq!(dp.lookup_flow(flow_key(k)).unwrap(), None);
    }
}

#[test]
fn a_migration_pending_toward_a_dead_target_goes_back_to_its_live_origin() {
    let mut lab = setup();
    // s0 and s1 live, s3 dead (support's setup). A flow on s0 (Maglev)
    // migrating to s1: its PREPARE_ACK passed, the entry is pending.
    let sport = (41000u16..)
        .step_by(3)
        .find(|p| maglev_server(&lab, *p, VIP) == 0)
        .unwrap();
    lab.dp.insert_flow(flow_key(sport), flow_on(0)).unwrap();
    let m = mid(0, 7);
    run(
        &mut lab,
        vec![
            relayed(
                "PREPARE-ACK from s1 makes the entry pending toward it",
                1,
                0,
                mig(Kind::PrepareAck, m, sport, 0, Some(1)),
                "fwd_prepare_ack",
            ),
            client_to(
                "the client's segments go to the target",
                sport,
                TCP_ACK | TCP_PSH,
                1,
                "fwd_migrated",
            ),
        ],
    );
    let sv = lab.sv;
    check(&mut lab.dp, sv, sport, true);
    // The client's segments reach the origin again, never the dead target.
    run(
        &mut lab,
        vec![client_to(
            "the client's segments go back to the origin",
            sport,
            TCP_ACK | TCP_PSH,
            0,
            "fwd_migrated",
        )],
    );
}

#[test]
fn the_in_memory_data_plane_does_the_same() {
    let mut dp = MemDataPlane::default();
    for (i, state) in [SERVER_LIVE, SERVER_LIVE, SERVER_LIVE, SERVER_DEAD]
        .into_iter()
        .enumerate()
    {
        dp.set_server(i as u32, server(state, i as u32, 1)).unwrap();
    }
    check(&mut dp, 1, 41000, false);
}
