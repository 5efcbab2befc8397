//! Endpoint-wide counters (plain integers; exported by the agent's metrics).

/// Cumulative counters of one endpoint.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counters {
    pub segments_in: u64,
    pub segments_out: u64,
    pub drops: DropCounters,
    /// Segments resent after a retransmission timeout.
    pub retransmits_timeout: u64,
    /// Segments resent by fast retransmit / SACK loss recovery.
    pub retransmits_fast: u64,
    pub resets_sent: u64,
    pub resets_received: u64,
    pub challenge_acks: u64,
    pub zero_window_probes: u64,
    pub keepalive_probes: u64,
    pub connections_passive: u64,
    pub connections_active: u64,
    pub connections_timed_out: u64,
}

/// Segments dropped, by reason.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DropCounters {
    pub bad_checksum: u64,
    /// Header or options could not be parsed.
    pub malformed: u64,
    /// No connection and no listener on the port.
    pub no_listener: u64,
    /// Sequence number outside the receive window (RFC 9293 §3.10.7.4).
    pub out_of_window: u64,
    /// Timestamp older than TS.Recent (RFC 7323 PAWS).
    pub paws: u64,
    /// SYN refused because the SYN or accept queue was full.
    pub backlog_full: u64,
    /// ACK for data never sent, or far behind SND.UNA (RFC 5961 §5).
    pub bad_ack: u64,
    /// Out-of-order segment refused because the interval list was full.
    pub reassembly_full: u64,
    /// Segment without ACK in a synchronized state, or otherwise unusable.
    pub unexpected: u64,
    /// RSTs the RST queue had no room for.
    pub rst_queue_full: u64,
    /// Non-SYN segments for a tuple closed from LAST-ACK moments ago
    /// (stale duplicates; dropped instead of reset, `endpoint::CLOSED_LINGER`).
    pub recently_closed: u64,
    /// Non-SYN segments for unknown connections dropped instead of reset
    /// while resets are held ([`crate::Endpoint::hold_resets_until`]: the
    /// switch is rebuilding its flow mappings after losing them).
    pub reset_held: u64,
}
