//! The link and network layers of the Capybara stack and the I/O backends:
//! Ethernet, ARP, IPv4 and ICMP echo (sans-IO, driven with `now`), and the
//! batched device trait with its AF_PACKET, DPDK and in-memory backends.
//!
//! - [`wire`]: byte layouts (zero-copy views + reprs; no panics after
//!   `new_checked`).
//! - [`iface`]: the sans-IO [`Interface`] (ARP, ICMP echo, IPv4 in/out) and
//!   the [`Transport`] trait the TCP engine plugs into.
//! - [`device`]: batched frame I/O ([`device::Device`]) and its backends.
//! - [`latency`]: a fixed-size latency histogram for debug counters.
//! - [`driver`]: the loop that connects a device to an interface; the only
//!   code here that reads a clock.

pub mod device;
pub mod driver;
pub mod iface;
pub mod latency;
pub mod wire;

pub use device::{Device, DeviceError, PollMode};
pub use iface::{
    Counters, DropReason, Interface, InterfaceConfig, Ipv4Out, NoTransport, Transport, HEADER_ROOM,
};
