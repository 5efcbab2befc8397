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

/// Host CPU spent on one migration on one host, in nanoseconds, as measured
/// by the driver (the engine reads no clock): the driver times each call it
/// makes for the migration and adds the time here. Calls are attributed to
/// the migration id of the message they handle or emit.
///
/// Index of `rx_ns` / `tx_ns` by message kind: 0 PREPARE, 1 PREPARE_ACK,
/// 2 CONN_STATE, 3 CONN_STATE_ACK, 4 REJECT/ABORT. On the origin, receiving
/// the PREPARE_ACK includes the export (the connection is frozen and
/// snapshotted before the next packet); on the target, receiving the last
/// CONN_STATE fragment includes the import and the replay of buffered
/// segments. Not included: the device's batched receive and transmit calls
/// and the UDP checksum, which are shared with the rest of the batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostCpu {
    /// `migrate_out` (origin): the PREPARE is queued.
    pub start_ns: u64,
    /// Handling received TCPMig datagrams, by kind (decode, MAC check,
    /// reassembly, and what they trigger: export, import, replay).
    pub rx_ns: [u64; 5],
    /// Encoding TCPMig datagrams for transmission, by kind (header, MAC,
    /// fragment copy), retransmissions included.
    pub tx_ns: [u64; 5],
    pub rx_messages: u32,
    pub tx_messages: u32,
}

impl HostCpu {
    /// The slot of a message kind in `rx_ns` / `tx_ns`.
    pub fn slot(kind: Option<capybara_proto::tcpmig::Kind>) -> usize {
        use capybara_proto::tcpmig::Kind;
        match kind {
            Some(Kind::Prepare) => 0,
            Some(Kind::PrepareAck) => 1,
            Some(Kind::ConnState) => 2,
            Some(Kind::ConnStateAck) => 3,
            _ => 4,
        }
    }

    pub fn total_ns(&self) -> u64 {
        self.start_ns + self.rx_ns.iter().sum::<u64>() + self.tx_ns.iter().sum::<u64>()
    }

    /// Appends ` cpu_start_ns=N cpu_rx_ns=a,b,c,d,e cpu_tx_ns=...
    /// rx_msgs=N tx_msgs=N` (the telemetry dump format, docs/BENCHMARKS.md).
    pub fn write_kv(&self, out: &mut String) {
        use std::fmt::Write;
        let [a, b, c, d, e] = self.rx_ns;
        let [f, g, h, i, j] = self.tx_ns;
        let _ = write!(
            out,
            " cpu_start_ns={} cpu_rx_ns={a},{b},{c},{d},{e} cpu_tx_ns={f},{g},{h},{i},{j} rx_msgs={} tx_msgs={}",
            self.start_ns, self.rx_messages, self.tx_messages
        );
    }
}

impl Telemetry {
    /// Appends the timestamps (microseconds of the host's clock, `-` when
    /// not reached) and volumes as ` key=value` pairs (the telemetry dump
    /// format, docs/BENCHMARKS.md).
    pub fn write_kv(&self, out: &mut String) {
        use std::fmt::Write;
        for (k, v) in [
            ("started", self.started),
            ("prepare_sent", self.prepare_sent),
            ("prepare_ack_received", self.prepare_ack_received),
            ("export_done", self.export_done),
            ("state_sent", self.state_sent),
            ("state_ack_received", self.state_ack_received),
            ("prepare_received", self.prepare_received),
            ("state_received", self.state_received),
            ("import_done", self.import_done),
            ("replayed", self.replayed),
        ] {
            match v {
                Some(t) => {
                    let _ = write!(out, " {k}={}", t.as_micros());
                }
                None => {
                    let _ = write!(out, " {k}=-");
                }
            }
        }
        let _ = write!(
            out,
            " snapshot_bytes={} fragments={} wire_sent={} wire_received={} retransmissions={} \
             segments_buffered={} bytes_buffered={} segments_dropped={}",
            self.snapshot_bytes,
            self.fragments,
            self.wire_bytes_sent,
            self.wire_bytes_received,
            self.retransmissions,
            self.segments_buffered,
            self.bytes_buffered,
            self.segments_dropped
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dump format the benchmark parses: every key present once,
    /// unreached phases as `-`, CPU lists in kind order.
    #[test]
    fn dump_line_names_every_field() {
        let t = Telemetry {
            started: Some(Instant::from_micros(10)),
            prepare_sent: Some(Instant::from_micros(12)),
            snapshot_bytes: 158,
            fragments: 1,
            ..Telemetry::default()
        };
        let mut cpu = HostCpu {
            start_ns: 300,
            ..HostCpu::default()
        };
        cpu.rx_ns[HostCpu::slot(Some(capybara_proto::tcpmig::Kind::PrepareAck))] += 1700;
        cpu.tx_ns[HostCpu::slot(Some(capybara_proto::tcpmig::Kind::ConnState))] += 500;
        cpu.tx_ns[HostCpu::slot(None)] += 1;
        let mut line = String::new();
        t.write_kv(&mut line);
        cpu.write_kv(&mut line);
        let kv: std::collections::HashMap<&str, &str> = line
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .collect();
        assert_eq!(kv.len(), line.split_whitespace().count(), "{line}");
        assert_eq!(kv["started"], "10");
        assert_eq!(kv["prepare_sent"], "12");
        assert_eq!(kv["state_ack_received"], "-");
        assert_eq!(kv["import_done"], "-");
        assert_eq!(kv["snapshot_bytes"], "158");
        assert_eq!(kv["cpu_start_ns"], "300");
        assert_eq!(kv["cpu_rx_ns"], "0,1700,0,0,0");
        assert_eq!(kv["cpu_tx_ns"], "0,0,500,0,1");
        assert_eq!(cpu.total_ns(), 2501);
        assert_eq!(t.total_origin(), None);
    }
}
