//! A deterministic driver for counting the host work of a migration with
//! callgrind (instruction counts do not depend on the machine's load).
//!
//! The four-party harness of `common` (production `Interface`,
//! `Transports`, `Endpoint`, `Engine` and `Migrator` on a virtual clock)
//! moves one echo connection with data in flight back and forth
//! `CAPYBARA_INSTR_MIGRATIONS` times (default 200), one migration at a time,
//! with the telemetry dump off. The calls `make bench-migration` times as
//! host CPU are `Migrator::migrate`, `Migrator::handle_message` (with the
//! export / import / replay it triggers) and `Migrator::poll_transmit`;
//! count only those:
//!
//! ```text
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/mig.cg \
//!   --toggle-collect='*Migrator*migrate*' \
//!   --toggle-collect='*Migrator*handle_message*' \
//!   --toggle-collect='*Migrator*poll_transmit*' \
//!   TEST_BINARY --ignored --exact migrations_for_callgrind --nocapture
//! ```
//!
//! and divide the collected instructions by the migrations printed.
//! `CAPYBARA_INSTR_QUEUE` sets both TCP queues of the servers (bytes,
//! default 2048 like `migration_cpu`; the lab's snapshots are ~250 bytes:
//! use 256 for those). Ignored by default (it measures, it checks little).

mod common;

use capybara_hostagent::migration::Outcome;
use capybara_proto::time::{Duration, Instant};
use common::*;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore]
fn migrations_for_callgrind() {
    let wanted = env_usize("CAPYBARA_INSTR_MIGRATIONS", 200);
    let queue = env_usize("CAPYBARA_INSTR_QUEUE", 2048);
    let mut w = echo_world_with_queues(queue);
    let mut next = Instant::from_millis(1);
    let limit = Instant::from_millis(600_000);
    while w.started.len() < wanted {
        if w.run_until(next, |w| w.client.done()) || w.now >= limit {
            break;
        }
        if !w.any_migrating() {
            let _ = w.migrate(w.started.len() % 2 == 0);
        }
        next = w.now + Duration::from_micros(200);
    }
    // Let the last one finish.
    let end = w.now + Duration::from_millis(50);
    w.run_until(end, |w| !w.any_migrating());
    let outcomes = w.outcomes();
    let out = outcomes
        .iter()
        .filter(|(_, _, o)| *o == Outcome::MigratedOut)
        .count();
    let inn = outcomes
        .iter()
        .filter(|(_, _, o)| *o == Outcome::MigratedIn)
        .count();
    let other = outcomes.len() - out - inn;
    w.assert_single_owner();
    println!(
        "RESULT migrations={out} migrated_in={inn} other_outcomes={other} started={} queue={queue}",
        w.started.len()
    );
    assert!(out > 0 && out == inn, "out {out} in {inn}");
}
