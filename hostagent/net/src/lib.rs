//! The link and network layers of the Capybara stack and the I/O backends:
//! Ethernet, ARP, IPv4 and ICMP echo (sans-IO, driven with `now`), and the
//! batched device trait with its AF_PACKET, DPDK and in-memory backends.

pub mod iface;
pub mod wire;

pub use iface::{
    Counters, DropReason, Interface, InterfaceConfig, Ipv4Out, NoTransport, Transport, HEADER_ROOM,
};
