//! Typed errors of the store. Every variant names what went wrong and where
//! (file path, etcd endpoints, key, policy field), so an operator can act on
//! the message alone.

use std::time::Duration;

/// A policy field that failed validation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("policy field `{field}` {reason}")]
pub struct PolicyError {
    pub field: &'static str,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The SQLite file exists but cannot be read as a database.
    #[error("SQLite store {path}: file is corrupt or not a database: {reason}")]
    Corrupt { path: String, reason: String },

    /// The SQLite file is a valid database written by another application.
    #[error("SQLite store {path}: not a Capybara store: {reason}")]
    ForeignDatabase { path: String, reason: String },

    /// The SQLite file was written by a newer Capybara.
    #[error("SQLite store {path}: schema version {found} is newer than the {supported} this build understands")]
    SchemaTooNew {
        path: String,
        found: i64,
        supported: i64,
    },

    #[error("SQLite error during {op}: {source}")]
    Sqlite {
        op: &'static str,
        #[source]
        source: rusqlite::Error,
    },

    /// No etcd endpoint answered (connect failure, timeout, refused).
    #[error("etcd unreachable at [{endpoints}]: {reason}")]
    Unreachable { endpoints: String, reason: String },

    #[error("etcd error during {op}: {}", crate::etcd::describe(source))]
    Etcd {
        op: &'static str,
        // Boxed: a gRPC status is large and errors travel through every Result.
        #[source]
        source: Box<etcd_client::Error>,
    },

    /// A key in the store does not follow the documented layout.
    #[error("malformed key {key:?}: {reason}")]
    MalformedKey { key: String, reason: String },

    /// A stored value cannot be decoded.
    #[error("malformed value at key {key:?}: {reason}")]
    MalformedValue { key: String, reason: String },

    /// A stored value carries a format version this build cannot read.
    #[error(
        "value at key {key:?} has format version {found}; this build reads version {supported}"
    )]
    UnsupportedVersion {
        key: String,
        found: u64,
        supported: u64,
    },

    #[error("invalid policy: {0}")]
    InvalidPolicy(#[from] PolicyError),

    /// A caller-supplied argument was rejected before touching the store.
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },

    #[error("{kind} {id} not found")]
    NotFound { kind: &'static str, id: String },

    /// The lease behind a leadership expired, was revoked or was taken over.
    #[error("not the leader of election {election:?}: {reason}")]
    NotLeader { election: String, reason: String },

    /// The watcher fell behind the change stream and missed events. The
    /// consumer must re-list the state it caches and watch again.
    #[error("watch fell behind and missed {missed} change events; re-list and watch again")]
    WatchLagged { missed: u64 },

    #[error("store operation {op} timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },

    #[error("configuration: {0}")]
    Config(String),

    #[error("internal store error: {0}")]
    Internal(String),
}

/// The `NotLeader` of a fenced write refused because `fence` no longer
/// holds its election (`holder`: who does, if anyone).
pub(crate) fn fenced_out(
    fence: &crate::model::LeaderInfo,
    holder: Option<&crate::model::LeaderInfo>,
) -> StoreError {
    let now = match holder {
        Some(h) => format!("{:?} holds it with term {}", h.candidate, h.term),
        None => "no live leader".into(),
    };
    StoreError::NotLeader {
        election: fence.election.clone(),
        reason: format!(
            "write refused: lease {} (term {}) of {:?} no longer holds the election ({now})",
            fence.lease_id, fence.term, fence.candidate
        ),
    }
}

impl StoreError {
    pub(crate) fn sqlite(op: &'static str) -> impl FnOnce(rusqlite::Error) -> StoreError {
        move |source| StoreError::Sqlite { op, source }
    }

    /// Whether retrying the same operation later may succeed (network,
    /// timeouts, busy database). Decode and validation errors are permanent.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Unreachable { .. }
            | StoreError::Etcd { .. }
            | StoreError::Timeout { .. } => true,
            StoreError::Sqlite { source, .. } => matches!(
                source.sqlite_error_code(),
                Some(rusqlite::ErrorCode::DatabaseBusy) | Some(rusqlite::ErrorCode::DatabaseLocked)
            ),
            _ => false,
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
