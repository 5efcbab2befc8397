//! Engine counters (monotonic; exported by the host agent as metrics).

use capybara_proto::tcpmig::Kind;

/// Per-kind message counts, indexed by [`Kind`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PerKind(pub [u64; 6]);

impl PerKind {
    pub fn get(&self, k: Kind) -> u64 {
        self.0[usize::from(k.to_u8() - 1)]
    }
    pub(crate) fn bump(&mut self, k: Kind) {
        self.0[usize::from(k.to_u8() - 1)] += 1;
    }
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Valid, authenticated messages received, by kind.
    pub rx: PerKind,
    /// Messages written by `poll_transmit`, by kind (retransmissions included).
    pub tx: PerKind,
    /// Datagrams whose MAC did not verify.
    pub bad_mac: u64,
    /// Datagrams of another TCPMig version.
    pub bad_version: u64,
    /// Datagrams that are not valid TCPMig (short, bad magic, bad length,
    /// unknown kind, bad fragment fields).
    pub malformed: u64,
    /// Authenticated messages that did not fit the local state (stale,
    /// wrong sender, duplicates of finished migrations that need no answer).
    pub unexpected: u64,
    /// Duplicate messages recognised and handled idempotently.
    pub duplicates: u64,
    /// Messages sent again by a retransmission timer.
    pub retransmissions: u64,
    /// REJECTs sent (target) / received (origin).
    pub rejects_sent: u64,
    pub rejects_received: u64,
    /// ABORTs sent / received.
    pub aborts_sent: u64,
    pub aborts_received: u64,
    /// Migrations finished, by outcome.
    pub migrated_out: u64,
    pub migrated_in: u64,
    pub resumed: u64,
    pub lost: u64,
    /// Client segments buffered at the target / dropped (bound or drop mode).
    pub segments_buffered: u64,
    pub segments_dropped: u64,
    /// Replies not queued because the transmit queue was full.
    pub tx_queue_full: u64,
    /// Flows migrated in whose ownership epoch found no room (`max_epochs`).
    pub epoch_table_full: u64,
}
