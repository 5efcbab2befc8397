//! etcd v3 backend, for clusters and switchd HA.
//!
//! Key layout under `prefix` (default `/capybara/v1`); values are versioned
//! JSON (see `codec`):
//!
//! ```text
//! {prefix}/records/servers/{id}           Server
//! {prefix}/records/services/{name}        Service
//! {prefix}/records/policy                 Policy
//! {prefix}/records/drains/{server id}     Drain
//! {prefix}/records/audit/{seq:020}        AuditEntry
//! {prefix}/records/leader/{election}      {candidate, lease_id}, attached to the lease;
//!                                         term = the key's create_revision
//! {prefix}/counters/audit                 last audit seq (u64)
//! {prefix}/seq_floors/{server id}         {instance, seq}: control-channel
//!                                         seq floor (not watched)
//! {prefix}/seeded/{service name}          {}: switchd seeded this configured
//!                                         service once (not watched)
//! {prefix}/retiring/{name}/{vip}:{port}   RetiringService: an address of the
//!                                         service deleted or moved away, open
//!                                         connections still served; put in
//!                                         the delete's or move's transaction
//!                                         (not watched)
//! {prefix}/retiring/{service name}        RetiringService as written before
//!                                         records were per address: still
//!                                         listed and forgotten, not written
//! {prefix}/flows/{cip}:{cport}->{vip}:{vport}   {server}
//! ```
//!
//! Errors name keys without the prefix and `records/` (`servers/3`), the
//! same logical keys as the SQLite backend. Watches cover `records/` with
//! one etcd watcher (etcd orders events per watcher only), so flow writes
//! never reach watchers.
//!
//! Flow batches are deduplicated (last operation per flow wins) and written
//! in transactions of at most `max_txn_ops` operations (etcd's
//! `--max-txn-ops`, default 128). Read-modify-writes (state, weight, drain
//! progress, audit sequence) are compare-and-swap on `mod_revision`, retried
//! a bounded number of times. The client balances over every endpoint, so
//! losing a minority of members costs at most the requests in flight, which
//! callers (and `FlowWriter`) retry.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use capybara_proto::flow::{FlowKey, ServerId};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, WatchOptions,
};
use serde::{Deserialize, Serialize};

use crate::codec::{self, decode, encode, FlowValue};
use crate::error::{fenced_out, Result, StoreError};
use crate::model::*;
use crate::{lease_ttl_secs, Store, WatchStream};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EtcdConfig {
    /// Client URLs of the members, e.g. `http://10.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Root of every key; lets several appliances share one etcd cluster.
    pub prefix: String,
    pub connect_timeout_ms: u64,
    pub request_timeout_ms: u64,
    /// Operations per transaction; must not exceed the server's `--max-txn-ops`.
    pub max_txn_ops: usize,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            prefix: "/capybara/v1".into(),
            connect_timeout_ms: 2_000,
            request_timeout_ms: 5_000,
            max_txn_ops: 128,
        }
    }
}

impl EtcdConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(StoreError::Config(format!("etcd: {m}")));
        if self.endpoints.is_empty() {
            return bad("`endpoints` is empty".into());
        }
        for e in &self.endpoints {
            if !(e.starts_with("http://") || e.starts_with("https://")) || e.len() < 10 {
                return bad(format!(
                    "endpoint {e:?} must be a URL like http://host:2379"
                ));
            }
        }
        if !self.prefix.starts_with('/') || self.prefix.ends_with('/') || self.prefix.len() < 2 {
            return bad(format!(
                "`prefix` {:?} must start with '/' and not end with '/'",
                self.prefix
            ));
        }
        if self.max_txn_ops == 0 {
            return bad("`max_txn_ops` must be at least 1".into());
        }
        if self.request_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return bad("timeouts must be positive".into());
        }
        Ok(())
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaderValue {
    candidate: String,
    lease_id: i64,
}

#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    config: EtcdConfig,
    endpoints: String,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.config.prefix)
            .finish()
    }
}

/// CAS retries before giving up on a contended read-modify-write.
const CAS_ATTEMPTS: usize = 64;
/// Tries of a request that provably did not execute.
const RETRY_ATTEMPTS: usize = 6;

/// Whether an `Unreachable` reason says the request never ran on a member.
fn not_executed(reason: &str) -> bool {
    [
        "tcp connect error",
        "connection refused",
        "transport error",
        "no leader",
        "leader changed",
        "not capable",
    ]
    .iter()
    .any(|m| reason.contains(m))
}

/// An etcd client error for operators: a gRPC status as its code, its
/// message and what caused it (`Unavailable: tcp connect error: ...
/// Connection refused (os error 111)`), without the status's debug dump
/// (`details: [], metadata: MetadataMap { headers: {} }`) that its Display
/// carries into every `/readyz`, `ctl` and log line of a store outage.
pub(crate) fn describe(e: &etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            let mut out = format!("{:?}", s.code());
            if !s.message().is_empty() {
                out.push_str(": ");
                out.push_str(s.message());
            }
            let mut cause = std::error::Error::source(s);
            while let Some(c) = cause {
                let text = c.to_string();
                if !text.is_empty() && !out.contains(&text) {
                    out.push_str(": ");
                    out.push_str(&text);
                }
                cause = c.source();
            }
            out
        }
        other => other.to_string(),
    }
}

/// Page size of range scans.
const SCAN_PAGE: i64 = 10_000;

/// First key after every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // Our prefixes are ASCII and end in '/' or a letter, never 0xff.
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

