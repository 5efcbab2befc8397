//! Durable state of the appliance behind one `Store` trait.
//!
//! `store` owns servers, services, policies, flow-to-server mappings, drains,
//! the audit log, leader election for switchd HA and change notification.
//! Two backends behave identically and are checked by one conformance suite
//! (`tests/conformance.rs`): embedded SQLite (the default, one file) and
//! etcd v3 (clusters). Writes from the packet path go through `FlowWriter`, a
//! bounded, batching writer that never blocks packet processing and reports
//! its backlog and overflow.
//!
//! Invariants:
//! - untrusted bytes (stored values, keys, the SQLite file) never panic; they
//!   yield a `StoreError` naming the key, file or field;
//! - `apply_flows` is all-or-nothing per call on SQLite and per chunk of
//!   `max_txn_ops` on etcd; within a batch the last operation on a flow wins;
//! - `apply_flows_fenced` writes only while the given leadership holds,
//!   checked in the same transaction, so a deposed leader cannot write;
//! - a watch delivers every change made after `watch` returned, in order,
//!   or ends with `WatchLagged` so the consumer can re-list.

pub mod codec;
pub mod error;
pub mod etcd;
pub mod model;
pub mod sqlite;
#[cfg(feature = "testing")]
pub mod testing;
pub mod writer;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use capybara_proto::flow::{FlowKey, ServerId};
use futures::Stream;

pub use error::{PolicyError, Result, StoreError};
pub use etcd::{EtcdConfig, EtcdStore};
pub use model::*;
pub use sqlite::{SqliteConfig, SqliteStore};
pub use writer::{
    FlowWriter, FlowWriterConfig, FlowWriterMetrics, Overflow, OverflowReason, WriteFence,
};

/// A stream of changes. Ends with an error item if the watch broke
/// (`WatchLagged`, backend gone); the consumer re-lists and watches again.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent>> + Send>>;

