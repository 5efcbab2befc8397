//! Embedded SQLite backend: one file, WAL, versioned schema with migrations.
//!
//! The file is marked with `PRAGMA application_id` so that a foreign SQLite
//! database is refused instead of being written into, and `PRAGMA
//! user_version` records the schema version; older files are migrated in one
//! transaction on open, newer ones are refused.
//!
//! Several processes may share the file: writes use `BEGIN IMMEDIATE` with a
//! busy timeout, leader leases are rows with a wall-clock expiry, and every
//! change to watched records is appended to the `changes` table in the same
//! transaction. A poller per process reads `changes` (woken at once by local
//! writes, otherwise every `watch_poll_interval_ms`) and broadcasts typed
//! events, so watchers see other processes' writes too.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use capybara_proto::flow::{FlowKey, ServerId};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, Notify};

use crate::codec::{self, decode, encode};
use crate::error::{fenced_out, Result, StoreError};
use crate::model::*;
use crate::{lease_ttl_secs, Store, WatchStream};

/// "CAPY": marks a file as a Capybara store.
pub const APPLICATION_ID: i64 = 0x4341_5059;

/// Schema migrations; entry `i` moves the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 1: initial tables. Records are versioned JSON; flows are columns
    // because they are written at packet rate.
    "CREATE TABLE servers (id INTEGER PRIMARY KEY, value BLOB NOT NULL);
     CREATE TABLE services (name TEXT PRIMARY KEY, value BLOB NOT NULL);
     CREATE TABLE policy (id INTEGER PRIMARY KEY CHECK (id = 1), value BLOB NOT NULL);
     CREATE TABLE drains (server INTEGER PRIMARY KEY, value BLOB NOT NULL);
     CREATE TABLE audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, value BLOB NOT NULL);
     CREATE TABLE flows (
         client_ip INTEGER NOT NULL, client_port INTEGER NOT NULL,
         service_ip INTEGER NOT NULL, service_port INTEGER NOT NULL,
         server INTEGER NOT NULL,
         PRIMARY KEY (client_ip, client_port, service_ip, service_port)) WITHOUT ROWID;
     CREATE TABLE leader (
         election TEXT PRIMARY KEY, candidate TEXT NOT NULL, lease_id INTEGER NOT NULL,
         term INTEGER NOT NULL, expires_unix_ms INTEGER NOT NULL);",
    // 2: list flows by server without a scan; change log for watchers.
    "CREATE INDEX flows_by_server ON flows (server);
     CREATE TABLE changes (
         seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL,
         key TEXT NOT NULL, value BLOB);",
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Change-log rows kept for slow watchers in other processes.
const CHANGES_KEPT: i64 = 10_000;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqliteConfig {
    pub path: PathBuf,
    /// How long a writer waits for another process holding the write lock.
    pub busy_timeout_ms: u64,
    /// How often other processes' changes are polled for watchers.
    pub watch_poll_interval_ms: u64,
    /// `synchronous=FULL` (fsync every commit) instead of `NORMAL` (fsync at
    /// checkpoints; a power cut may lose the last commits, never corrupts).
    pub fsync_every_commit: bool,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        SqliteConfig {
            path: PathBuf::from("/var/lib/capybara/store.db"),
            busy_timeout_ms: 5_000,
            watch_poll_interval_ms: 50,
            fsync_every_commit: false,
        }
    }
}

impl SqliteConfig {
    pub fn at(path: impl Into<PathBuf>) -> Self {
        SqliteConfig {
            path: path.into(),
            ..Default::default()
        }
    }
}

enum HubMsg {
    /// `filterable`: the event carries a change-log seq that subscribers
    /// compare with their start position; leader events are computed from
    /// lease rows and carry no seq of their own.
    Event {
        filterable: bool,
        event: WatchEvent,
    },
    Lagged(u64),
}

impl Clone for HubMsg {
    fn clone(&self) -> Self {
        match self {
            HubMsg::Event { filterable, event } => HubMsg::Event {
                filterable: *filterable,
                event: event.clone(),
            },
            HubMsg::Lagged(n) => HubMsg::Lagged(*n),
        }
    }
}

struct Inner {
    path: String,
    config: SqliteConfig,
    conn: Mutex<Connection>,
    /// Wakes the poller after a local write.
    written: Notify,
    hub: Mutex<Option<broadcast::Sender<HubMsg>>>,
}

/// The SQLite store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .finish()
    }
}

fn corrupt_or(path: &str, op: &'static str, e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) | Some(rusqlite::ErrorCode::DatabaseCorrupt) => {
            StoreError::Corrupt {
                path: path.to_string(),
                reason: e.to_string(),
            }
        }
        _ => StoreError::Sqlite { op, source: e },
    }
}

/// Creates (or opens) a store file at exactly `version` of the schema. For
/// migration tests; production code calls `SqliteStore::open`.
#[doc(hidden)]
pub fn create_at_schema_version(path: &std::path::Path, version: i64) -> Result<()> {
    let mut conn = Connection::open(path).map_err(StoreError::sqlite("open"))?;
    let path_s = path.display().to_string();
    migrate(&mut conn, &path_s, 0, version.clamp(0, SCHEMA_VERSION))
}

fn migrate(conn: &mut Connection, path: &str, from: i64, to: i64) -> Result<()> {
    if from >= to {
        return Ok(());
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Exclusive)
        .map_err(|e| corrupt_or(path, "begin migration", e))?;
    // Another process (switchd and the api open one file) may have migrated
    // the schema between the caller's read and this exclusive lock.
    let from: i64 = tx
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(|e| corrupt_or(path, "read user_version", e))?;
    if from >= to {
        return Ok(());
    }
    for v in from..to {
        let sql = MIGRATIONS[v as usize];
        tx.execute_batch(sql)
            .map_err(|e| corrupt_or(path, "schema migration", e))?;
    }
    tx.pragma_update(None, "application_id", APPLICATION_ID)
        .map_err(|e| corrupt_or(path, "set application_id", e))?;
    tx.pragma_update(None, "user_version", to)
        .map_err(|e| corrupt_or(path, "set user_version", e))?;
    tx.commit()
        .map_err(|e| corrupt_or(path, "commit migration", e))?;
    tracing::info!(path, from, to, "migrated store schema");
    Ok(())
}

