//! Engine configuration: addresses, timers, bounds and the target's accept
//! policy.
//!
//! Invariant checked by [`EngineConfig::validate`]: the target keeps its
//! record of a committed migration (`linger`) longer than an origin can stay
//! in doubt about it (`migration_deadline_max + in_doubt_limit`), so that an
//! ABORT request from an in-doubt origin is always answered with the true
//! outcome, never with "unknown migration".

use std::net::Ipv4Addr;

use capybara_proto::frag::max_fragment_payload;
use capybara_proto::time::Duration;
use thiserror::Error;

/// What the target does with client TCP segments of a flow that is being
/// migrated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferMode {
    /// Keep them (bounded by bytes) and replay them after import (TCPMig).
    Buffer,
    /// Drop all of them; the client retransmits after import (the Prism
    /// behaviour, kept as an ablation baseline).
    Drop,
}

/// Configuration of one host's migration engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// This host's data address (source of every message it sends).
    pub local_addr: Ipv4Addr,
    /// The switch's TCPMig address: PREPAREs without an explicit target go here.
    pub switch_addr: Ipv4Addr,
    /// IP MTU of the path between servers; CONN_STATE fragments fit in it.
    pub path_mtu: usize,
    /// First retransmission timeout of every TCPMig message.
    pub rto_initial: Duration,
    /// Backoff doubles the timeout up to this value.
    pub rto_max: Duration,
    /// Origin: time from `migrate_out` until the migration is given up,
    /// for an empty snapshot; larger snapshots get `deadline_per_mib` more.
    pub migration_deadline: Duration,
    /// Origin: extra deadline per MiB of snapshot, granted when the snapshot
    /// is provided. A connection with full queues takes longer to send than
    /// an idle one; with one fixed deadline, under load, exactly the
    /// connections with the most data in flight always resumed.
    pub deadline_per_mib: Duration,
    /// Origin: hard cap of the deadline, from `migrate_out`, whatever the
    /// snapshot size (bounds how long a connection stays frozen).
    pub migration_deadline_max: Duration,
    /// Target: time from PREPARE, and from each new CONN_STATE fragment
    /// (progress), until an incomplete migration in is given up. Longer
    /// than `migration_deadline` so that normally the origin decides first
    /// (either order is safe).
    pub target_deadline: Duration,
    /// Target: hard cap of the progress-extended deadline, from PREPARE.
    /// Longer than `migration_deadline_max` for the same reason.
    pub target_deadline_max: Duration,
    /// Origin: how long it keeps asking an unresponsive target for the
    /// outcome after the state was sent, before reporting the connection
    /// lost (only happens when the target host failed).
    pub in_doubt_limit: Duration,
    /// How long finished migrations are remembered to answer duplicates.
    pub linger: Duration,
    /// How many times a target repeats an unsolicited ABORT decision (its
    /// own deadline, import failure); solicited decisions answer every request.
    pub abort_repeats: u8,
    /// Largest connection snapshot (TCP + application state) accepted.
    pub max_snapshot_bytes: usize,
    /// Target: bytes of client segments buffered per migrating flow (set it
    /// to at least the receive window the stack advertises).
    pub max_buffer_bytes: usize,
    /// Target: most segments buffered per flow (bounds the index, which is
    /// pre-sized; 0 = `max_buffer_bytes / 64`).
    pub max_buffer_segments: usize,
    /// Target: buffering or Prism-style dropping.
    pub buffer_mode: BufferMode,
    /// Origin: migrations out in progress at once.
    pub max_concurrent_out: usize,
    /// Target: migrations in progress at once (PREPAREs beyond are rejected
    /// with NO_CAPACITY).
    pub max_concurrent_in: usize,
    /// Most records (live + remembered) held; bounds memory under floods.
    pub max_records: usize,
    /// Most flows whose ownership epoch (the id of the migration that
    /// brought them here) is remembered; a flow migrated in beyond it keeps
    /// epoch 0 and cannot migrate on while an entry exists at the switch.
    /// Size it to the connections a host holds.
    pub max_epochs: usize,
    /// Most messages queued for `poll_transmit`; beyond, new replies are
    /// dropped (counted) and recovered by retransmission.
    pub max_tx_queue: usize,
    /// Initial value of the per-host migration counter (the low 32 bits of
    /// every migration id). Drivers seed it from the wall clock so that a
    /// restarted host does not reuse ids still remembered by peers.
    pub first_migration_seq: u32,
    /// [`crate::Engine::migrate_out`] refuses
    /// ([`crate::MigError::CounterNotSeeded`]) until
    /// [`crate::Engine::seed_migration_counter`] is called: a driver that
    /// learns the last id the switch saw from this host (REGISTER_ACK)
    /// numbers no migration before it knows. Off by default.
    pub hold_until_seeded: bool,
}

