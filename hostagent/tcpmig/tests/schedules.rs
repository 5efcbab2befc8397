//! Property: under any schedule of loss (before or after the switch),
//! duplication and reordering of TCPMig datagrams, a migration ends with
//! exactly one owner that the switch agrees with, never two owners at any
//! instant, and a completed migration delivers the snapshot intact.

mod common;

use capybara_tcpmig::*;
use common::*;
use proptest::prelude::*;

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        6 => Just(Fate::Deliver),
        2 => Just(Fate::DropBeforeSwitch),
        2 => Just(Fate::DropAfterSwitch),
        1 => Just(Fate::Duplicate),
        1 => (1u64..20_000).prop_map(Fate::Delay),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn one_owner_under_any_schedule(
        schedule in proptest::collection::vec(fate(), 0..120),
        n in 0usize..4000,
        target_first in any::<bool>(),
        fail_import in prop::bool::weighted(0.1),
        segments in 0usize..6,
    ) {
        let mut w = World::with_config(&[TARGET], Box::new(Scripted(schedule)), |a| {
            let mut c = config(a);
            if target_first {
                // The target's deadline fires before the origin's.
                c.target_deadline = Duration::from_millis(20);
            }
            c
        });
        w.hosts[0].stack.conns.insert(flow(), Conn { state: ConnState::Active, blob: blob(n), received: vec![] });
        w.host(TARGET).stack.fail_import = fail_import;
        w.migrate(None);
        for i in 0..segments {
            w.run_for(Duration::from_micros(7));
            w.client_send(&[i as u8; 50]);
        }
        w.settle();
        w.assert_one_owner();
        prop_assert!(w.max_owners_seen <= 1);
        let out = w.events(ORIGIN).iter().filter(|e| matches!(e,
            Event::MigratedOut { .. } | Event::Resumed { .. } | Event::Lost { .. })).count();
        prop_assert_eq!(out, 1, "exactly one outcome at the origin: {:?}", w.events(ORIGIN));
        let t = &w.hosts[1];
        if t.stack.owns(&flow()) {
            prop_assert_eq!(&t.stack.imported, &vec![blob(n)]);
        } else {
            let lost = w.events(ORIGIN).iter().any(|e| matches!(e, Event::Lost { .. }));
            prop_assert!(w.hosts[0].stack.owns(&flow()) || lost, "nobody owns and nothing was lost");
        }
        if w.events(ORIGIN).iter().any(|e| matches!(e, Event::MigratedOut { .. })) {
            prop_assert!(t.stack.owns(&flow()), "migrated out but the target does not own");
        }
        // Everything is forgotten after linger.
        prop_assert_eq!(w.hosts[0].engine.records(), 0);
        prop_assert_eq!(w.hosts[1].engine.records(), 0);
    }
}
