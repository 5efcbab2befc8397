//! Error values of the socket API.

/// Errors returned by endpoint operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TcpError {
    #[error("operation would block")]
    WouldBlock,
    #[error("no such connection handle")]
    InvalidHandle,
    #[error("connection is closed")]
    Closed,
    #[error("connection reset by peer")]
    Reset,
    #[error("connection refused")]
    Refused,
    #[error("connection timed out")]
    TimedOut,
    #[error("connection aborted locally")]
    Aborted,
    #[error("connection is not established yet")]
    NotConnected,
    #[error("address already in use")]
    AddrInUse,
    #[error("no free local port")]
    NoPorts,
}

/// Why a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// Both FINs exchanged and acknowledged.
    Normal,
    /// The peer sent an acceptable RST.
    Reset,
    /// Our SYN was answered by RST.
    Refused,
    /// Retransmissions, probes or keep-alives went unanswered.
    TimedOut,
    /// The application aborted (RST sent) or closed with unread data.
    Aborted,
}

impl CloseReason {
    /// The error surfaced to later socket calls, if any.
    pub fn error(self) -> Option<TcpError> {
        match self {
            CloseReason::Normal => None,
            CloseReason::Reset => Some(TcpError::Reset),
            CloseReason::Refused => Some(TcpError::Refused),
            CloseReason::TimedOut => Some(TcpError::TimedOut),
            CloseReason::Aborted => Some(TcpError::Aborted),
        }
    }
}
