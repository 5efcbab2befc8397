//! Wire contract shared by hostagent and switchd.
//!
//! `proto` owns every byte layout that crosses a process boundary between
//! Capybara components: TCPMig migration messages (PREPARE, PREPARE-ACK,
//! CONN-STATE, CONN-STATE-ACK, REJECT, ABORT), load notifications sent by the
//! switch's pool monitor, and control-channel messages (registration,
//! heartbeats). Each format is a zero-copy `Packet` view validated once by
//! `new_checked`, plus a `Repr` with `parse`/`emit`/`buffer_len`; no accessor
//! panics after validation. The eBPF C headers of switchd are tested against
//! the constants defined here.

pub mod checksum;
pub mod flow;
pub mod time;

pub use flow::{FlowKey, ServerId};
pub use time::Instant;