fn open_blocking(config: &SqliteConfig) -> Result<Connection> {
    let path = config.path.display().to_string();
    if let Some(dir) = config.path.parent() {
        if !dir.as_os_str().is_empty() && !dir.exists() {
            return Err(StoreError::Config(format!(
                "SQLite store {path}: directory {} does not exist",
                dir.display()
            )));
        }
    }
    let mut conn = Connection::open_with_flags(
        &config.path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| corrupt_or(&path, "open", e))?;
    conn.busy_timeout(Duration::from_millis(config.busy_timeout_ms))
        .map_err(|e| corrupt_or(&path, "set busy timeout", e))?;
    // The header and the table list are read in one read transaction: the
    // switchd and the API of one appliance open the same new file at once,
    // and read one by one, the application id could be read before the
    // other's schema migration committed (0) and the tables after it (its
    // tables), which looked like a foreign database (seen in CI: the
    // second opener refused to start).
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Deferred)
        .map_err(|e| corrupt_or(&path, "begin reading the header", e))?;
    // The first read of the header: a file that is not SQLite fails here.
    let app_id: i64 = tx
        .query_row("PRAGMA application_id", [], |r| r.get(0))
        .map_err(|e| corrupt_or(&path, "read application_id", e))?;
    let version: i64 = tx
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| corrupt_or(&path, "read user_version", e))?;
    let tables: Vec<String> = {
        let mut st = tx
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .map_err(|e| corrupt_or(&path, "list tables", e))?;
        let rows = st
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(|e| corrupt_or(&path, "list tables", e))?;
        rows.collect::<std::result::Result<_, _>>()
            .map_err(|e| corrupt_or(&path, "list tables", e))?
    };
    tx.commit()
        .map_err(|e| corrupt_or(&path, "end reading the header", e))?;
    if app_id == 0 && !tables.is_empty() {
        return Err(StoreError::ForeignDatabase {
            path,
            reason: format!(
                "it holds tables [{}] but lacks the Capybara application id {APPLICATION_ID:#x}",
                tables.join(", ")
            ),
        });
    }
    if app_id != 0 && app_id != APPLICATION_ID {
        return Err(StoreError::ForeignDatabase {
            path,
            reason: format!("application id is {app_id:#x}, expected {APPLICATION_ID:#x}"),
        });
    }
    if version < 0 {
        return Err(StoreError::Corrupt {
            path,
            reason: format!("schema version (user_version) is negative: {version}"),
        });
    }
    if version > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            path,
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    // Switching to WAL needs the file to itself, and SQLite answers BUSY at
    // once there (no busy handler) while another process opening the same
    // file holds a lock: retried within the busy timeout.
    let wal_deadline =
        std::time::Instant::now() + Duration::from_millis(config.busy_timeout_ms.max(1000));
    let mode: String = loop {
        match conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get::<_, String>(0)) {
            Ok(m) => break m,
            Err(rusqlite::Error::SqliteFailure(f, _))
                if f.code == rusqlite::ErrorCode::DatabaseBusy
                    && std::time::Instant::now() < wal_deadline =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(corrupt_or(&path, "enable WAL", e)),
        }
    };
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Config(format!(
            "SQLite store {path}: cannot enable WAL (journal mode stays {mode})"
        )));
    }
    let sync = if config.fsync_every_commit {
        "FULL"
    } else {
        "NORMAL"
    };
    conn.pragma_update(None, "synchronous", sync)
        .map_err(|e| corrupt_or(&path, "set synchronous", e))?;
    migrate(&mut conn, &path, version, SCHEMA_VERSION)?;
    conn.execute_batch(SEQ_FLOORS_TABLE)
        .map_err(|e| corrupt_or(&path, "create seq_floors", e))?;
    conn.execute_batch(SEEDED_SERVICES_TABLE)
        .map_err(|e| corrupt_or(&path, "create seeded_services", e))?;
    conn.execute_batch(RETIRING_SERVICES_TABLE)
        .map_err(|e| corrupt_or(&path, "create retiring_services", e))?;
    conn.execute_batch(RETIRING_ADDRESSES_TABLE)
        .map_err(|e| corrupt_or(&path, "create retiring_addresses", e))?;
    Ok(conn)
}

/// The control-channel seq floors (`Store::raise_seq_floors`): an additive
/// table outside the versioned schema, so that a file the newer build opened
/// still opens in an older one (switchd and the api may be upgraded one
/// after the other), which ignores the table.
const SEQ_FLOORS_TABLE: &str = "CREATE TABLE IF NOT EXISTS seq_floors (
    server INTEGER PRIMARY KEY, instance INTEGER NOT NULL, seq INTEGER NOT NULL)";

/// The configured service names switchd seeded (`Store::mark_seeded`):
/// additive like `seq_floors`, so a file without it (written before it
/// existed) opens and gets it empty, and an older build ignores it.
const SEEDED_SERVICES_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS seeded_services (name TEXT PRIMARY KEY)";

/// Retiring service records as the build before per-address records
/// wrote them (one per name): still listed and forgotten, no longer
/// written (a record of the same name and address written now replaces
/// it). Additive like `seq_floors`.
const RETIRING_SERVICES_TABLE: &str = "CREATE TABLE IF NOT EXISTS retiring_services (
    name TEXT PRIMARY KEY, deleted_unix_ms INTEGER NOT NULL, value BLOB NOT NULL)";

/// Retiring records (`Store::list_retiring_services`), one per service
/// name and retired address, written with the delete or the move that
/// retires the address: additive like `seq_floors`, so a file without it
/// opens and gets it empty, and an older build ignores it.
/// `deleted_unix_ms` is also a column, for the exact-record forget.
const RETIRING_ADDRESSES_TABLE: &str = "CREATE TABLE IF NOT EXISTS retiring_addresses (
    name TEXT NOT NULL, vip INTEGER NOT NULL, port INTEGER NOT NULL,
    deleted_unix_ms INTEGER NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (name, vip, port))";

/// Writes retiring record `record` inside the caller's transaction,
/// replacing the record of the same name and address, and the record of
/// the older one-per-name table if it is of that address.
fn write_retiring(
    tx: &rusqlite::Transaction<'_>,
    op: &'static str,
    record: &RetiringService,
) -> Result<()> {
    let name = &record.service.name;
    let deleted_at = seq_column("deleted_unix_ms", record.deleted_unix_ms)?;
    tx.prepare_cached(
        "INSERT OR REPLACE INTO retiring_addresses (name, vip, port, deleted_unix_ms, value)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )
    .and_then(|mut s| {
        s.execute(params![
            name,
            i64::from(u32::from(record.service.vip)),
            i64::from(record.service.port),
            deleted_at,
            encode(record)
        ])
    })
    .map_err(StoreError::sqlite(op))?;
    let legacy: Option<Vec<u8>> = tx
        .prepare_cached("SELECT value FROM retiring_services WHERE name = ?1")
        .and_then(|mut s| s.query_row([name], |r| r.get(0)).optional())
        .map_err(StoreError::sqlite(op))?;
    let superseded = legacy
        .and_then(|v| codec::decode_retiring(&codec::retiring_key(name), name, None, &v).ok())
        .is_some_and(|old| old.addr() == record.addr());
    if superseded {
        tx.prepare_cached("DELETE FROM retiring_services WHERE name = ?1")
            .and_then(|mut s| s.execute([name]))
            .map_err(StoreError::sqlite(op))?;
    }
    Ok(())
}

/// A u64 of a seq floor as an SQLite integer (i64).
fn seq_column(what: &'static str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| StoreError::Invalid {
        what,
        reason: format!("{v} is above {} (the largest the store keeps)", i64::MAX),
    })
}

/// Appends a change-log row inside the caller's transaction.
fn log_change(
    tx: &rusqlite::Transaction<'_>,
    kind: &str,
    key: &str,
    value: Option<&[u8]>,
) -> rusqlite::Result<()> {
    tx.prepare_cached("INSERT INTO changes (kind, key, value) VALUES (?1, ?2, ?3)")?
        .execute(params![kind, key, value])?;
    let seq = tx.last_insert_rowid();
    if seq % 1000 == 0 {
        tx.prepare_cached("DELETE FROM changes WHERE seq <= ?1")?
            .execute([seq - CHANGES_KEPT])?;
    }
    Ok(())
}

