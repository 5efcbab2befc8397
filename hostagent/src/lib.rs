//! The per-server agent: a kernel-bypass, sans-IO TCP/IP stack with TCPMig.
//!
//! `hostagent` owns everything that runs on a server: the user-space stack
//! (Ethernet, ARP, IPv4, ICMP echo in `capybara-net`; TCP in `capybara-tcp`)
//! that takes packets and the current time and yields packets, timers and
//! socket events without ever reading a clock or a socket; the I/O backends
//! that move frames (AF_PACKET, DPDK, an in-memory link for deterministic
//! tests); the single-threaded runtime that drives them ([`stack`]); the
//! socket-compatible API and its async flavour ([`socket`]); the built-in
//! echo and HTTP services ([`apps`]); and, as they land, connection
//! export/import with the TCPMig origin/target state machines, the sidecar
//! proxy with its protocol connection managers, the server monitor and the
//! migration policies.

pub mod apps;
pub mod config;
pub mod control;
pub mod drain;
pub mod health;
pub mod metrics;
pub mod migration;
pub mod monitor;
pub mod policy;
pub mod sidecar;
pub mod socket;
pub mod stack;

pub use socket::{TcpListener, TcpStream};
pub use stack::Stack;