/// The appliance's durable state. All methods are safe to call concurrently
/// from many tasks and from several processes sharing the backend.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// `"sqlite"` or `"etcd"`.
    fn backend(&self) -> &'static str;

    // ----- servers
    /// Registers or replaces a server.
    async fn put_server(&self, server: &Server) -> Result<()>;
    /// Writes the record a server's REGISTER made (switchd): registers or
    /// replaces it, except that an operator weight stored there
    /// (`weight_set`) stays unless `server.weight_set`
    /// (`merge_registered_server`: `server.weight` is kept as its
    /// `register_weight`). The read and the write are one transaction
    /// (SQLite) or a compare-and-swap loop (etcd), so an operator weight
    /// written concurrently is never lost. Returns the record written.
    async fn put_registered_server(&self, server: &Server) -> Result<Server>;
    async fn get_server(&self, id: ServerId) -> Result<Option<Server>>;
    /// All servers, ordered by id.
    async fn list_servers(&self) -> Result<Vec<Server>>;
    /// Sets the record's state (switchd's liveness: `Active`, `Dead`; an
    /// operator's drain is a `Drain` record); `NotFound` if the server is
    /// not registered.
    async fn set_server_state(&self, id: ServerId, state: ServerState) -> Result<Server>;
    /// Sets the placement weight as the operator's (`weight_set`: switchd
    /// applies it and a REGISTER keeps it); `NotFound` if the server is not
    /// registered.
    async fn set_server_weight(&self, id: ServerId, weight: u32) -> Result<Server>;
    /// Clears the operator's weight (`weight_set` false): the weight goes
    /// back to the REGISTER's (`register_weight`; unchanged when none is
    /// known, until the server's next REGISTER writes its own), and
    /// switchd applies the REGISTER's again. `NotFound` if the server is
    /// not registered; a no-op write when no operator weight is set.
    async fn clear_server_weight(&self, id: ServerId) -> Result<Server>;
    /// Returns whether the server existed.
    async fn delete_server(&self, id: ServerId) -> Result<bool>;

    // ----- services
    /// Creates or replaces a service. A replace that moves it to another
    /// VIP:port retires the old address: in the same transaction the old
    /// record is recorded as retiring (`RetiringService` of the old
    /// address, deleted now), replacing an earlier record of that name and
    /// address.
    async fn put_service(&self, service: &Service) -> Result<()>;
    async fn get_service(&self, name: &str) -> Result<Option<Service>>;
    /// All services, ordered by name.
    async fn list_services(&self) -> Result<Vec<Service>>;
    /// Deletes the service and, in the same transaction, records its
    /// address as retiring (`RetiringService`, deleted now), replacing an
    /// earlier record of that name and address; records of its other
    /// addresses (earlier moves) stay. Nothing is recorded when there was
    /// no service.
    async fn delete_service(&self, name: &str) -> Result<bool>;

    // ----- retiring services (deleted or moved, open connections still served)
    /// Every retiring record (one per name and address), ordered by name,
    /// then address. Records written before they were per address (one
    /// per name) are listed too. Not watched, not in the change log. A
    /// record that does not decode is an error naming its key.
    async fn list_retiring_services(&self) -> Result<Vec<RetiringService>>;
    /// Removes the retiring record of `name` at `addr` if it is the one
    /// retired at `deleted_unix_ms` (a later retire of that name and
    /// address is kept, and so are the name's other addresses). Returns
    /// whether a record was removed.
    async fn forget_retiring_service(
        &self,
        name: &str,
        addr: std::net::SocketAddrV4,
        deleted_unix_ms: u64,
    ) -> Result<bool>;

    // ----- seeded configured services (switchd's `[[services]]`)
    /// Remembers that these configured service names were seeded (written
    /// to the store from switchd's config, or found there), so that switchd
    /// never seeds them again: a service deleted through the API stays
    /// deleted. Idempotent; names are checked like service names. Not
    /// watched, not in the change log; `delete_service` keeps the mark.
    async fn mark_seeded(&self, names: &[String]) -> Result<()>;
    /// Every name `mark_seeded` recorded, sorted. Empty in a store written
    /// before marks existed.
    async fn seeded_services(&self) -> Result<Vec<String>>;

    // ----- policies
    /// The stored policy, or `Policy::default()` if none was stored.
    async fn get_policy(&self) -> Result<Policy>;
    /// Validates, then stores. `InvalidPolicy` names the bad field.
    async fn put_policy(&self, policy: &Policy) -> Result<()>;
    /// Validates, then stores `policy` only if none was stored yet (the
    /// check and the write in one transaction). `true`: it was written
    /// (and watchers see a `PolicyPut`); `false`: a stored policy was kept
    /// as it is. switchd seeds the store with its config's liveness timing
    /// this way (`get_policy` cannot tell an absent policy from a default).
    async fn put_policy_if_absent(&self, policy: &Policy) -> Result<bool>;

    // ----- flow-to-server mappings
    /// Applies a batch of puts and deletes; the last operation on a flow wins.
    async fn apply_flows(&self, ops: &[FlowOp]) -> Result<()>;
    /// `apply_flows` fenced by leadership: each transaction (all of it on
    /// SQLite, each chunk of `max_txn_ops` on etcd) is written only if
    /// `fence` (the `info` of a won `campaign`) still holds its election,
    /// checked atomically with the writes: same lease, not expired, not
    /// taken over. Otherwise nothing of that transaction is written and the
    /// answer is `NotLeader`, naming the lease and the current holder. An
    /// empty batch only checks the fence.
    async fn apply_flows_fenced(&self, ops: &[FlowOp], fence: &LeaderInfo) -> Result<()>;
    async fn get_flow(&self, key: &FlowKey) -> Result<Option<ServerId>>;
    /// Flows owned by `server`, ordered by key.
    async fn list_flows_by_server(&self, server: ServerId) -> Result<Vec<FlowKey>>;
    /// Every mapping (takeover by a standby switch), ordered by key.
    async fn scan_flows(&self) -> Result<Vec<FlowMapping>>;
    async fn count_flows(&self) -> Result<u64>;

    // ---- control-channel seq floors (replay protection across takeovers)
    /// Raises each server's stored floor to `seq` (the active switch, every
    /// few seconds): kept when the stored floor is of the same `instance`
    /// and not below; replaced when it is of another instance (the server
    /// restarted). Not watched, not in the change log. Any `instance` (a
    /// random u64) is kept; a `seq` above `i64::MAX` is refused (`Invalid`).
    async fn raise_seq_floors(&self, floors: &[SeqFloor]) -> Result<()>;
    /// Every stored floor, by server id.
    async fn seq_floors(&self) -> Result<Vec<SeqFloor>>;

    // ----- drains
    /// Starts or replaces the drain of `drain.server`.
    async fn put_drain(&self, drain: &Drain) -> Result<()>;
    async fn get_drain(&self, server: ServerId) -> Result<Option<Drain>>;
    /// All drains, ordered by server.
    async fn list_drains(&self) -> Result<Vec<Drain>>;
    /// Records progress (and optionally a new state); `NotFound` if no drain.
    async fn update_drain(
        &self,
        server: ServerId,
        progress: DrainProgress,
        state: DrainState,
    ) -> Result<Drain>;
    async fn delete_drain(&self, server: ServerId) -> Result<bool>;

    // ----- audit log
    /// Appends an entry; returns it with its sequence number.
    async fn append_audit(&self, record: &AuditRecord) -> Result<AuditEntry>;
    /// Up to `limit` entries with `seq > after`, oldest first.
    async fn list_audit(&self, after: u64, limit: usize) -> Result<Vec<AuditEntry>>;
    /// Up to `limit` entries with `seq > after`, newest first (the newest
    /// `limit` of them: one read however long the log).
    async fn list_audit_newest(&self, after: u64, limit: usize) -> Result<Vec<AuditEntry>>;

    // ----- leader election (switchd HA)
    /// Tries once to become leader of `election` with a lease of `ttl`
    /// (rounded up to whole seconds, at least 1 s). `Ok(None)` if another
    /// candidate holds a live lease.
    async fn campaign(
        &self,
        election: &str,
        candidate: &str,
        ttl: Duration,
    ) -> Result<Option<LeaderLease>>;
    /// Renews the lease; `NotLeader` if it expired or was taken over. Call
    /// at least every `ttl / 3`.
    async fn keep_alive(&self, lease: &LeaderLease) -> Result<()>;
    /// Gives up leadership at once (no-op if already lost).
    async fn resign(&self, lease: &LeaderLease) -> Result<()>;
    /// The current leader, if its lease is live.
    async fn leader(&self, election: &str) -> Result<Option<LeaderInfo>>;

    // ----- change notification
    /// Changes of the given kinds made after this call returns.
    async fn watch(&self, kinds: &[WatchKind]) -> Result<WatchStream>;
}