fn ip_from_i64(key: impl Fn() -> String, v: i64) -> Result<Ipv4Addr> {
    u32::try_from(v)
        .map(Ipv4Addr::from)
        .map_err(|_| StoreError::MalformedKey {
            key: key(),
            reason: format!("IPv4 column holds {v}"),
        })
}
fn port_from_i64(key: impl Fn() -> String, v: i64) -> Result<u16> {
    u16::try_from(v).map_err(|_| StoreError::MalformedKey {
        key: key(),
        reason: format!("port column holds {v}"),
    })
}
fn server_from_i64(key: &str, v: i64) -> Result<ServerId> {
    u32::try_from(v)
        .map(ServerId)
        .map_err(|_| StoreError::MalformedValue {
            key: key.to_string(),
            reason: format!("server id {v} is not a 32-bit unsigned integer"),
        })
}

type FlowRow = (i64, i64, i64, i64, i64);

fn flow_from_row(r: FlowRow) -> Result<FlowMapping> {
    let (ci, cp, si, sp, server) = r;
    let raw = || format!("flows/{ci}:{cp}->{si}:{sp}");
    let key = FlowKey {
        client_ip: ip_from_i64(raw, ci)?,
        client_port: port_from_i64(raw, cp)?,
        service_ip: ip_from_i64(raw, si)?,
        service_port: port_from_i64(raw, sp)?,
    };
    let server = server_from_i64(&codec::flow_key(&key), server)?;
    Ok(FlowMapping { key, server })
}

fn flow_params(k: &FlowKey) -> [i64; 4] {
    [
        i64::from(u32::from(k.client_ip)),
        i64::from(k.client_port),
        i64::from(u32::from(k.service_ip)),
        i64::from(k.service_port),
    ]
}

/// A live lease row, if any, from the `leader` table.
fn read_leader(
    conn: &Connection,
    election: &str,
    now_ms: i64,
) -> rusqlite::Result<Option<LeaderInfo>> {
    conn.prepare_cached(
        "SELECT candidate, lease_id, term FROM leader WHERE election = ?1 AND expires_unix_ms > ?2",
    )?
    .query_row(params![election, now_ms], |r| {
        Ok(LeaderInfo {
            election: election.to_string(),
            candidate: r.get(0)?,
            lease_id: r.get(1)?,
            term: r.get::<_, i64>(2)? as u64,
        })
    })
    .optional()
}

fn decode_change(kind: &str, key: &str, value: Option<&[u8]>) -> Result<Change> {
    let id_part = |prefix: &str| key.strip_prefix(prefix).unwrap_or("");
    Ok(match (kind, value) {
        ("servers", Some(v)) => Change::ServerPut(decode(key, v)?),
        ("servers", None) => {
            Change::ServerDeleted(codec::parse_server_id(key, id_part("servers/"))?)
        }
        ("services", Some(v)) => Change::ServicePut(decode(key, v)?),
        ("services", None) => Change::ServiceDeleted(id_part("services/").to_string()),
        ("policy", Some(v)) => Change::PolicyPut(decode(key, v)?),
        ("drains", Some(v)) => Change::DrainPut(decode(key, v)?),
        ("drains", None) => Change::DrainDeleted(codec::parse_server_id(key, id_part("drains/"))?),
        ("audit", Some(v)) => Change::AuditAppended(decode(key, v)?),
        _ => {
            return Err(StoreError::MalformedKey {
                key: format!("changes/{key}"),
                reason: format!(
                    "unknown change kind {kind:?} (value present: {})",
                    value.is_some()
                ),
            })
        }
    })
}

