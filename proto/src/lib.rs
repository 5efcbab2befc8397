//! Wire contract shared by hostagent and switchd.
//!
//! `proto` owns every byte layout that crosses a process boundary between
//! Capybara components: TCPMig migration messages (PREPARE, PREPARE-ACK,
//! CONN-STATE, CONN-STATE-ACK, REJECT, ABORT), load notifications sent by the
//! switch's pool monitor, and control-channel messages (registration,
//! heartbeats). Each format is a zero-copy `Packet` view validated once by
//! `new_checked`, plus a `Repr` with `parse`/`emit`/`buffer_len`; no accessor
//! panics after validation. The eBPF C header `proto/include/capybara_proto.h`
//! is tested against the constants defined here (`tests/c_header.rs`).
//! Byte-by-byte documentation: `docs/TCPMIG.md`.

pub mod checksum;
pub mod control;
pub mod flow;
pub mod frag;
pub mod hash;
pub mod load;
pub mod mac;
pub mod tcpmig;
pub mod time;

pub use flow::{FlowKey, ServerId};
pub use mac::{KeyError, MigrationKey, MAC_LEN};
pub use time::Instant;

/// UDP ports of the Capybara protocols (one place for the address plan's
/// port numbers; mirrored as `CAPYBARA_PORT_*` in the C header).
pub mod ports {
    /// TCPMig, between server data addresses through the switch. PREPARE is
    /// addressed to the switch, which picks the target.
    pub const TCPMIG: u16 = 7690;
    /// LOAD-NOTIFICATION, switch -> server data address.
    pub const LOAD: u16 = 7691;
    /// Control channel, server -> switch management address (and replies).
    pub const CONTROL: u16 = 7692;
}