/// Which backend to open; deserializable from the appliance config.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "backend", rename_all = "snake_case", deny_unknown_fields)]
pub enum StoreConfig {
    Sqlite(SqliteConfig),
    Etcd(EtcdConfig),
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Sqlite(SqliteConfig::default())
    }
}

/// Opens the configured backend.
pub async fn open(config: &StoreConfig) -> Result<Arc<dyn Store>> {
    Ok(match config {
        StoreConfig::Sqlite(c) => Arc::new(SqliteStore::open(c.clone()).await?),
        StoreConfig::Etcd(c) => Arc::new(EtcdStore::connect(c.clone()).await?),
    })
}

/// Moves drains a previous version kept in the server records (`state`
/// `draining` / `drained`) into `Drain` records, then writes the records'
/// state back to liveness (`active`): such a server stays out of placement
/// until `undrain`. A server whose `Drain` record already holds it (the
/// drain that wrote the state) keeps that record; otherwise one is
/// written, started and ended at the upgrade, without progress:
/// `completed` for `drained`, `timed_out` for `draining` (no supervisor
/// runs it: it waits for an `undrain`, as the record did). Idempotent; switchd runs it when it becomes active,
/// before it writes any server record, and the API when it starts.
/// Returns the servers moved.
pub async fn upgrade_legacy_drain_states(store: &dyn Store) -> Result<Vec<ServerId>> {
    let mut moved = Vec::new();
    for s in store.list_servers().await? {
        let drain_state = match s.state {
            ServerState::Draining => DrainState::TimedOut,
            ServerState::Drained => DrainState::Completed,
            ServerState::Active | ServerState::Dead => continue,
        };
        let held = store
            .get_drain(s.id)
            .await?
            .is_some_and(|d| d.state != DrainState::Cancelled);
        if !held {
            let now = unix_ms_now();
            store
                .put_drain(&Drain {
                    server: s.id,
                    targets: Vec::new(),
                    started_unix_ms: now,
                    deadline_unix_ms: now,
                    state: drain_state,
                    progress: DrainProgress::default(),
                })
                .await?;
        }
        store.set_server_state(s.id, ServerState::Active).await?;
        moved.push(s.id);
    }
    Ok(moved)
}

/// Rounds a lease TTL up to whole seconds (etcd's granularity), minimum 1 s.
pub(crate) fn lease_ttl_secs(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    secs.clamp(1, 3600 * 24) as i64
}

/// Turns a channel receiver into a `WatchStream`.
pub(crate) fn receiver_stream(rx: tokio::sync::mpsc::Receiver<Result<WatchEvent>>) -> WatchStream {
    Box::pin(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}