impl SqliteStore {
    /// Opens or creates the store file, migrating an older schema.
    pub async fn open(config: SqliteConfig) -> Result<Self> {
        let cfg = config.clone();
        let conn = tokio::task::spawn_blocking(move || open_blocking(&cfg))
            .await
            .map_err(|e| StoreError::Internal(format!("open task failed: {e}")))??;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                path: config.path.display().to_string(),
                config,
                conn: Mutex::new(conn),
                written: Notify::new(),
                hub: Mutex::new(None),
            }),
        })
    }

    pub fn path(&self) -> &str {
        &self.inner.path
    }

    /// Runs `f` on the connection in the blocking pool.
    async fn run<T, F>(&self, op: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        let res = tokio::task::spawn_blocking(move || {
            let mut conn = inner.conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut conn)
        })
        .await
        .map_err(|e| StoreError::Internal(format!("{op}: blocking task failed: {e}")))?;
        // Page-level corruption shows up on any query; name the file.
        res.map_err(|e| match e {
            StoreError::Sqlite { op, source } => corrupt_or(&self.inner.path, op, source),
            other => other,
        })
    }

    /// Up to `limit` audit entries with `seq > after`, oldest first or
    /// (`newest`) newest first.
    async fn audit_page(
        &self,
        op: &'static str,
        after: u64,
        limit: usize,
        newest: bool,
    ) -> Result<Vec<AuditEntry>> {
        let after = i64::try_from(after).unwrap_or(i64::MAX);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.run(op, move |conn| {
            let sql = if newest {
                "SELECT seq, value FROM audit WHERE seq > ?1 ORDER BY seq DESC LIMIT ?2"
            } else {
                "SELECT seq, value FROM audit WHERE seq > ?1 ORDER BY seq LIMIT ?2"
            };
            let mut st = conn.prepare_cached(sql).map_err(StoreError::sqlite(op))?;
            let rows = st
                .query_map([after, limit], |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?))
                })
                .map_err(StoreError::sqlite(op))?;
            let mut out = Vec::new();
            for r in rows {
                let (seq, v) = r.map_err(StoreError::sqlite(op))?;
                out.push(decode(&codec::audit_key(seq.max(0) as u64), &v)?);
            }
            Ok(out)
        })
        .await
    }

    /// One `BEGIN IMMEDIATE` transaction of flow writes. With a fence, the
    /// lease row is checked inside it: the write lock serializes it against
    /// `campaign`, so no other candidate can win between check and commit.
    async fn write_flows(&self, ops: Vec<FlowOp>, fence: Option<LeaderInfo>) -> Result<()> {
        // Flows are not watched: no change-log rows and no poller wake-up.
        self.run("apply_flows", move |conn| {
            let op = "apply_flows";
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(StoreError::sqlite(op))?;
            if let Some(f) = &fence {
                let holder = read_leader(&tx, &f.election, unix_ms_now() as i64).map_err(StoreError::sqlite(op))?;
                if !holder.as_ref().is_some_and(|h| h.lease_id == f.lease_id && h.candidate == f.candidate) {
                    return Err(fenced_out(f, holder.as_ref()));
                }
            }
            {
                let mut put = tx
                    .prepare_cached(
                        "INSERT INTO flows (client_ip, client_port, service_ip, service_port, server) VALUES (?1, ?2, ?3, ?4, ?5)
                         ON CONFLICT (client_ip, client_port, service_ip, service_port) DO UPDATE SET server = excluded.server",
                    )
                    .map_err(StoreError::sqlite(op))?;
                let mut del = tx
                    .prepare_cached("DELETE FROM flows WHERE client_ip = ?1 AND client_port = ?2 AND service_ip = ?3 AND service_port = ?4")
                    .map_err(StoreError::sqlite(op))?;
                for o in &ops {
                    match o {
                        FlowOp::Put { key, server } => {
                            let [a, b, c, d] = flow_params(key);
                            put.execute(params![a, b, c, d, i64::from(server.0)]).map_err(StoreError::sqlite(op))?;
                        }
                        FlowOp::Delete { key } => {
                            del.execute(flow_params(key)).map_err(StoreError::sqlite(op))?;
                        }
                    }
                }
            }
            tx.commit().map_err(StoreError::sqlite(op))
        })
        .await
    }

    /// Runs `f` in an IMMEDIATE transaction and wakes the local watch poller.
    async fn write<T, F>(&self, op: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>) -> Result<T> + Send + 'static,
    {
        let out = self
            .run(op, move |conn| {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(StoreError::sqlite(op))?;
                let out = f(&tx)?;
                tx.commit().map_err(StoreError::sqlite(op))?;
                Ok(out)
            })
            .await?;
        self.inner.written.notify_one();
        Ok(out)
    }

    async fn put_record(
        &self,
        op: &'static str,
        table: &'static str,
        id_col: &'static str,
        id: rusqlite::types::Value,
        key: String,
        value: Vec<u8>,
    ) -> Result<()> {
        self.write(op, move |tx| {
            tx.prepare_cached(&format!(
                "INSERT OR REPLACE INTO {table} ({id_col}, value) VALUES (?1, ?2)"
            ))
            .and_then(|mut s| s.execute(params![id, value]))
            .map_err(StoreError::sqlite(op))?;
            log_change(tx, table, &key, Some(&value)).map_err(StoreError::sqlite(op))
        })
        .await
    }

    async fn delete_record(
        &self,
        op: &'static str,
        table: &'static str,
        id_col: &'static str,
        id: rusqlite::types::Value,
        key: String,
    ) -> Result<bool> {
        self.write(op, move |tx| {
            let n = tx
                .prepare_cached(&format!("DELETE FROM {table} WHERE {id_col} = ?1"))
                .and_then(|mut s| s.execute(params![id]))
                .map_err(StoreError::sqlite(op))?;
            if n > 0 {
                log_change(tx, table, &key, None).map_err(StoreError::sqlite(op))?;
            }
            Ok(n > 0)
        })
        .await
    }

    async fn get_record<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        op: &'static str,
        table: &'static str,
        id_col: &'static str,
        id: rusqlite::types::Value,
        key: String,
    ) -> Result<Option<T>> {
        self.run(op, move |conn| {
            let v: Option<Vec<u8>> = conn
                .prepare_cached(&format!("SELECT value FROM {table} WHERE {id_col} = ?1"))
                .and_then(|mut s| s.query_row(params![id], |r| r.get(0)).optional())
                .map_err(StoreError::sqlite(op))?;
            v.map(|v| decode(&key, &v)).transpose()
        })
        .await
    }

    async fn list_records<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        op: &'static str,
        table: &'static str,
        id_col: &'static str,
        key_of: fn(&rusqlite::types::Value) -> String,
    ) -> Result<Vec<T>> {
        self.run(op, move |conn| {
            let mut st = conn
                .prepare_cached(&format!(
                    "SELECT {id_col}, value FROM {table} ORDER BY {id_col}"
                ))
                .map_err(StoreError::sqlite(op))?;
            let rows = st
                .query_map([], |r| {
                    Ok((
                        r.get::<_, rusqlite::types::Value>(0)?,
                        r.get::<_, Vec<u8>>(1)?,
                    ))
                })
                .map_err(StoreError::sqlite(op))?;
            let mut out = Vec::new();
            for row in rows {
                let (id, value) = row.map_err(StoreError::sqlite(op))?;
                out.push(decode(&key_of(&id), &value)?);
            }
            Ok(out)
        })
        .await
    }

    /// Read-modify-write of one server under the write lock.
    async fn modify_server(
        &self,
        op: &'static str,
        id: ServerId,
        f: impl FnOnce(&mut Server) + Send + 'static,
    ) -> Result<Server> {
        self.write(op, move |tx| {
            let key = codec::server_key(id);
            let v: Option<Vec<u8>> = tx
                .prepare_cached("SELECT value FROM servers WHERE id = ?1")
                .and_then(|mut s| s.query_row([i64::from(id.0)], |r| r.get(0)).optional())
                .map_err(StoreError::sqlite(op))?;
            let mut server: Server = match v {
                Some(v) => decode(&key, &v)?,
                None => {
                    return Err(StoreError::NotFound {
                        kind: "server",
                        id: id.to_string(),
                    })
                }
            };
            f(&mut server);
            server.updated_unix_ms = unix_ms_now();
            let value = encode(&server);
            tx.prepare_cached("UPDATE servers SET value = ?2 WHERE id = ?1")
                .and_then(|mut s| s.execute(params![i64::from(id.0), value]))
                .map_err(StoreError::sqlite(op))?;
            log_change(tx, "servers", &key, Some(&value)).map_err(StoreError::sqlite(op))?;
            Ok(server)
        })
        .await
    }

    async fn subscribe(&self) -> broadcast::Receiver<HubMsg> {
        if let Some(tx) = self
            .inner
            .hub
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return tx.subscribe();
        }
        // Take the starting state before `watch` returns, so a leader change
        // right after the call is reported as a change, not as the baseline.
        let (tx, rx) = broadcast::channel(4096);
        let mut last_seq = None;
        let mut leaders = HashMap::new();
        poll_once(&self.inner, &tx, &mut last_seq, &mut leaders, true).await;
        let mut hub = self.inner.hub.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = hub.as_ref() {
            return existing.subscribe();
        }
        *hub = Some(tx.clone());
        drop(hub);
        tokio::spawn(poller(Arc::downgrade(&self.inner), tx, last_seq, leaders));
        rx
    }

    /// Overwrites the stored bytes of a record, bypassing encoding. For tests
    /// of malformed values only.
    #[doc(hidden)]
    pub async fn inject_raw_server(&self, id: i64, bytes: Vec<u8>) -> Result<()> {
        self.run("inject", move |c| {
            c.execute(
                "INSERT OR REPLACE INTO servers (id, value) VALUES (?1, ?2)",
                params![id, bytes],
            )
            .map_err(StoreError::sqlite("inject"))
            .map(|_| ())
        })
        .await
    }

    /// Writes a raw flow row, bypassing type checks. For tests only.
    #[doc(hidden)]
    pub async fn inject_raw_flow(&self, cols: [i64; 5]) -> Result<()> {
        self.run("inject", move |c| {
            c.execute(
                "INSERT OR REPLACE INTO flows VALUES (?1, ?2, ?3, ?4, ?5)",
                cols,
            )
            .map_err(StoreError::sqlite("inject"))
            .map(|_| ())
        })
        .await
    }
}

/// Reads the change log and lease rows, broadcasts typed events. Exits when
/// the store is dropped or nobody watches any more.
async fn poller(
    store: Weak<Inner>,
    tx: broadcast::Sender<HubMsg>,
    mut last_seq: Option<i64>,
    mut leaders: HashMap<String, Option<LeaderInfo>>,
) {
    loop {
        let Some(inner) = store.upgrade() else { return };
        {
            let mut hub = inner.hub.lock().unwrap_or_else(|p| p.into_inner());
            if tx.receiver_count() == 0 {
                *hub = None;
                return;
            }
        }
        let interval = Duration::from_millis(inner.config.watch_poll_interval_ms.max(1));
        tokio::select! {
            _ = inner.written.notified() => {}
            _ = tokio::time::sleep(interval) => {}
        }
        poll_once(&inner, &tx, &mut last_seq, &mut leaders, false).await;
    }
}

