//! TCPMig, the connection-migration engine of one host (seed 000 §4), both
//! roles: *origin* (moves a connection out) and *target* (takes one in).
//!
//! The engine is sans-IO. It takes datagrams, local API calls and `now`, and
//! yields datagrams (`poll_transmit`), timers (`poll_timeout` /
//! `handle_timeout`) and events for the TCP stack (`poll_event`). It never
//! reads a clock or a socket, and treats connection snapshots as opaque
//! bytes produced and consumed by the stack.
//!
//! Invariants (the reasoning is in `docs/MIGRATION.md`):
//! - **one owner**: for every migration, at most one of {origin, target}
//!   serves the connection at any time, and once both have finished exactly
//!   one does. The target is the only party that can make itself owner and
//!   does so at exactly one point (`import_done`); after that it never
//!   aborts. The origin gives the connection up only on CONN_STATE_ACK, and
//!   keeps the snapshot until then; it resumes on its own only while it has
//!   not sent any state (the target cannot commit without it).
//! - **switch agreement**: every message that can move the switch's
//!   migration-table entry names the owner it implies (PREPARE_ACK and
//!   CONN_STATE_ACK: `target`; ABORT sent by the target: `origin`), and the
//!   target never sends an ABORT after committing, so the entry converges
//!   to the owner.
//! - untrusted datagrams never panic: they are validated, authenticated,
//!   checked against local state, and otherwise counted and dropped.
//! - nothing on the per-packet path allocates: segment buffers and
//!   reassembly buffers are sized when the PREPARE is accepted (and
//!   recycled); transmit and event queues are pre-sized and bounded.

mod config;
mod counters;
mod engine;
mod error;
mod segbuf;
mod telemetry;

pub use capybara_proto::tcpmig::{Kind, Reason};
pub use capybara_proto::time::{Duration, Instant};
pub use capybara_proto::{FlowKey, MigrationKey};
pub use config::{BufferMode, ConfigError, EngineConfig};
pub use counters::{Counters, PerKind};
pub use engine::{map, Hasher as MapHasher, Map};
pub use engine::{
    AcceptHook, BufferVerdict, DropCause, Engine, Event, OriginPhase, Phase, ReplaySummary,
    TargetPhase, Transmit, SEED_MARGIN,
};
pub use error::{MigError, RxError};
pub use telemetry::HostCpu;
pub use telemetry::Telemetry;

/// Identifies one migration on the wire and in the API. The high 32 bits
/// are the origin's data address and the low 32 bits a per-origin counter,
/// so ids from one origin increase (the switch uses this to refuse stale
/// PREPARE_ACKs) and ids from different origins never collide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MigrationId(pub u64);

impl MigrationId {
    /// The origin's data address encoded in the id.
    pub fn origin(self) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::from((self.0 >> 32) as u32)
    }
}

impl std::fmt::Display for MigrationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "mig-{:016x}", self.0)
    }
}
