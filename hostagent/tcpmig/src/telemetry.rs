//! Per-migration phase timestamps and volumes (the API's "migrations, with
//! phase timings" and the latency-by-phase benchmark read these).

use capybara_proto::time::Instant;

/// What one host saw of one migration. Origin fields are filled on the
/// origin, target fields on the target; a phase not reached stays `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Telemetry {
    /// `migrate_out` called (origin) / first PREPARE received (target).
    pub started: Option<Instant>,
    // Origin.
    pub prepare_sent: Option<Instant>,
    pub prepare_ack_received: Option<Instant>,
    /// `provide_snapshot` called.
    pub export_done: Option<Instant>,
    /// Last fragment of the first CONN_STATE burst written.
    pub state_sent: Option<Instant>,
    pub state_ack_received: Option<Instant>,
    // Target.
    pub prepare_received: Option<Instant>,
    /// All fragments present (`ImportNow` emitted).
    pub state_received: Option<Instant>,
    /// `import_done` called.
    pub import_done: Option<Instant>,
    /// Buffered segments handed back to the stack (same call as import_done).
    pub replayed: Option<Instant>,
    // Volumes.
    /// Snapshot length in bytes.
    pub snapshot_bytes: u64,
    /// CONN_STATE fragments per copy of the snapshot.
    pub fragments: u16,
    /// TCPMig bytes sent for this migration (UDP payloads, retransmissions included).
    pub wire_bytes_sent: u64,
    /// TCPMig bytes received for this migration.
    pub wire_bytes_received: u64,
    pub retransmissions: u32,
    pub segments_buffered: u32,
    pub bytes_buffered: u64,
    pub segments_dropped: u32,
}

impl Telemetry {
    /// Origin's view of the total: `migrate_out` to CONN_STATE_ACK.
    pub fn total_origin(&self) -> Option<std::time::Duration> {
        Some(self.state_ack_received? - self.started?)
    }
    /// Target's view: PREPARE to import done.
    pub fn total_target(&self) -> Option<std::time::Duration> {
        Some(self.import_done? - self.prepare_received?)
    }
}