impl EtcdStore {
    /// Connects and checks that a member answers; `Unreachable` otherwise.
    pub async fn connect(config: EtcdConfig) -> Result<Self> {
        config.validate()?;
        let endpoints = config.endpoints.join(", ");
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(config.connect_timeout_ms))
            .with_timeout(Duration::from_millis(config.request_timeout_ms))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let unreachable = |reason: String| StoreError::Unreachable {
            endpoints: endpoints.clone(),
            reason,
        };
        let total = Duration::from_millis(config.connect_timeout_ms + config.request_timeout_ms);
        let mut client =
            tokio::time::timeout(total, Client::connect(&config.endpoints, Some(opts)))
                .await
                .map_err(|_| unreachable(format!("no answer within {total:?}")))?
                .map_err(|e| unreachable(describe(&e)))?;
        tokio::time::timeout(total, client.status())
            .await
            .map_err(|_| {
                unreachable(format!(
                    "no member answered a status request within {total:?}"
                ))
            })?
            .map_err(|e| unreachable(describe(&e)))?;
        Ok(EtcdStore {
            client,
            config,
            endpoints,
        })
    }

    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// etcd key of a logical key. Watched records share `records/` so one
    /// watcher (one ordered event stream) covers them without seeing flows.
    fn full(&self, logical: &str) -> String {
        if logical.starts_with("flows/")
            || logical.starts_with("counters/")
            || logical.starts_with("seq_floors/")
            || logical.starts_with("seeded/")
            || logical.starts_with("retiring/")
        {
            format!("{}/{}", self.config.prefix, logical)
        } else {
            format!("{}/records/{}", self.config.prefix, logical)
        }
    }

    fn logical<'a>(&self, full: &'a [u8]) -> Result<&'a str> {
        let s = std::str::from_utf8(full).map_err(|_| StoreError::MalformedKey {
            key: String::from_utf8_lossy(full).into_owned(),
            reason: "key is not UTF-8".into(),
        })?;
        s.strip_prefix(self.config.prefix.as_str())
            .and_then(|r| r.strip_prefix('/'))
            .map(|r| r.strip_prefix("records/").unwrap_or(r))
            .ok_or_else(|| StoreError::MalformedKey {
                key: s.to_string(),
                reason: format!("outside prefix {}", self.config.prefix),
            })
    }

    fn err(&self, op: &'static str) -> impl Fn(etcd_client::Error) -> StoreError + '_ {
        move |e| match &e {
            etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => {
                StoreError::Unreachable {
                    endpoints: self.endpoints.clone(),
                    reason: format!("{op}: {}", describe(&e)),
                }
            }
            etcd_client::Error::GRpcStatus(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Cancelled
                ) =>
            {
                StoreError::Unreachable {
                    endpoints: self.endpoints.clone(),
                    reason: format!("{op}: {}", describe(&e)),
                }
            }
            _ => StoreError::Etcd {
                op,
                source: Box::new(e),
            },
        }
    }

    /// Runs an etcd request with the configured deadline.
    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        let after = Duration::from_millis(self.config.request_timeout_ms);
        match tokio::time::timeout(after, fut).await {
            Ok(r) => r.map_err(self.err(op)),
            Err(_) => Err(StoreError::Timeout { op, after }),
        }
    }

    /// Up to `limit` audit entries with `seq > after`, oldest first or
    /// (`newest`) newest first (keys are zero-padded: key order is seq
    /// order).
    async fn audit_page(
        &self,
        op: &'static str,
        after: u64,
        limit: usize,
        newest: bool,
    ) -> Result<Vec<AuditEntry>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let start = self.full(&codec::audit_key(after.saturating_add(1)));
        let end = prefix_end(&self.full("audit/"));
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut opts = GetOptions::new().with_range(end).with_limit(limit);
        if newest {
            opts = opts.with_sort(SortTarget::Key, SortOrder::Descend);
        }
        let mut resp = self
            .retry(op, |mut c| {
                let (k, o) = (start.clone(), opts.clone());
                async move { c.get(k, Some(o)).await }
            })
            .await?;
        let mut out = Vec::new();
        for kv in resp.take_kvs() {
            let logical = self.logical(kv.key())?;
            codec::parse_audit_seq(logical, logical.trim_start_matches("audit/"))?;
            out.push(decode::<AuditEntry>(logical, kv.value())?);
        }
        Ok(out)
    }

    /// Runs a request, retrying it on another member when it provably did
    /// not execute (connection refused, no leader, leader changed): the
    /// balanced channel may still route to a dead member for a while.
    /// Bounded: `RETRY_ATTEMPTS` tries, a few tens of ms apart.
    async fn retry<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.call(op, f(self.client.clone())).await {
                Err(StoreError::Unreachable { reason, .. })
                    if attempt < RETRY_ATTEMPTS && not_executed(&reason) =>
                {
                    tokio::time::sleep(Duration::from_millis(10 * attempt as u64)).await;
                }
                other => return other,
            }
        }
    }

    async fn get_kv(&self, op: &'static str, logical: &str) -> Result<Option<KeyValue>> {
        let key = self.full(logical);
        let mut resp = self
            .retry(op, |mut c| {
                let k = key.clone();
                async move { c.get(k, None).await }
            })
            .await?;
        Ok(resp.take_kvs().into_iter().next())
    }

    async fn get_decoded<T: serde::de::DeserializeOwned>(
        &self,
        op: &'static str,
        logical: &str,
    ) -> Result<Option<T>> {
        match self.get_kv(op, logical).await? {
            Some(kv) => Ok(Some(decode(logical, kv.value())?)),
            None => Ok(None),
        }
    }

    async fn put_value(&self, op: &'static str, logical: &str, value: Vec<u8>) -> Result<()> {
        let key = self.full(logical);
        self.retry(op, |mut c| {
            let (k, v) = (key.clone(), value.clone());
            async move { c.put(k, v, None).await }
        })
        .await
        .map(|_| ())
    }

    async fn delete_key(&self, op: &'static str, logical: &str) -> Result<bool> {
        let key = self.full(logical);
        Ok(self
            .retry(op, |mut c| {
                let k = key.clone();
                async move { c.delete(k, None).await }
            })
            .await?
            .deleted()
            > 0)
    }

    /// Every key/value under `{prefix}/{sub}`, paged, at one revision.
    async fn range(&self, op: &'static str, sub: &str) -> Result<Vec<KeyValue>> {
        let start = self.full(sub);
        let end = prefix_end(&start);
        let mut key = start.into_bytes();
        let mut revision = 0i64;
        let mut out = Vec::new();
        // Bounded: each page advances the start key; 100k pages = 1e9 keys.
        for _ in 0..100_000 {
            let mut opts = GetOptions::new()
                .with_range(end.clone())
                .with_limit(SCAN_PAGE);
            if revision > 0 {
                opts = opts.with_revision(revision);
            }
            let mut resp = self
                .retry(op, |mut c| {
                    let (k, o) = (key.clone(), opts.clone());
                    async move { c.get(k, Some(o)).await }
                })
                .await?;
            if revision == 0 {
                revision = resp.header().map(|h| h.revision()).unwrap_or(0);
            }
            let more = resp.more();
            let kvs = resp.take_kvs();
            let Some(last) = kvs.last() else { break };
            key = last.key().to_vec();
            key.push(0);
            out.extend(kvs);
            if !more {
                break;
            }
        }
        Ok(out)
    }

    /// Every stored seq floor with its key's mod_revision.
    async fn floors_with_revisions(&self, op: &'static str) -> Result<Vec<(SeqFloor, i64)>> {
        let mut out = Vec::new();
        for kv in self.range(op, "seq_floors/").await? {
            let logical = self.logical(kv.key())?;
            let Some(id) = logical
                .strip_prefix("seq_floors/")
                .and_then(|i| i.parse::<u32>().ok())
            else {
                return Err(StoreError::MalformedKey {
                    key: logical.to_string(),
                    reason: "not seq_floors/{server id}".into(),
                });
            };
            let v: codec::SeqFloorValue = decode(logical, kv.value())?;
            let floor = SeqFloor {
                server: ServerId(id),
                instance: v.instance,
                seq: v.seq,
            };
            out.push((floor, kv.mod_revision()));
        }
        Ok(out)
    }

    /// Read-modify-write of one record with compare-and-swap.
    async fn modify<T, F>(
        &self,
        op: &'static str,
        logical: &str,
        not_found: (&'static str, String),
        mut f: F,
    ) -> Result<T>
    where
        T: Serialize + serde::de::DeserializeOwned,
        F: FnMut(&mut T),
    {
        let full = self.full(logical);
        for _ in 0..CAS_ATTEMPTS {
            let Some(kv) = self.get_kv(op, logical).await? else {
                return Err(StoreError::NotFound {
                    kind: not_found.0,
                    id: not_found.1,
                });
            };
            let mut value: T = decode(logical, kv.value())?;
            f(&mut value);
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    full.clone(),
                    CompareOp::Equal,
                    kv.mod_revision(),
                )])
                .and_then([TxnOp::put(full.clone(), encode(&value), None)]);
            if self
                .retry(op, |mut c| {
                    let t = txn.clone();
                    async move { c.txn(t).await }
                })
                .await?
                .succeeded()
            {
                return Ok(value);
            }
        }
        Err(StoreError::Internal(format!(
            "{op}: {logical} changed concurrently {CAS_ATTEMPTS} times in a row"
        )))
    }

    /// The compares and operations that write retiring record `record` in
    /// a transaction: its per-address key, and the delete of the name's
    /// record of the one-per-name layout when that is of the same address
    /// (guarded by its mod_revision).
    async fn retiring_ops(
        &self,
        op: &'static str,
        record: &RetiringService,
    ) -> Result<(Vec<Compare>, Vec<TxnOp>)> {
        let name = &record.service.name;
        let key = self.full(&codec::retiring_addr_key(name, record.addr()));
        let mut ops = vec![TxnOp::put(key, encode(record), None)];
        let mut compares = Vec::new();
        let legacy = codec::retiring_key(name);
        if let Some(kv) = self.get_kv(op, &legacy).await? {
            let same = codec::decode_retiring(&legacy, name, None, kv.value())
                .is_ok_and(|old| old.addr() == record.addr());
            if same {
                let full = self.full(&legacy);
                compares.push(Compare::mod_revision(
                    full.clone(),
                    CompareOp::Equal,
                    kv.mod_revision(),
                ));
                ops.push(TxnOp::delete(full, None));
            }
        }
        Ok((compares, ops))
    }

    /// Runs one compare-and-swap transaction; whether it applied.
    async fn cas(&self, op: &'static str, txn: Txn) -> Result<bool> {
        Ok(self
            .retry(op, |mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
            .await?
            .succeeded())
    }

    /// Deletes retiring record `logical` (`name`, per address when `addr`)
    /// if it is the one retired at `deleted_unix_ms` (and, for a record of
    /// the one-per-name layout, of address `want`).
    async fn forget_retiring_key(
        &self,
        op: &'static str,
        logical: &str,
        name: &str,
        addr: Option<std::net::SocketAddrV4>,
        want: std::net::SocketAddrV4,
        deleted_unix_ms: u64,
    ) -> Result<bool> {
        let full = self.full(logical);
        for _ in 0..CAS_ATTEMPTS {
            let Some(kv) = self.get_kv(op, logical).await? else {
                return Ok(false);
            };
            // Only that record: one that does not decode is not it.
            let record = codec::decode_retiring(logical, name, addr, kv.value())?;
            if record.deleted_unix_ms != deleted_unix_ms || record.addr() != want {
                return Ok(false);
            }
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    full.clone(),
                    CompareOp::Equal,
                    kv.mod_revision(),
                )])
                .and_then([TxnOp::delete(full.clone(), None)]);
            if self.cas(op, txn).await? {
                return Ok(true);
            }
        }
        Err(StoreError::Internal(format!(
            "{op}: {logical} changed concurrently {CAS_ATTEMPTS} times in a row"
        )))
    }

    fn decode_flow(&self, kv: &KeyValue) -> Result<FlowMapping> {
        let logical = self.logical(kv.key())?;
        let flow = logical
            .strip_prefix("flows/")
            .ok_or_else(|| StoreError::MalformedKey {
                key: logical.to_string(),
                reason: "not under flows/".into(),
            })?;
        let key = codec::parse_flow(logical, flow)?;
        let v: FlowValue = decode(logical, kv.value())?;
        Ok(FlowMapping {
            key,
            server: ServerId(v.server),
        })
    }

    fn decode_leader(&self, election: &str, kv: &KeyValue) -> Result<LeaderInfo> {
        let logical = codec::leader_key(election);
        let v: LeaderValue = decode(&logical, kv.value())?;
        Ok(LeaderInfo {
            election: election.to_string(),
            candidate: v.candidate,
            lease_id: v.lease_id,
            term: kv.create_revision().max(0) as u64,
        })
    }

    /// Translates one watch event; `None` for keys that are not watched
    /// records (e.g. counters).
    fn translate(&self, event_type: EventType, kv: &KeyValue) -> Result<Option<WatchEvent>> {
        let logical = self.logical(kv.key())?.to_string();
        let put = event_type == EventType::Put;
        let (kind, rest) = logical.split_once('/').unwrap_or((logical.as_str(), ""));
        let change = match (kind, put) {
            ("servers", true) => Change::ServerPut(decode(&logical, kv.value())?),
            ("servers", false) => Change::ServerDeleted(codec::parse_server_id(&logical, rest)?),
            ("services", true) => Change::ServicePut(decode(&logical, kv.value())?),
            ("services", false) => Change::ServiceDeleted(rest.to_string()),
            ("policy", true) => Change::PolicyPut(decode(&logical, kv.value())?),
            ("policy", false) => Change::PolicyPut(Policy::default()),
            ("drains", true) => Change::DrainPut(decode(&logical, kv.value())?),
            ("drains", false) => Change::DrainDeleted(codec::parse_server_id(&logical, rest)?),
            ("audit", true) => Change::AuditAppended(decode(&logical, kv.value())?),
            ("leader", true) => Change::LeaderChanged {
                election: rest.to_string(),
                leader: Some(self.decode_leader(rest, kv)?),
            },
            ("leader", false) => Change::LeaderChanged {
                election: rest.to_string(),
                leader: None,
            },
            _ => return Ok(None),
        };
        Ok(Some(WatchEvent {
            revision: kv.mod_revision().max(0) as u64,
            change,
        }))
    }

    /// Flow writes in transactions of at most `max_txn_ops`. With a fence,
    /// every transaction also compares the leader key's lease and create
    /// revision (the term) with the fence: a lease that expired (the key is
    /// gone) or a key re-created by another candidate fails the compare and
    /// nothing of that transaction is written.
    async fn write_flows(&self, ops: &[FlowOp], fence: Option<&LeaderInfo>) -> Result<()> {
        // etcd refuses a transaction that touches a key twice.
        let ops = last_op_per_flow(ops);
        let guard: Vec<Compare> = match fence {
            Some(f) => {
                let key = self.full(&codec::leader_key(&f.election));
                vec![
                    Compare::lease(key.clone(), CompareOp::Equal, f.lease_id),
                    Compare::create_revision(
                        key,
                        CompareOp::Equal,
                        i64::try_from(f.term).unwrap_or(i64::MAX),
                    ),
                ]
            }
            None => Vec::new(),
        };
        // A fenced empty batch still checks the fence (one empty chunk).
        let empty: [FlowOp; 0] = [];
        let chunks: Vec<&[FlowOp]> = if ops.is_empty() && fence.is_some() {
            vec![&empty[..]]
        } else {
            ops.chunks(self.config.max_txn_ops.max(1)).collect()
        };
        for chunk in chunks {
            let txn_ops: Vec<TxnOp> = chunk
                .iter()
                .map(|op| match op {
                    FlowOp::Put { key, server } => TxnOp::put(
                        self.full(&codec::flow_key(key)),
                        encode(&FlowValue { server: server.0 }),
                        None::<PutOptions>,
                    ),
                    FlowOp::Delete { key } => TxnOp::delete(self.full(&codec::flow_key(key)), None),
                })
                .collect();
            let txn = Txn::new().when(guard.clone()).and_then(txn_ops);
            let resp = self
                .retry("apply_flows", |mut c| {
                    let t = txn.clone();
                    async move { c.txn(t).await }
                })
                .await?;
            if let (Some(f), false) = (fence, resp.succeeded()) {
                // Best effort: name the holder; the refusal stands either way.
                let holder = match self
                    .get_kv("apply_flows", &codec::leader_key(&f.election))
                    .await
                {
                    Ok(Some(kv)) => self.decode_leader(&f.election, &kv).ok(),
                    _ => None,
                };
                return Err(fenced_out(f, holder.as_ref()));
            }
        }
        Ok(())
    }

    /// Writes a raw value at a logical key, bypassing encoding. For tests of
    /// malformed keys and values only.
    #[doc(hidden)]
    pub async fn inject_raw(&self, logical: &str, bytes: Vec<u8>) -> Result<()> {
        self.put_value("inject", logical, bytes).await
    }
}

