//! Sans-IO TCP for the Capybara stack: the TCP wire format and the connection
//! state machine (handshake with options, RFC 6298 retransmission, fast
//! retransmit, SACK, flow and congestion control, every closing state). It
//! takes segments and `now`, and yields segments, timers and socket events;
//! it never reads a clock or a socket.
//!
//! - `wire`: header view `TcpPacket` and `TcpRepr` (no panic after `new_checked`).
//! - `conn`: one connection's complete state (plain structs, `PartialEq`) and
//!   its state machine.
//! - `endpoint`: listeners, many connections, handle-based socket API,
//!   `handle_segment` / `poll_transmit` / `poll_timeout` / `handle_timeout`.
//! - `buffer`: pre-sized rings and interval lists (no per-packet allocation).

pub mod buffer;
pub mod config;
pub mod conn;
pub mod counters;
pub mod endpoint;
pub mod error;
pub mod isn;
pub mod seq;
pub mod snapshot;
pub mod wire;

pub use capybara_proto::time::{Duration, Instant};
pub use config::{KeepAlive, TcpConfig};
pub use conn::{Connection, State};
pub use counters::{Counters, DropCounters};
pub use endpoint::{ConnId, ConnInfo, ConnLoad, Endpoint, Event, Imported, PeerReset, Transmit};
pub use error::{CloseReason, TcpError};
pub use seq::SeqNum;
pub use snapshot::{Snapshot, SnapshotError, SnapshotView};
pub use wire::{TcpOptions, TcpPacket, TcpRepr, WireError};
