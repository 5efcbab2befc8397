//! The per-server agent: a kernel-bypass, sans-IO TCP/IP stack with TCPMig.
//!
//! `hostagent` owns everything that runs on a server: the user-space stack
//! (Ethernet, ARP, IPv4, ICMP echo, TCP) that takes packets and the current
//! time and yields packets, timers and socket events without ever reading a
//! clock or a socket; the I/O backends that move frames (AF_PACKET, DPDK, an
//! in-memory link for deterministic tests); the socket-compatible API and its
//! async flavour; connection export/import and the TCPMig origin/target state
//! machines; the sidecar proxy with its protocol connection managers; the
//! server monitor and the migration policies.
