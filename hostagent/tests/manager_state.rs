//! Connection-manager state across back-to-back migrations (issue #8).
//!
//! A migrated-in connection carries its application state (the sidecar:
//! client requests read but not yet forwarded). Until the application on the
//! target registers the connection's manager (the connection may still be
//! in the accept queue, or accepted with its task not run yet), the stack
//! must carry that state on unchanged if the connection migrates again. It
//! used to export nothing: the requests were lost and the client waited for
//! their replies forever (the pipelined RESP stall of the sidecar lab).
//!
//! Run: `cargo test -p capybara-hostagent --test manager_state`.

mod common;

use capybara_hostagent::socket::{ConnectionManager, Readiness, StateImporter};
use capybara_proto::time::Instant;
use capybara_proto::FlowKey;
use common::*;
use std::any::Any;
use std::cell::RefCell;
use std::rc::Rc;

const LIMIT: Instant = Instant::from_millis(60_000);
const STATE: &[u8] = b"*2\r\n$4\r\nECHO\r\n$5\r\nhello\r\n(read, not forwarded)";

/// Records every state imported on one server.
struct Recorder(Rc<RefCell<Vec<Vec<u8>>>>);

impl StateImporter for Recorder {
    fn import_state(&self, _flow: FlowKey, state: &[u8]) -> Result<Box<dyn Any>, String> {
        self.0.borrow_mut().push(state.to_vec());
        Ok(Box::new(()))
    }
}

/// A manager always at a safe point, holding `STATE`.
struct Holder;

impl ConnectionManager for Holder {
    fn prepare(&mut self) -> Readiness {
        Readiness::Ready
    }
    fn export_state(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        out.extend_from_slice(STATE);
        Ok(())
    }
    fn resume(&mut self) {}
}

fn migrate_and_settle(w: &mut World, to: usize) {
    w.migrate(true).expect("migrate");
    assert!(
        w.run_until(LIMIT, |w| !w.any_migrating() && w.owners() == vec![to]),
        "{}",
        w.describe()
    );
}

type Imported = Vec<Rc<RefCell<Vec<Vec<u8>>>>>;

/// An echo world whose two servers record every imported state, run until
/// the client got `warm` bytes back.
fn recording_world(seed: u64, len: usize, warm: usize) -> (World, Imported) {
    recording_world_limited(seed, len, warm, None)
}

/// `recording_world` with the servers' snapshot limit set to `limit`.
fn recording_world_limited(
    seed: u64,
    len: usize,
    warm: usize,
    limit: Option<usize>,
) -> (World, Imported) {
    let mut w = World::with(
        Setup {
            seed,
            app: App::Echo,
            net: Net::clean(),
        },
        stream(seed, len),
        client_tcp_config(),
        server_tcp_config,
        |addr| {
            let mut c = server_mig_config(addr);
            if let Some(l) = limit {
                c.max_snapshot_bytes = l;
            }
            c
        },
    );
    let imported: Imported = (0..2).map(|_| Rc::new(RefCell::new(Vec::new()))).collect();
    for (s, rec) in w.servers.iter_mut().zip(&imported) {
        s.migrator_mut()
            .managers
            .set_importer(SERVICE_PORT, Rc::new(Recorder(rec.clone())));
    }
    assert!(
        w.run_until(LIMIT, |w| w.client.received.len() >= warm),
        "{}",
        w.describe()
    );
    (w, imported)
}

/// Registers `manager` for the connection on `server`.
fn register(w: &mut World, server: usize, manager: Box<dyn ConnectionManager>) {
    let flow = w.flow().expect("connected");
    let m = w.servers[server].migrator_mut();
    let cid = *m.flows().find(|(f, _)| **f == flow).expect("served").1;
    let app = m.app_handle(cid);
    m.managers.set(app, manager);
}

#[test]
fn unclaimed_imported_state_travels_on_with_the_next_migration() {
    let (mut w, imported) = recording_world(81, 200_000, 20_000);
    // Server 0's application holds state for the connection.
    register(&mut w, 0, Box::new(Holder));

    migrate_and_settle(&mut w, 1);
    assert_eq!(imported[1].borrow().as_slice(), [STATE.to_vec()]);

    // Server 1's application has not registered a manager for the
    // connection yet: the state it arrived with must go on as it is.
    migrate_and_settle(&mut w, 0);
    assert_eq!(
        imported[0].borrow().as_slice(),
        [STATE.to_vec()],
        "the state imported on server 1 was lost when the connection moved on"
    );

    // And once more, so that a state handed back is not consumed either.
    migrate_and_settle(&mut w, 1);
    assert_eq!(imported[1].borrow().len(), 2);
    assert_eq!(imported[1].borrow()[1], STATE);

    assert!(w.finish(LIMIT), "{}", w.describe());
    w.assert_single_owner();
    assert_eq!(w.client.received, w.client.to_send, "echo stream exact");
}