struct PollResult {
    changes: Vec<(i64, String, String, Option<Vec<u8>>)>,
    max_seq: i64,
    min_seq: i64,
    leaders: Vec<(String, String, i64, i64, i64)>,
}

async fn poll_once(
    inner: &Arc<Inner>,
    tx: &broadcast::Sender<HubMsg>,
    last_seq: &mut Option<i64>,
    leaders: &mut HashMap<String, Option<LeaderInfo>>,
    initial: bool,
) {
    let from = *last_seq;
    let inner2 = inner.clone();
    let res = tokio::task::spawn_blocking(move || -> rusqlite::Result<PollResult> {
        let conn = inner2.conn.lock().unwrap_or_else(|p| p.into_inner());
        let (min_seq, max_seq): (i64, i64) = conn.query_row(
            "SELECT IFNULL(MIN(seq), 0), IFNULL(MAX(seq), 0) FROM changes",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let mut changes = Vec::new();
        if let Some(from) = from {
            let mut st = conn.prepare_cached(
                "SELECT seq, kind, key, value FROM changes WHERE seq > ?1 ORDER BY seq LIMIT 4096",
            )?;
            let rows =
                st.query_map([from], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
            for r in rows {
                changes.push(r?);
            }
        }
        let mut st = conn.prepare_cached(
            "SELECT election, candidate, lease_id, term, expires_unix_ms FROM leader",
        )?;
        let leaders = st
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(PollResult {
            changes,
            max_seq,
            min_seq,
            leaders,
        })
    })
    .await;
    let res = match res {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::warn!(path = %inner.path, error = %e, "watch poll of the change log failed; retrying");
            return;
        }
        Err(_) => return,
    };
    match *last_seq {
        None => *last_seq = Some(res.max_seq),
        Some(from) => {
            if res.min_seq > from + 1 && res.max_seq > from {
                // Rows after `from` were pruned before we read them.
                let _ = tx.send(HubMsg::Lagged((res.min_seq - from - 1) as u64));
            }
            for (seq, kind, key, value) in res.changes {
                *last_seq = Some(seq);
                match decode_change(&kind, &key, value.as_deref()) {
                    Ok(change) => {
                        let _ = tx.send(HubMsg::Event {
                            filterable: true,
                            event: WatchEvent {
                                revision: seq as u64,
                                change,
                            },
                        });
                    }
                    Err(e) => {
                        tracing::warn!(path = %inner.path, seq, error = %e, "skipping undecodable change-log row")
                    }
                }
            }
        }
    }
    let now = unix_ms_now() as i64;
    let rev = last_seq.unwrap_or(0).max(0) as u64;
    for (election, candidate, lease_id, term, expires) in res.leaders {
        let live = (expires > now).then(|| LeaderInfo {
            election: election.clone(),
            candidate,
            lease_id,
            term: term.max(0) as u64,
        });
        let prev = leaders.insert(election.clone(), live.clone());
        if !initial && prev.as_ref() != Some(&live) && !(prev.is_none() && live.is_none()) {
            let _ = tx.send(HubMsg::Event {
                filterable: false,
                event: WatchEvent {
                    revision: rev,
                    change: Change::LeaderChanged {
                        election,
                        leader: live,
                    },
                },
            });
        }
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn put_server(&self, server: &Server) -> Result<()> {
        let key = codec::server_key(server.id);
        self.put_record(
            "put_server",
            "servers",
            "id",
            i64::from(server.id.0).into(),
            key,
            encode(server),
        )
        .await
    }

    async fn put_registered_server(&self, server: &Server) -> Result<Server> {
        let server = server.clone();
        let op = "put_registered_server";
        self.write(op, move |tx| {
            let id = server.id;
            let key = codec::server_key(id);
            let v: Option<Vec<u8>> = tx
                .prepare_cached("SELECT value FROM servers WHERE id = ?1")
                .and_then(|mut s| s.query_row([i64::from(id.0)], |r| r.get(0)).optional())
                .map_err(StoreError::sqlite(op))?;
            // A stored record that does not decode is replaced: the
            // server's REGISTER must be able to write its record.
            let old = match v.map(|v| decode::<Server>(&key, &v)).transpose() {
                Ok(old) => old,
                Err(e) => {
                    tracing::warn!(error = %e, "replacing an undecodable server record");
                    None
                }
            };
            let rec = merge_registered_server(server, old.as_ref());
            let value = encode(&rec);
            tx.prepare_cached("INSERT OR REPLACE INTO servers (id, value) VALUES (?1, ?2)")
                .and_then(|mut s| s.execute(params![i64::from(id.0), value]))
                .map_err(StoreError::sqlite(op))?;
            log_change(tx, "servers", &key, Some(&value)).map_err(StoreError::sqlite(op))?;
            Ok(rec)
        })
        .await
    }

    async fn get_server(&self, id: ServerId) -> Result<Option<Server>> {
        self.get_record(
            "get_server",
            "servers",
            "id",
            i64::from(id.0).into(),
            codec::server_key(id),
        )
        .await
    }

    async fn list_servers(&self) -> Result<Vec<Server>> {
        self.list_records("list_servers", "servers", "id", |v| match v {
            rusqlite::types::Value::Integer(i) => format!("servers/{i}"),
            other => format!("servers/{other:?}"),
        })
        .await
    }

    async fn set_server_state(&self, id: ServerId, state: ServerState) -> Result<Server> {
        self.modify_server("set_server_state", id, move |s| s.state = state)
            .await
    }

    async fn set_server_weight(&self, id: ServerId, weight: u32) -> Result<Server> {
        self.modify_server("set_server_weight", id, move |s| {
            with_operator_weight(s, weight)
        })
        .await
    }

    async fn clear_server_weight(&self, id: ServerId) -> Result<Server> {
        self.modify_server("clear_server_weight", id, without_operator_weight)
            .await
    }

    async fn delete_server(&self, id: ServerId) -> Result<bool> {
        let deleted = self
            .delete_record(
                "delete_server",
                "servers",
                "id",
                i64::from(id.0).into(),
                codec::server_key(id),
            )
            .await?;
        self.run("delete_server", move |conn| {
            conn.execute(
                "DELETE FROM seq_floors WHERE server = ?1",
                [i64::from(id.0)],
            )
            .map_err(StoreError::sqlite("delete_server"))
        })
        .await?;
        Ok(deleted)
    }

    async fn put_service(&self, service: &Service) -> Result<()> {
        check_name("service name", &service.name)?;
        let service = service.clone();
        let op = "put_service";
        self.write(op, move |tx| {
            let key = codec::service_key(&service.name);
            let v: Option<Vec<u8>> = tx
                .prepare_cached("SELECT value FROM services WHERE name = ?1")
                .and_then(|mut s| s.query_row([&service.name], |r| r.get(0)).optional())
                .map_err(StoreError::sqlite(op))?;
            // Moved to another VIP:port: the old address retires. A stored
            // record that does not decode is replaced without a record
            // (nothing could have served it).
            if let Some(old) = v.and_then(|v| decode::<Service>(&key, &v).ok()) {
                if (old.vip, old.port) != (service.vip, service.port) {
                    let record = RetiringService {
                        service: old,
                        deleted_unix_ms: unix_ms_now(),
                    };
                    write_retiring(tx, op, &record)?;
                }
            }
            let value = encode(&service);
            tx.prepare_cached("INSERT OR REPLACE INTO services (name, value) VALUES (?1, ?2)")
                .and_then(|mut s| s.execute(params![service.name, value]))
                .map_err(StoreError::sqlite(op))?;
            log_change(tx, "services", &key, Some(&value)).map_err(StoreError::sqlite(op))
        })
        .await
    }

    async fn get_service(&self, name: &str) -> Result<Option<Service>> {
        check_name("service name", name)?;
        self.get_record(
            "get_service",
            "services",
            "name",
            name.to_string().into(),
            codec::service_key(name),
        )
        .await
    }

    async fn list_services(&self) -> Result<Vec<Service>> {
        self.list_records("list_services", "services", "name", |v| match v {
            rusqlite::types::Value::Text(t) => format!("services/{t}"),
            other => format!("services/{other:?}"),
        })
        .await
    }

    async fn delete_service(&self, name: &str) -> Result<bool> {
        check_name("service name", name)?;
        let name = name.to_string();
        let op = "delete_service";
        self.write(op, move |tx| {
            let key = codec::service_key(&name);
            let v: Option<Vec<u8>> = tx
                .prepare_cached("SELECT value FROM services WHERE name = ?1")
                .and_then(|mut s| s.query_row([&name], |r| r.get(0)).optional())
                .map_err(StoreError::sqlite(op))?;
            let Some(v) = v else {
                return Ok(false);
            };
            tx.prepare_cached("DELETE FROM services WHERE name = ?1")
                .and_then(|mut s| s.execute([&name]))
                .map_err(StoreError::sqlite(op))?;
            // A record that does not decode still goes (an operator must be
            // able to delete it), with no retiring record: nothing could
            // have served it.
            match decode::<Service>(&key, &v) {
                Ok(service) => {
                    let record = RetiringService {
                        service,
                        deleted_unix_ms: unix_ms_now(),
                    };
                    write_retiring(tx, op, &record)?;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "deleted an undecodable service record: no retiring record")
                }
            }
            log_change(tx, "services", &key, None).map_err(StoreError::sqlite(op))?;
            Ok(true)
        })
        .await
    }

    async fn list_retiring_services(&self) -> Result<Vec<RetiringService>> {
        self.run("list_retiring_services", |conn| {
            let op = "list_retiring_services";
            let mut out = Vec::new();
            let mut q = conn
                .prepare_cached(
                    "SELECT name, vip, port, value FROM retiring_addresses ORDER BY name, vip, port",
                )
                .map_err(StoreError::sqlite(op))?;
            let rows = q
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, i64>(2)?,
                        r.get::<_, Vec<u8>>(3)?,
                    ))
                })
                .map_err(StoreError::sqlite(op))?;
            for row in rows {
                let (name, vip, port, value) = row.map_err(StoreError::sqlite(op))?;
                let raw = || format!("retiring/{name}/{vip}:{port}");
                let addr = std::net::SocketAddrV4::new(
                    ip_from_i64(raw, vip)?,
                    port_from_i64(raw, port)?,
                );
                out.push(codec::decode_retiring(
                    &codec::retiring_addr_key(&name, addr),
                    &name,
                    Some(addr),
                    &value,
                )?);
            }
            // Records of the build before per-address records.
            let mut q = conn
                .prepare_cached("SELECT name, value FROM retiring_services ORDER BY name")
                .map_err(StoreError::sqlite(op))?;
            let rows = q
                .query_map([], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))
                })
                .map_err(StoreError::sqlite(op))?;
            for row in rows {
                let (name, value) = row.map_err(StoreError::sqlite(op))?;
                out.push(codec::decode_retiring(
                    &codec::retiring_key(&name),
                    &name,
                    None,
                    &value,
                )?);
            }
            out.sort_by(|a, b| {
                (&a.service.name, a.service.vip, a.service.port).cmp(&(
                    &b.service.name,
                    b.service.vip,
                    b.service.port,
                ))
            });
            Ok(out)
        })
        .await
    }

    async fn forget_retiring_service(
        &self,
        name: &str,
        addr: std::net::SocketAddrV4,
        deleted_unix_ms: u64,
    ) -> Result<bool> {
        check_name("service name", name)?;
        let Ok(deleted_at) = i64::try_from(deleted_unix_ms) else {
            // Never stored (the writes refuse such a time).
            return Ok(false);
        };
        let name = name.to_string();
        // Not watched: no change-log rows and no poller wake-up.
        self.run("forget_retiring_service", move |conn| {
            let op = "forget_retiring_service";
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(StoreError::sqlite(op))?;
            let mut n = tx
                .prepare_cached(
                    "DELETE FROM retiring_addresses
                     WHERE name = ?1 AND vip = ?2 AND port = ?3 AND deleted_unix_ms = ?4",
                )
                .and_then(|mut s| {
                    s.execute(params![
                        name,
                        i64::from(u32::from(*addr.ip())),
                        i64::from(addr.port()),
                        deleted_at
                    ])
                })
                .map_err(StoreError::sqlite(op))?;
            // A record of the one-per-name table: that exact one (name,
            // time and, read from the value, address).
            let legacy: Option<Vec<u8>> = tx
                .prepare_cached(
                    "SELECT value FROM retiring_services WHERE name = ?1 AND deleted_unix_ms = ?2",
                )
                .and_then(|mut s| {
                    s.query_row(params![name, deleted_at], |r| r.get(0))
                        .optional()
                })
                .map_err(StoreError::sqlite(op))?;
            let exact = legacy
                .and_then(|v| {
                    codec::decode_retiring(&codec::retiring_key(&name), &name, None, &v).ok()
                })
                .is_some_and(|r| r.addr() == addr);
            if exact {
                n += tx
                    .prepare_cached("DELETE FROM retiring_services WHERE name = ?1")
                    .and_then(|mut s| s.execute([&name]))
                    .map_err(StoreError::sqlite(op))?;
            }
            tx.commit().map_err(StoreError::sqlite(op))?;
            Ok(n > 0)
        })
        .await
    }

    async fn get_policy(&self) -> Result<Policy> {
        Ok(self
            .get_record(
                "get_policy",
                "policy",
                "id",
                1i64.into(),
                codec::POLICY_KEY.to_string(),
            )
            .await?
            .unwrap_or_default())
    }

    async fn put_policy(&self, policy: &Policy) -> Result<()> {
        policy.validate()?;
        self.put_record(
            "put_policy",
            "policy",
            "id",
            1i64.into(),
            codec::POLICY_KEY.to_string(),
            encode(policy),
        )
        .await
    }

    async fn put_policy_if_absent(&self, policy: &Policy) -> Result<bool> {
        const OP: &str = "put_policy_if_absent";
        policy.validate()?;
        let value = encode(policy);
        self.write(OP, move |tx| {
            let n = tx
                .prepare_cached("INSERT OR IGNORE INTO policy (id, value) VALUES (1, ?1)")
                .and_then(|mut s| s.execute(params![value]))
                .map_err(StoreError::sqlite(OP))?;
            if n > 0 {
                log_change(tx, "policy", codec::POLICY_KEY, Some(&value))
                    .map_err(StoreError::sqlite(OP))?;
            }
            Ok(n > 0)
        })
        .await
    }

    async fn apply_flows(&self, ops: &[FlowOp]) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        self.write_flows(ops.to_vec(), None).await
    }

    async fn apply_flows_fenced(&self, ops: &[FlowOp], fence: &LeaderInfo) -> Result<()> {
        self.write_flows(ops.to_vec(), Some(fence.clone())).await
    }

    async fn get_flow(&self, key: &FlowKey) -> Result<Option<ServerId>> {
        let key = *key;
        self.run("get_flow", move |conn| {
            let v: Option<i64> = conn
                .prepare_cached("SELECT server FROM flows WHERE client_ip = ?1 AND client_port = ?2 AND service_ip = ?3 AND service_port = ?4")
                .and_then(|mut s| s.query_row(flow_params(&key), |r| r.get(0)).optional())
                .map_err(StoreError::sqlite("get_flow"))?;
            v.map(|v| server_from_i64(&codec::flow_key(&key), v)).transpose()
        })
        .await
    }

    async fn list_flows_by_server(&self, server: ServerId) -> Result<Vec<FlowKey>> {
        self.run("list_flows_by_server", move |conn| {
            let op = "list_flows_by_server";
            let mut st = conn
                .prepare_cached(
                    "SELECT client_ip, client_port, service_ip, service_port, server FROM flows WHERE server = ?1
                     ORDER BY client_ip, client_port, service_ip, service_port",
                )
                .map_err(StoreError::sqlite(op))?;
            let rows = st
                .query_map([i64::from(server.0)], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
                .map_err(StoreError::sqlite(op))?;
            rows.map(|r| r.map_err(StoreError::sqlite(op)).and_then(flow_from_row).map(|m| m.key)).collect()
        })
        .await
    }

    async fn scan_flows(&self) -> Result<Vec<FlowMapping>> {
        self.run("scan_flows", move |conn| {
            let op = "scan_flows";
            let mut st = conn
                .prepare_cached(
                    "SELECT client_ip, client_port, service_ip, service_port, server FROM flows
                     ORDER BY client_ip, client_port, service_ip, service_port",
                )
                .map_err(StoreError::sqlite(op))?;
            let rows = st
                .query_map([], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                })
                .map_err(StoreError::sqlite(op))?;
            rows.map(|r| r.map_err(StoreError::sqlite(op)).and_then(flow_from_row))
                .collect()
        })
        .await
    }

    async fn count_flows(&self) -> Result<u64> {
        self.run("count_flows", |conn| {
            conn.query_row("SELECT COUNT(*) FROM flows", [], |r| r.get::<_, i64>(0))
                .map(|n| n.max(0) as u64)
                .map_err(StoreError::sqlite("count_flows"))
        })
        .await
    }

    async fn raise_seq_floors(&self, floors: &[SeqFloor]) -> Result<()> {
        let rows = floors
            .iter()
            .map(|f| {
                Ok((
                    i64::from(f.server.0),
                    // An instance id is any non-zero u64 (hostagents draw
                    // it at random): kept as its bit pattern.
                    f.instance as i64,
                    seq_column("seq", f.seq)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        // Not watched: no change-log rows and no poller wake-up.
        self.run("raise_seq_floors", move |conn| {
            let op = "raise_seq_floors";
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(StoreError::sqlite(op))?;
            {
                let mut up = tx
                    .prepare_cached(
                        "INSERT INTO seq_floors (server, instance, seq) VALUES (?1, ?2, ?3)
                         ON CONFLICT (server) DO UPDATE SET
                           seq = CASE WHEN instance = excluded.instance THEN max(seq, excluded.seq) ELSE excluded.seq END,
                           instance = excluded.instance",
                    )
                    .map_err(StoreError::sqlite(op))?;
                for r in &rows {
                    up.execute(params![r.0, r.1, r.2]).map_err(StoreError::sqlite(op))?;
                }
            }
            tx.commit().map_err(StoreError::sqlite(op))
        })
        .await
    }

    async fn seq_floors(&self) -> Result<Vec<SeqFloor>> {
        self.run("seq_floors", |conn| {
            let op = "seq_floors";
            let mut q = conn
                .prepare_cached("SELECT server, instance, seq FROM seq_floors ORDER BY server")
                .map_err(StoreError::sqlite(op))?;
            let rows = q
                .query_map([], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, i64>(2)?,
                    ))
                })
                .map_err(StoreError::sqlite(op))?;
            let mut out = Vec::new();
            for row in rows {
                let (server, instance, seq) = row.map_err(StoreError::sqlite(op))?;
                let key = format!("seq_floors/{server}");
                let bad = |what: &str, v: i64| StoreError::MalformedValue {
                    key: key.clone(),
                    reason: format!("{what} {v} out of range"),
                };
                out.push(SeqFloor {
                    server: ServerId(u32::try_from(server).map_err(|_| bad("server id", server))?),
                    instance: instance as u64,
                    seq: u64::try_from(seq).map_err(|_| bad("seq", seq))?,
                });
            }
            Ok(out)
        })
        .await
    }

    async fn mark_seeded(&self, names: &[String]) -> Result<()> {
        for n in names {
            check_name("service name", n)?;
        }
        if names.is_empty() {
            return Ok(());
        }
        let names = names.to_vec();
        // Not watched: no change-log rows and no poller wake-up.
        self.run("mark_seeded", move |conn| {
            let op = "mark_seeded";
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(StoreError::sqlite(op))?;
            {
                let mut ins = tx
                    .prepare_cached("INSERT OR IGNORE INTO seeded_services (name) VALUES (?1)")
                    .map_err(StoreError::sqlite(op))?;
                for n in &names {
                    ins.execute(params![n]).map_err(StoreError::sqlite(op))?;
                }
            }
            tx.commit().map_err(StoreError::sqlite(op))
        })
        .await
    }

    async fn seeded_services(&self) -> Result<Vec<String>> {
        self.run("seeded_services", |conn| {
            let op = "seeded_services";
            let mut q = conn
                .prepare_cached("SELECT name FROM seeded_services ORDER BY name")
                .map_err(StoreError::sqlite(op))?;
            let rows = q
                .query_map([], |r| r.get::<_, String>(0))
                .map_err(StoreError::sqlite(op))?;
            let mut out = Vec::new();
            for row in rows {
                let name = row.map_err(StoreError::sqlite(op))?;
                check_name("service name", &name).map_err(|e| StoreError::MalformedKey {
                    key: codec::seeded_key(&name),
                    reason: e.to_string(),
                })?;
                out.push(name);
            }
            Ok(out)
        })
        .await
    }

    async fn put_drain(&self, drain: &Drain) -> Result<()> {
        let key = codec::drain_key(drain.server);
        self.put_record(
            "put_drain",
            "drains",
            "server",
            i64::from(drain.server.0).into(),
            key,
            encode(drain),
        )
        .await
    }

    async fn get_drain(&self, server: ServerId) -> Result<Option<Drain>> {
        self.get_record(
            "get_drain",
            "drains",
            "server",
            i64::from(server.0).into(),
            codec::drain_key(server),
        )
        .await
    }

    async fn list_drains(&self) -> Result<Vec<Drain>> {
        self.list_records("list_drains", "drains", "server", |v| match v {
            rusqlite::types::Value::Integer(i) => format!("drains/{i}"),
            other => format!("drains/{other:?}"),
        })
        .await
    }

    async fn update_drain(
        &self,
        server: ServerId,
        progress: DrainProgress,
        state: DrainState,
    ) -> Result<Drain> {
        let op = "update_drain";
        self.write(op, move |tx| {
            let key = codec::drain_key(server);
            let v: Option<Vec<u8>> = tx
                .prepare_cached("SELECT value FROM drains WHERE server = ?1")
                .and_then(|mut s| s.query_row([i64::from(server.0)], |r| r.get(0)).optional())
                .map_err(StoreError::sqlite(op))?;
            let mut drain: Drain = match v {
                Some(v) => decode(&key, &v)?,
                None => {
                    return Err(StoreError::NotFound {
                        kind: "drain",
                        id: server.to_string(),
                    })
                }
            };
            drain.progress = progress;
            drain.state = state;
            let value = encode(&drain);
            tx.prepare_cached("UPDATE drains SET value = ?2 WHERE server = ?1")
                .and_then(|mut s| s.execute(params![i64::from(server.0), value]))
                .map_err(StoreError::sqlite(op))?;
            log_change(tx, "drains", &key, Some(&value)).map_err(StoreError::sqlite(op))?;
            Ok(drain)
        })
        .await
    }

    async fn delete_drain(&self, server: ServerId) -> Result<bool> {
        self.delete_record(
            "delete_drain",
            "drains",
            "server",
            i64::from(server.0).into(),
            codec::drain_key(server),
        )
        .await
    }

    async fn append_audit(&self, record: &AuditRecord) -> Result<AuditEntry> {
        let record = record.clone();
        let op = "append_audit";
        self.write(op, move |tx| {
            // Reserve the sequence number first, then store the entry that names it.
            tx.prepare_cached("INSERT INTO audit (value) VALUES (x'')")
                .and_then(|mut s| s.execute([]))
                .map_err(StoreError::sqlite(op))?;
            let seq = tx.last_insert_rowid();
            let entry = AuditEntry {
                seq: seq as u64,
                at_unix_ms: unix_ms_now(),
                record,
            };
            let value = encode(&entry);
            tx.prepare_cached("UPDATE audit SET value = ?2 WHERE seq = ?1")
                .and_then(|mut s| s.execute(params![seq, value]))
                .map_err(StoreError::sqlite(op))?;
            log_change(tx, "audit", &codec::audit_key(entry.seq), Some(&value))
                .map_err(StoreError::sqlite(op))?;
            Ok(entry)
        })
        .await
    }

    async fn list_audit(&self, after: u64, limit: usize) -> Result<Vec<AuditEntry>> {
        self.audit_page("list_audit", after, limit, false).await
    }

    async fn list_audit_newest(&self, after: u64, limit: usize) -> Result<Vec<AuditEntry>> {
        self.audit_page("list_audit_newest", after, limit, true)
            .await
    }

    async fn campaign(
        &self,
        election: &str,
        candidate: &str,
        ttl: Duration,
    ) -> Result<Option<LeaderLease>> {
        check_name("election name", election)?;
        if candidate.is_empty() || candidate.len() > 256 {
            return Err(StoreError::Invalid {
                what: "candidate",
                reason: "must be 1-256 bytes".into(),
            });
        }
        let (election, candidate) = (election.to_string(), candidate.to_string());
        let ttl_s = lease_ttl_secs(ttl);
        let op = "campaign";
        self.write(op, move |tx| {
            let now = unix_ms_now() as i64;
            let row: Option<(i64, i64)> = tx
                .prepare_cached("SELECT term, expires_unix_ms FROM leader WHERE election = ?1")
                .and_then(|mut s| s.query_row([&election], |r| Ok((r.get(0)?, r.get(1)?))).optional())
                .map_err(StoreError::sqlite(op))?;
            if matches!(row, Some((_, expires)) if expires > now) {
                return Ok(None);
            }
            let term = row.map(|(t, _)| t).unwrap_or(0) + 1;
            // The term is unique per election, so it doubles as the lease id.
            tx.prepare_cached(
                "INSERT OR REPLACE INTO leader (election, candidate, lease_id, term, expires_unix_ms) VALUES (?1, ?2, ?3, ?3, ?4)",
            )
            .and_then(|mut s| s.execute(params![election, candidate, term, now + ttl_s * 1000]))
            .map_err(StoreError::sqlite(op))?;
            Ok(Some(LeaderLease {
                info: LeaderInfo { election, candidate, term: term as u64, lease_id: term },
                ttl: Duration::from_secs(ttl_s as u64),
            }))
        })
        .await
    }

    async fn keep_alive(&self, lease: &LeaderLease) -> Result<()> {
        let lease = lease.clone();
        let op = "keep_alive";
        self.write(op, move |tx| {
            let now = unix_ms_now() as i64;
            let n = tx
                .prepare_cached(
                    "UPDATE leader SET expires_unix_ms = ?3 WHERE election = ?1 AND lease_id = ?2 AND candidate = ?4 AND expires_unix_ms > ?5",
                )
                .and_then(|mut s| {
                    s.execute(params![
                        lease.info.election,
                        lease.info.lease_id,
                        now + lease.ttl.as_millis() as i64,
                        lease.info.candidate,
                        now
                    ])
                })
                .map_err(StoreError::sqlite(op))?;
            if n == 0 {
                return Err(StoreError::NotLeader {
                    election: lease.info.election.clone(),
                    reason: format!("lease {} of {} expired or was taken over", lease.info.lease_id, lease.info.candidate),
                });
            }
            Ok(())
        })
        .await
    }

    async fn resign(&self, lease: &LeaderLease) -> Result<()> {
        let lease = lease.clone();
        self.write("resign", move |tx| {
            tx.prepare_cached(
                "UPDATE leader SET expires_unix_ms = 0 WHERE election = ?1 AND lease_id = ?2",
            )
            .and_then(|mut s| s.execute(params![lease.info.election, lease.info.lease_id]))
            .map_err(StoreError::sqlite("resign"))
            .map(|_| ())
        })
        .await
    }

    async fn leader(&self, election: &str) -> Result<Option<LeaderInfo>> {
        check_name("election name", election)?;
        let election = election.to_string();
        self.run("leader", move |conn| {
            read_leader(conn, &election, unix_ms_now() as i64).map_err(StoreError::sqlite("leader"))
        })
        .await
    }

    async fn watch(&self, kinds: &[WatchKind]) -> Result<WatchStream> {
        let mut rx = self.subscribe().await;
        // Everything after this position is delivered; earlier rows are
        // filtered out even if the poller broadcasts them late.
        let start: i64 = self
            .run("watch", |conn| {
                conn.query_row("SELECT IFNULL(MAX(seq), 0) FROM changes", [], |r| r.get(0))
                    .map_err(StoreError::sqlite("watch"))
            })
            .await?;
        let kinds: Vec<WatchKind> = kinds.to_vec();
        let (out_tx, out_rx) = tokio::sync::mpsc::channel::<Result<WatchEvent>>(1024);
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    m = rx.recv() => m,
                    _ = out_tx.closed() => return,
                };
                let item = match msg {
                    Ok(HubMsg::Event { filterable, event }) => {
                        if filterable && event.revision as i64 <= start {
                            continue;
                        }
                        if !kinds.contains(&event.change.kind()) {
                            continue;
                        }
                        Ok(event)
                    }
                    Ok(HubMsg::Lagged(n)) => Err(StoreError::WatchLagged { missed: n }),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        Err(StoreError::WatchLagged { missed: n })
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let end = item.is_err();
                if out_tx.send(item).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(crate::receiver_stream(out_rx))
    }
}