#[async_trait]
impl Store for EtcdStore {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    async fn put_server(&self, server: &Server) -> Result<()> {
        self.put_value("put_server", &codec::server_key(server.id), encode(server))
            .await
    }

    async fn put_registered_server(&self, server: &Server) -> Result<Server> {
        const OP: &str = "put_registered_server";
        let logical = codec::server_key(server.id);
        let full = self.full(&logical);
        // Compare-and-swap on the stored record (or its absence), so an
        // operator weight written between the read and the write is seen.
        for _ in 0..CAS_ATTEMPTS {
            let kv = self.get_kv(OP, &logical).await?;
            // A stored record that does not decode is replaced: the
            // server's REGISTER must be able to write its record.
            let old = match kv.as_ref().map(|kv| decode::<Server>(&logical, kv.value())) {
                Some(Ok(old)) => Some(old),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "replacing an undecodable server record");
                    None
                }
                None => None,
            };
            let rec = merge_registered_server(server.clone(), old.as_ref());
            let guard = match &kv {
                Some(kv) => {
                    Compare::mod_revision(full.clone(), CompareOp::Equal, kv.mod_revision())
                }
                None => Compare::version(full.clone(), CompareOp::Equal, 0),
            };
            let txn =
                Txn::new()
                    .when([guard])
                    .and_then([TxnOp::put(full.clone(), encode(&rec), None)]);
            if self.cas(OP, txn).await? {
                return Ok(rec);
            }
        }
        Err(StoreError::Internal(format!(
            "{OP}: {logical} changed concurrently {CAS_ATTEMPTS} times in a row"
        )))
    }

    async fn get_server(&self, id: ServerId) -> Result<Option<Server>> {
        self.get_decoded("get_server", &codec::server_key(id)).await
    }

    async fn list_servers(&self) -> Result<Vec<Server>> {
        let mut out = Vec::new();
        for kv in self.range("list_servers", "servers/").await? {
            let logical = self.logical(kv.key())?;
            let id = codec::parse_server_id(logical, logical.trim_start_matches("servers/"))?;
            let s: Server = decode(logical, kv.value())?;
            if s.id != id {
                return Err(StoreError::MalformedValue {
                    key: logical.to_string(),
                    reason: format!("holds server {}", s.id),
                });
            }
            out.push(s);
        }
        out.sort_by_key(|s| s.id);
        Ok(out)
    }

    async fn set_server_state(&self, id: ServerId, state: ServerState) -> Result<Server> {
        self.modify(
            "set_server_state",
            &codec::server_key(id),
            ("server", id.to_string()),
            |s: &mut Server| {
                s.state = state;
                s.updated_unix_ms = unix_ms_now();
            },
        )
        .await
    }

    async fn set_server_weight(&self, id: ServerId, weight: u32) -> Result<Server> {
        self.modify(
            "set_server_weight",
            &codec::server_key(id),
            ("server", id.to_string()),
            |s: &mut Server| {
                with_operator_weight(s, weight);
                s.updated_unix_ms = unix_ms_now();
            },
        )
        .await
    }

    async fn clear_server_weight(&self, id: ServerId) -> Result<Server> {
        self.modify(
            "clear_server_weight",
            &codec::server_key(id),
            ("server", id.to_string()),
            |s: &mut Server| {
                without_operator_weight(s);
                s.updated_unix_ms = unix_ms_now();
            },
        )
        .await
    }

    async fn delete_server(&self, id: ServerId) -> Result<bool> {
        let deleted = self
            .delete_key("delete_server", &codec::server_key(id))
            .await?;
        self.delete_key("delete_server", &codec::seq_floor_key(id))
            .await?;
        Ok(deleted)
    }

    async fn put_service(&self, service: &Service) -> Result<()> {
        const OP: &str = "put_service";
        check_name("service name", &service.name)?;
        let logical = codec::service_key(&service.name);
        let full = self.full(&logical);
        // Compare-and-swap on the stored record (or its absence): a move to
        // another VIP:port records the old address as retiring in the
        // same transaction.
        for _ in 0..CAS_ATTEMPTS {
            let kv = self.get_kv(OP, &logical).await?;
            let mut compares = vec![match &kv {
                Some(kv) => {
                    Compare::mod_revision(full.clone(), CompareOp::Equal, kv.mod_revision())
                }
                None => Compare::version(full.clone(), CompareOp::Equal, 0),
            }];
            let mut then = vec![TxnOp::put(full.clone(), encode(service), None)];
            // A stored record that does not decode is replaced without a
            // record (nothing could have served it).
            let old = kv.and_then(|kv| decode::<Service>(&logical, kv.value()).ok());
            if let Some(old) = old.filter(|o| (o.vip, o.port) != (service.vip, service.port)) {
                let record = RetiringService {
                    service: old,
                    deleted_unix_ms: unix_ms_now(),
                };
                let (c, o) = self.retiring_ops(OP, &record).await?;
                compares.extend(c);
                then.extend(o);
            }
            if self
                .cas(OP, Txn::new().when(compares).and_then(then))
                .await?
            {
                return Ok(());
            }
        }
        Err(StoreError::Internal(format!(
            "{OP}: {logical} changed concurrently {CAS_ATTEMPTS} times in a row"
        )))
    }

    async fn get_service(&self, name: &str) -> Result<Option<Service>> {
        check_name("service name", name)?;
        self.get_decoded("get_service", &codec::service_key(name))
            .await
    }

    async fn list_services(&self) -> Result<Vec<Service>> {
        let mut out = Vec::new();
        for kv in self.range("list_services", "services/").await? {
            let logical = self.logical(kv.key())?;
            let s: Service = decode(logical, kv.value())?;
            out.push(s);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn delete_service(&self, name: &str) -> Result<bool> {
        const OP: &str = "delete_service";
        check_name("service name", name)?;
        let logical = codec::service_key(name);
        let full = self.full(&logical);
        // Compare-and-swap on the record's mod_revision: the retiring
        // record is the service as deleted, in the delete's transaction.
        for _ in 0..CAS_ATTEMPTS {
            let Some(kv) = self.get_kv(OP, &logical).await? else {
                return Ok(false);
            };
            let mut compares = vec![Compare::mod_revision(
                full.clone(),
                CompareOp::Equal,
                kv.mod_revision(),
            )];
            let mut then = vec![TxnOp::delete(full.clone(), None)];
            // A record that does not decode still goes (an operator must
            // be able to delete it), with no retiring record.
            match decode::<Service>(&logical, kv.value()) {
                Ok(service) => {
                    let record = RetiringService {
                        service,
                        deleted_unix_ms: unix_ms_now(),
                    };
                    let (c, o) = self.retiring_ops(OP, &record).await?;
                    compares.extend(c);
                    then.extend(o);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "deleted an undecodable service record: no retiring record")
                }
            }
            if self
                .cas(OP, Txn::new().when(compares).and_then(then))
                .await?
            {
                return Ok(true);
            }
        }
        Err(StoreError::Internal(format!(
            "{OP}: {logical} changed concurrently {CAS_ATTEMPTS} times in a row"
        )))
    }

    async fn list_retiring_services(&self) -> Result<Vec<RetiringService>> {
        const OP: &str = "list_retiring_services";
        let mut out = Vec::new();
        for kv in self.range(OP, "retiring/").await? {
            let logical = self.logical(kv.key())?;
            let rest = logical.strip_prefix("retiring/").unwrap_or(logical);
            let (name, addr) = codec::parse_retiring_key(logical, rest)?;
            out.push(codec::decode_retiring(logical, &name, addr, kv.value())?);
        }
        out.sort_by(|a, b| {
            (&a.service.name, a.service.vip, a.service.port).cmp(&(
                &b.service.name,
                b.service.vip,
                b.service.port,
            ))
        });
        Ok(out)
    }

    async fn forget_retiring_service(
        &self,
        name: &str,
        addr: std::net::SocketAddrV4,
        deleted_unix_ms: u64,
    ) -> Result<bool> {
        const OP: &str = "forget_retiring_service";
        check_name("service name", name)?;
        let per_address = codec::retiring_addr_key(name, addr);
        if self
            .forget_retiring_key(OP, &per_address, name, Some(addr), addr, deleted_unix_ms)
            .await?
        {
            return Ok(true);
        }
        // A record of the one-per-name layout.
        let legacy = codec::retiring_key(name);
        self.forget_retiring_key(OP, &legacy, name, None, addr, deleted_unix_ms)
            .await
    }

    async fn get_policy(&self) -> Result<Policy> {
        Ok(self
            .get_decoded("get_policy", codec::POLICY_KEY)
            .await?
            .unwrap_or_default())
    }

    async fn put_policy(&self, policy: &Policy) -> Result<()> {
        policy.validate()?;
        self.put_value("put_policy", codec::POLICY_KEY, encode(policy))
            .await
    }

    async fn put_policy_if_absent(&self, policy: &Policy) -> Result<bool> {
        policy.validate()?;
        let key = self.full(codec::POLICY_KEY);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, encode(policy), None)]);
        // A retried transaction that had in fact been applied finds the key
        // and reports false: the policy it wrote is there either way.
        Ok(self
            .retry("put_policy_if_absent", |mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
            .await?
            .succeeded())
    }

    async fn apply_flows(&self, ops: &[FlowOp]) -> Result<()> {
        self.write_flows(ops, None).await
    }

    async fn apply_flows_fenced(&self, ops: &[FlowOp], fence: &LeaderInfo) -> Result<()> {
        self.write_flows(ops, Some(fence)).await
    }

    async fn get_flow(&self, key: &FlowKey) -> Result<Option<ServerId>> {
        let logical = codec::flow_key(key);
        Ok(self
            .get_decoded::<FlowValue>("get_flow", &logical)
            .await?
            .map(|v| ServerId(v.server)))
    }

    async fn list_flows_by_server(&self, server: ServerId) -> Result<Vec<FlowKey>> {
        let mut out: Vec<FlowKey> = self
            .scan_flows()
            .await?
            .into_iter()
            .filter(|m| m.server == server)
            .map(|m| m.key)
            .collect();
        out.sort();
        Ok(out)
    }

    async fn scan_flows(&self) -> Result<Vec<FlowMapping>> {
        let kvs = self.range("scan_flows", "flows/").await?;
        let mut out = kvs
            .iter()
            .map(|kv| self.decode_flow(kv))
            .collect::<Result<Vec<_>>>()?;
        out.sort_by_key(|m| m.key);
        Ok(out)
    }

    async fn count_flows(&self) -> Result<u64> {
        let start = self.full("flows/");
        let end = prefix_end(&start);
        let opts = GetOptions::new().with_range(end).with_count_only();
        let resp = self
            .retry("count_flows", |mut c| {
                let (k, o) = (start.clone(), opts.clone());
                async move { c.get(k, Some(o)).await }
            })
            .await?;
        Ok(resp.count().max(0) as u64)
    }

    async fn raise_seq_floors(&self, floors: &[SeqFloor]) -> Result<()> {
        const OP: &str = "raise_seq_floors";
        for f in floors {
            // Any instance id (a random u64) is kept; a seq above i64::MAX
            // is refused as on SQLite.
            if i64::try_from(f.seq).is_err() {
                return Err(StoreError::Invalid {
                    what: "seq",
                    reason: format!(
                        "{} is above {} (the largest the store keeps)",
                        f.seq,
                        i64::MAX
                    ),
                });
            }
        }
        let mut pending: Vec<SeqFloor> = floors.to_vec();
        for _ in 0..CAS_ATTEMPTS {
            // One read of every floor, then compare-and-swap on each key's
            // mod_revision (0: absent) in transactions of max_txn_ops.
            let stored: HashMap<u32, (SeqFloor, i64)> = self
                .floors_with_revisions(OP)
                .await?
                .into_iter()
                .map(|(f, rev)| (f.server.0, (f, rev)))
                .collect();
            pending.retain(|f| match stored.get(&f.server.0) {
                Some((v, _)) => v.instance != f.instance || v.seq < f.seq,
                None => true,
            });
            let mut lost = Vec::new();
            for chunk in pending.chunks(self.config.max_txn_ops.max(1)) {
                let mut when = Vec::with_capacity(chunk.len());
                let mut then = Vec::with_capacity(chunk.len());
                for f in chunk {
                    let key = self.full(&codec::seq_floor_key(f.server));
                    let rev = stored.get(&f.server.0).map_or(0, |(_, r)| *r);
                    when.push(Compare::mod_revision(key.clone(), CompareOp::Equal, rev));
                    let v = codec::SeqFloorValue {
                        instance: f.instance,
                        seq: f.seq,
                    };
                    then.push(TxnOp::put(key, encode(&v), None));
                }
                let txn = Txn::new().when(when).and_then(then);
                let ok = self
                    .retry(OP, |mut c| {
                        let t = txn.clone();
                        async move { c.txn(t).await }
                    })
                    .await?
                    .succeeded();
                if !ok {
                    lost.extend_from_slice(chunk);
                }
            }
            if lost.is_empty() {
                return Ok(());
            }
            pending = lost;
        }
        Err(StoreError::Internal(format!(
            "{OP}: seq floors changed concurrently {CAS_ATTEMPTS} times in a row"
        )))
    }

    async fn seq_floors(&self) -> Result<Vec<SeqFloor>> {
        let mut out: Vec<SeqFloor> = self
            .floors_with_revisions("seq_floors")
            .await?
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        out.sort_by_key(|f| f.server.0);
        Ok(out)
    }

    async fn mark_seeded(&self, names: &[String]) -> Result<()> {
        const OP: &str = "mark_seeded";
        for n in names {
            check_name("service name", n)?;
        }
        // Plain puts (idempotent, so a retried chunk is harmless), in
        // transactions of at most max_txn_ops.
        let value = encode(&codec::SeededValue {});
        let mut names: Vec<&String> = names.iter().collect();
        names.sort();
        names.dedup();
        for chunk in names.chunks(self.config.max_txn_ops.max(1)) {
            let then: Vec<TxnOp> = chunk
                .iter()
                .map(|n| TxnOp::put(self.full(&codec::seeded_key(n)), value.clone(), None))
                .collect();
            let txn = Txn::new().and_then(then);
            self.retry(OP, |mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
            .await?;
        }
        Ok(())
    }

    async fn seeded_services(&self) -> Result<Vec<String>> {
        const OP: &str = "seeded_services";
        let mut out = Vec::new();
        for kv in self.range(OP, "seeded/").await? {
            let logical = self.logical(kv.key())?;
            let name = logical.strip_prefix("seeded/").unwrap_or(logical);
            check_name("service name", name).map_err(|e| StoreError::MalformedKey {
                key: logical.to_string(),
                reason: e.to_string(),
            })?;
            let _: codec::SeededValue = decode(logical, kv.value())?;
            out.push(name.to_string());
        }
        out.sort();
        Ok(out)
    }

    async fn put_drain(&self, drain: &Drain) -> Result<()> {
        self.put_value("put_drain", &codec::drain_key(drain.server), encode(drain))
            .await
    }

    async fn get_drain(&self, server: ServerId) -> Result<Option<Drain>> {
        self.get_decoded("get_drain", &codec::drain_key(server))
            .await
    }

    async fn list_drains(&self) -> Result<Vec<Drain>> {
        let mut out = Vec::new();
        for kv in self.range("list_drains", "drains/").await? {
            let logical = self.logical(kv.key())?;
            codec::parse_server_id(logical, logical.trim_start_matches("drains/"))?;
            out.push(decode::<Drain>(logical, kv.value())?);
        }
        out.sort_by_key(|d| d.server);
        Ok(out)
    }

    async fn update_drain(
        &self,
        server: ServerId,
        progress: DrainProgress,
        state: DrainState,
    ) -> Result<Drain> {
        self.modify(
            "update_drain",
            &codec::drain_key(server),
            ("drain", server.to_string()),
            |d: &mut Drain| {
                d.progress = progress;
                d.state = state;
            },
        )
        .await
    }

    async fn delete_drain(&self, server: ServerId) -> Result<bool> {
        self.delete_key("delete_drain", &codec::drain_key(server))
            .await
    }

    async fn append_audit(&self, record: &AuditRecord) -> Result<AuditEntry> {
        let counter_logical = "counters/audit";
        let counter = self.full(counter_logical);
        for _ in 0..CAS_ATTEMPTS {
            let (last, rev) = match self.get_kv("append_audit", counter_logical).await? {
                Some(kv) => (
                    decode::<u64>(counter_logical, kv.value())?,
                    kv.mod_revision(),
                ),
                None => (0, 0),
            };
            let entry = AuditEntry {
                seq: last + 1,
                at_unix_ms: unix_ms_now(),
                record: record.clone(),
            };
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    counter.clone(),
                    CompareOp::Equal,
                    rev,
                )])
                .and_then([
                    TxnOp::put(counter.clone(), encode(&entry.seq), None),
                    TxnOp::put(
                        self.full(&codec::audit_key(entry.seq)),
                        encode(&entry),
                        None,
                    ),
                ]);
            if self
                .retry("append_audit", |mut c| {
                    let t = txn.clone();
                    async move { c.txn(t).await }
                })
                .await?
                .succeeded()
            {
                return Ok(entry);
            }
        }
        Err(StoreError::Internal(format!(
            "append_audit: audit counter contended {CAS_ATTEMPTS} times in a row"
        )))
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
        let ttl_s = lease_ttl_secs(ttl);
        let grant = self
            .retry("campaign: lease grant", |mut c| async move {
                c.lease_grant(ttl_s, None).await
            })
            .await?;
        let lease_id = grant.id();
        let key = self.full(&codec::leader_key(election));
        let value = encode(&LeaderValue {
            candidate: candidate.to_string(),
            lease_id,
        });
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(lease_id)),
            )]);
        let revoke = || {
            self.retry("campaign: revoke", move |mut c| async move {
                c.lease_revoke(lease_id).await
            })
        };
        let resp = match self
            .retry("campaign", |mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
            .await
        {
            Ok(r) => r,
            Err(e) => {
                let _ = revoke().await;
                return Err(e);
            }
        };
        if !resp.succeeded() {
            let _ = revoke().await;
            return Ok(None);
        }
        let term = resp.header().map(|h| h.revision()).unwrap_or(0).max(0) as u64;
        Ok(Some(LeaderLease {
            info: LeaderInfo {
                election: election.to_string(),
                candidate: candidate.to_string(),
                term,
                lease_id,
            },
            ttl: Duration::from_secs(grant.ttl().max(1) as u64),
        }))
    }

    async fn keep_alive(&self, lease: &LeaderLease) -> Result<()> {
        let not_leader = |reason: String| StoreError::NotLeader {
            election: lease.info.election.clone(),
            reason,
        };
        let lost = |e: StoreError| match e {
            StoreError::Etcd { source, op } => match *source {
                etcd_client::Error::LeaseKeepAliveError(m) => {
                    not_leader(format!("lease {}: {m}", lease.info.lease_id))
                }
                etcd_client::Error::GRpcStatus(s) if s.message().contains("lease not found") => {
                    not_leader(format!("lease {}: {}", lease.info.lease_id, s.message()))
                }
                other => StoreError::Etcd {
                    op,
                    source: Box::new(other),
                },
            },
            other => other,
        };
        let id = lease.info.lease_id;
        let (mut keeper, mut stream) = self
            .retry(
                "keep_alive",
                |mut c| async move { c.lease_keep_alive(id).await },
            )
            .await
            .map_err(lost)?;
        self.call("keep_alive", keeper.keep_alive())
            .await
            .map_err(lost)?;
        let resp = self
            .call("keep_alive", stream.message())
            .await
            .map_err(lost)?;
        match resp {
            Some(r) if r.ttl() > 0 => {}
            _ => return Err(not_leader(format!("lease {} expired", lease.info.lease_id))),
        }
        match self
            .get_kv("keep_alive", &codec::leader_key(&lease.info.election))
            .await?
        {
            Some(kv) if kv.lease() == lease.info.lease_id => Ok(()),
            _ => Err(not_leader(format!(
                "leader key no longer held by lease {}",
                lease.info.lease_id
            ))),
        }
    }

    async fn resign(&self, lease: &LeaderLease) -> Result<()> {
        let id = lease.info.lease_id;
        match self
            .retry("resign", |mut c| async move { c.lease_revoke(id).await })
            .await
        {
            Ok(_) => Ok(()),
            // Already expired: nothing to give up.
            Err(StoreError::Etcd { source, .. }) if matches!(&*source, etcd_client::Error::GRpcStatus(s) if s.message().contains("lease not found")) => {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn leader(&self, election: &str) -> Result<Option<LeaderInfo>> {
        check_name("election name", election)?;
        match self.get_kv("leader", &codec::leader_key(election)).await? {
            Some(kv) => Ok(Some(self.decode_leader(election, &kv)?)),
            None => Ok(None),
        }
    }

    async fn watch(&self, kinds: &[WatchKind]) -> Result<WatchStream> {
        let (out_tx, out_rx) = tokio::sync::mpsc::channel::<Result<WatchEvent>>(1024);
        if kinds.is_empty() {
            return Ok(crate::receiver_stream(out_rx));
        }
        // Watch from the revision after "now" so nothing after this call is missed.
        let policy_key = self.full(codec::POLICY_KEY);
        let now_rev = self
            .retry("watch", |mut c| {
                let k = policy_key.clone();
                async move { c.get(k, Some(GetOptions::new().with_count_only())).await }
            })
            .await?
            .header()
            .map(|h| h.revision())
            .unwrap_or(0);
        // One watcher over all records: etcd orders events within a watcher
        // only, so per-kind watchers could interleave out of revision order.
        let records = format!("{}/records/", self.config.prefix);
        let opts = WatchOptions::new()
            .with_start_revision(now_rev + 1)
            .with_prefix();
        let (watcher, mut stream) = self
            .retry("watch", |mut c| {
                let (k, o) = (records.clone(), opts.clone());
                async move { c.watch(k, Some(o)).await }
            })
            .await?;
        let kinds: Vec<WatchKind> = kinds.to_vec();
        let this = self.clone();
        tokio::spawn(async move {
            let _watcher = watcher;
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    _ = out_tx.closed() => return,
                };
                let resp = match msg {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        let _ = out_tx
                            .send(Err(StoreError::Unreachable {
                                endpoints: this.endpoints.clone(),
                                reason: "watch stream closed".into(),
                            }))
                            .await;
                        return;
                    }
                    Err(e) => {
                        let _ = out_tx.send(Err((this.err("watch"))(e))).await;
                        return;
                    }
                };
                if resp.canceled() {
                    let reason = if resp.compact_revision() > 0 {
                        return {
                            let _ = out_tx
                                .send(Err(StoreError::WatchLagged { missed: 0 }))
                                .await;
                        };
                    } else {
                        resp.cancel_reason().to_string()
                    };
                    let _ = out_tx
                        .send(Err(StoreError::Etcd {
                            op: "watch",
                            source: Box::new(etcd_client::Error::WatchError(reason)),
                        }))
                        .await;
                    return;
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    match this.translate(ev.event_type(), kv) {
                        Ok(Some(event)) => {
                            if !kinds.contains(&event.change.kind()) {
                                continue;
                            }
                            if out_tx.send(Ok(event)).await.is_err() {
                                return;
                            }
                        }
                        Ok(None) => {}
                        Err(e) => tracing::warn!(error = %e, "skipping undecodable watch event"),
                    }
                }
            }
        });
        Ok(crate::receiver_stream(out_rx))
    }
}