#[test]
fn a_registered_manager_takes_the_imported_state_over() {
    let (mut w, imported) = recording_world(82, 100_000, 10_000);
    register(&mut w, 0, Box::new(Holder));
    migrate_and_settle(&mut w, 1);

    // Server 1's application takes the connection over with a manager
    // whose state is now empty (it consumed what was imported).
    struct Empty;
    impl ConnectionManager for Empty {
        fn prepare(&mut self) -> Readiness {
            Readiness::Ready
        }
        fn export_state(&mut self, _out: &mut Vec<u8>) -> Result<(), String> {
            Ok(())
        }
        fn resume(&mut self) {}
    }
    register(&mut w, 1, Box::new(Empty));
    migrate_and_settle(&mut w, 0);
    assert_eq!(imported[0].borrow().as_slice(), [Vec::<u8>::new()]);

    assert!(w.finish(LIMIT), "{}", w.describe());
    assert_eq!(w.client.received, w.client.to_send, "echo stream exact");
}

/// A manager holding `0` bytes of state (a sidecar in the middle of a
/// large request: client bytes read, not forwarded).
struct Big(Vec<u8>);

impl ConnectionManager for Big {
    fn prepare(&mut self) -> Readiness {
        Readiness::Ready
    }
    fn export_state(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        out.extend_from_slice(&self.0);
        Ok(())
    }
    fn resume(&mut self) {}
}

/// A sidecar connection migrates with up to its `max_request_bytes` (1 MiB
/// by default) of a partially received request, and one read more, as
/// state. The hostagent sized the engine's snapshot limit from the TCP
/// queues alone (both + 4 KiB, 516 KiB), so such a connection could not
/// migrate: the engine refused the snapshot as too large and the migration
/// ended `cancelled` (seen in the demo: a 900 kB upload paused mid-body,
/// `ctl migrate` of it aborted, `reason: cancelled`). With the limit the
/// configuration gives (`Config::max_snapshot_bytes`) it migrates, its
/// state intact.
#[test]
fn a_sidecars_largest_partial_request_migrates_under_the_configs_limit() {
    use capybara_hostagent::config::{Config, DEFAULT_MAX_REQUEST_BYTES};
    let cfg = Config::parse(
        "t.toml",
        "name = \"s1\"\n[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.11\"\n\
         gateway = \"198.18.1.1\"\n[[service]]\nlisten = \"198.18.100.1:80\"\napp = \"sidecar\"\n\
         backend = \"127.0.0.1:8080\"\nprotocol = \"http1\"\n",
    )
    .unwrap();
    let state: Vec<u8> = (0..DEFAULT_MAX_REQUEST_BYTES + (64 << 10))
        .map(|i| (i % 251) as u8)
        .collect();
    let (mut w, imported) =
        recording_world_limited(83, 300_000, 20_000, Some(cfg.max_snapshot_bytes()));
    register(&mut w, 0, Box::new(Big(state.clone())));
    migrate_and_settle(&mut w, 1);
    let got = imported[1].borrow();
    assert_eq!(got.len(), 1, "imported once");
    assert!(
        got[0] == state,
        "the state arrived intact ({} bytes)",
        got[0].len()
    );
    drop(got);
    assert!(w.finish(LIMIT), "{}", w.describe());
    w.assert_single_owner();
    assert_eq!(w.client.received, w.client.to_send, "echo stream exact");
}

/// A connection whose snapshot exceeds the limit stays on its origin and
/// the migration's outcome says why: `snapshot too large` (it said
/// `cancelled`, which sent operators looking for who cancelled it). The
/// origin also logs the connection and both sizes (`TooLargeLog`).
#[test]
fn an_oversized_snapshot_resumes_with_the_reason_snapshot_too_large() {
    use capybara_hostagent::migration::Outcome;
    use capybara_tcpmig::Reason;
    let state: Vec<u8> = (0..(2 << 20)).map(|i| (i % 251) as u8).collect();
    let (mut w, imported) = recording_world_limited(84, 300_000, 20_000, Some(1 << 20));
    register(&mut w, 0, Box::new(Big(state)));
    w.migrate(true).expect("migrate");
    assert!(
        w.run_until(LIMIT, |w| !w.any_migrating() && !w.outcomes().is_empty()),
        "{}",
        w.describe()
    );
    let origin: Vec<Outcome> = w
        .outcomes()
        .into_iter()
        .filter(|(s, _, _)| *s == 0)
        .map(|(_, _, o)| o)
        .collect();
    assert_eq!(origin, [Outcome::Resumed(Reason::SnapshotTooLarge)]);
    assert!(imported[1].borrow().is_empty(), "nothing imported");
    assert!(w.finish(LIMIT), "{}", w.describe());
    w.assert_single_owner();
    assert_eq!(w.owners(), vec![0]);
    assert_eq!(w.client.received, w.client.to_send, "echo stream exact");
}