impl EngineConfig {
    /// Defaults for a data-centre path (tens of microseconds RTT).
    pub fn new(local_addr: Ipv4Addr, switch_addr: Ipv4Addr) -> Self {
        EngineConfig {
            local_addr,
            switch_addr,
            path_mtu: 1500,
            rto_initial: Duration::from_millis(1),
            rto_max: Duration::from_millis(16),
            migration_deadline: Duration::from_millis(50),
            deadline_per_mib: Duration::from_millis(200),
            migration_deadline_max: Duration::from_millis(250),
            target_deadline: Duration::from_millis(100),
            target_deadline_max: Duration::from_millis(300),
            in_doubt_limit: Duration::from_secs(2),
            linger: Duration::from_secs(3),
            abort_repeats: 3,
            max_snapshot_bytes: 256 * 1024,
            max_buffer_bytes: 256 * 1024,
            max_buffer_segments: 0,
            buffer_mode: BufferMode::Buffer,
            max_concurrent_out: 256,
            max_concurrent_in: 256,
            max_records: 16 * 1024,
            max_tx_queue: 4096,
            max_epochs: 64 * 1024,
            first_migration_seq: 1,
            hold_until_seeded: false,
        }
    }

    /// Segments index size actually used.
    pub fn buffer_segments(&self) -> usize {
        if self.max_buffer_segments == 0 {
            (self.max_buffer_bytes / 64).max(16)
        } else {
            self.max_buffer_segments
        }
    }

    /// Latest origin deadline any migration can get (the size-scaled one
    /// is capped by `migration_deadline_max`).
    pub fn longest_deadline(&self) -> Duration {
        self.migration_deadline.max(self.migration_deadline_max)
    }

    /// Origin deadline of a migration whose snapshot has `snapshot_bytes`,
    /// counted from `migrate_out`.
    pub fn deadline_for(&self, snapshot_bytes: usize) -> Duration {
        let mib = snapshot_bytes as f64 / (1024.0 * 1024.0);
        let extra = Duration::try_from_secs_f64(self.deadline_per_mib.as_secs_f64() * mib)
            .unwrap_or(Duration::MAX);
        self.migration_deadline
            .saturating_add(extra)
            .min(self.longest_deadline())
    }

    /// Checks the relations the protocol relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.local_addr.is_unspecified() {
            return Err(ConfigError::Invalid(
                "local_addr must be this host's data address, not 0.0.0.0",
            ));
        }
        if max_fragment_payload(self.path_mtu) == 0 {
            return Err(ConfigError::MtuTooSmall { mtu: self.path_mtu });
        }
        if self.rto_initial.is_zero() || self.rto_max < self.rto_initial {
            return Err(ConfigError::Invalid("need 0 < rto_initial <= rto_max"));
        }
        if self.migration_deadline.is_zero() || self.target_deadline.is_zero() {
            return Err(ConfigError::Invalid("deadlines must be positive"));
        }
        if self.migration_deadline_max < self.migration_deadline
            || self.target_deadline_max < self.target_deadline
        {
            return Err(ConfigError::Invalid(
                "need migration_deadline <= migration_deadline_max and target_deadline <= target_deadline_max",
            ));
        }
        if self.linger <= self.longest_deadline() + self.in_doubt_limit {
            return Err(ConfigError::LingerTooShort {
                linger: self.linger,
                needed: self.longest_deadline() + self.in_doubt_limit,
            });
        }
        if self.max_concurrent_in == 0 || self.max_concurrent_out == 0 || self.max_records == 0 {
            return Err(ConfigError::Invalid(
                "concurrency limits and max_records must be positive",
            ));
        }
        if self.max_tx_queue < 16 {
            return Err(ConfigError::Invalid("max_tx_queue must be at least 16"));
        }
        Ok(())
    }
}

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error("path MTU {mtu} leaves no room for snapshot bytes in a CONN_STATE")]
    MtuTooSmall { mtu: usize },
    #[error("linger {linger:?} must exceed migration_deadline + in_doubt_limit = {needed:?}, or an in-doubt origin could be told 'unknown migration' about a committed one")]
    LingerTooShort { linger: Duration, needed: Duration },
    #[error("invalid TCPMig engine configuration: {0}")]
    Invalid(&'static str),
}
