//! Typed errors of the engine's API and of received messages.

use capybara_proto::frag::{ReassemblyError, SplitError};
use capybara_proto::tcpmig::{Kind, TcpMigError};
use capybara_proto::FlowKey;
use thiserror::Error;

use crate::MigrationId;

/// A local API call that could not be honoured. The engine's state is
/// unchanged unless the variant says otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MigError {
    #[error("no migration {0} is known to this host")]
    UnknownMigration(MigrationId),
    #[error("migration {id} is {state}, the call needs it to be {expected}")]
    WrongState {
        id: MigrationId,
        state: &'static str,
        expected: &'static str,
    },
    #[error("flow {0} already has a migration in progress on this host")]
    FlowBusy(FlowKey),
    #[error("{limit} migrations out are already in progress")]
    TooManyMigrations { limit: usize },
    #[error("the record table is full ({limit} records)")]
    RecordTableFull { limit: usize },
    #[error("the migration counter is not seeded yet (no REGISTER_ACK from the switch): no migration starts before")]
    CounterNotSeeded,
    #[error("cannot migrate a connection to this host itself ({0})")]
    TargetIsSelf(std::net::Ipv4Addr),
    #[error("snapshot of {len} bytes exceeds the {max}-byte limit; the migration was abandoned and the origin keeps the connection")]
    SnapshotTooLarge { len: usize, max: usize },
    #[error("snapshot cannot be fragmented: {0}; the migration was abandoned and the origin keeps the connection")]
    Split(#[from] SplitError),
}

/// Why a received datagram was dropped. Every variant is also counted in
/// [`crate::Counters`]; the driver may log it, nothing else is required.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RxError {
    #[error("malformed TCPMig datagram: {0}")]
    Malformed(TcpMigError),
    #[error("TCPMig version not supported: {0}")]
    BadVersion(TcpMigError),
    #[error("TCPMig MAC verification failed (wrong deployment key or tampered message)")]
    BadMac,
    #[error("{kind} for migration {id} carries an invalid fragment: {err}")]
    BadFragment {
        kind: Kind,
        id: MigrationId,
        err: ReassemblyError,
    },
    #[error("{kind} for migration {id} from {src} does not fit this host's view ({why})")]
    Unexpected {
        kind: Kind,
        id: MigrationId,
        src: std::net::Ipv4Addr,
        why: &'static str,
    },
}
