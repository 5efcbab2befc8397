//! Endpoint configuration. Defaults follow Linux where a Linux peer would
//! notice a difference (initial window 10, min RTO 200 ms, 40 ms delayed ACK).

use capybara_proto::time::Duration;

/// Keep-alive probing of an idle established connection (RFC 1122 §4.2.3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepAlive {
    /// Idle time before the first probe.
    pub idle: Duration,
    /// Time between unanswered probes.
    pub interval: Duration,
    /// Unanswered probes before the connection is aborted.
    pub probes: u32,
}

impl Default for KeepAlive {
    fn default() -> Self {
        KeepAlive {
            idle: Duration::from_secs(7200),
            interval: Duration::from_secs(75),
            probes: 9,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// MSS we announce and the largest payload we send.
    pub mss: u16,
    pub rx_buffer: usize,
    pub tx_buffer: usize,
    pub window_scaling: bool,
    pub sack: bool,
    pub timestamps: bool,
    pub initial_rto: Duration,
    pub min_rto: Duration,
    pub max_rto: Duration,
    /// Retransmissions of data/FIN before the connection is aborted (TimedOut).
    pub max_retries: u32,
    /// Retransmissions of our SYN (active open).
    pub syn_retries: u32,
    /// Retransmissions of our SYN-ACK (passive open).
    pub synack_retries: u32,
    pub delayed_ack: Duration,
    /// TIME-WAIT duration (2*MSL).
    pub time_wait: Duration,
    /// How long an orphaned (closed by the application) connection may sit
    /// in FIN-WAIT-2.
    pub fin_wait2_timeout: Duration,
    pub keepalive: Option<KeepAlive>,
    /// Half-open connections per listener.
    pub syn_backlog: usize,
    /// Established, not yet accepted connections per listener.
    pub accept_backlog: usize,
    /// Initial congestion window in segments (RFC 6928).
    pub initial_cwnd_segments: u32,
    /// Secret of the RFC 6528 ISN hash; draw it from a CSPRNG at startup.
    pub isn_key: [u8; 16],
    /// Answer segments for unknown connections with RST (RFC 9293 §3.10.7.1).
    pub rst_unknown: bool,
    /// Verify checksums of incoming segments (off when the NIC did it).
    pub verify_checksum: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            mss: 1460,
            rx_buffer: 256 * 1024,
            tx_buffer: 256 * 1024,
            window_scaling: true,
            sack: true,
            timestamps: true,
            initial_rto: Duration::from_secs(1),
            min_rto: Duration::from_millis(200),
            max_rto: Duration::from_secs(120),
            max_retries: 15,
            syn_retries: 6,
            synack_retries: 5,
            delayed_ack: Duration::from_millis(40),
            time_wait: Duration::from_secs(60),
            fin_wait2_timeout: Duration::from_secs(60),
            keepalive: None,
            syn_backlog: 256,
            accept_backlog: 128,
            initial_cwnd_segments: 10,
            isn_key: [0; 16],
            rst_unknown: true,
            verify_checksum: true,
        }
    }
}
