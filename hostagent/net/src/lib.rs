//! The link and network layers of the Capybara stack and the I/O backends:
//! Ethernet, ARP, IPv4 and ICMP echo (sans-IO, driven with `now`), and the
//! batched device trait with its AF_PACKET, DPDK and in-memory backends.
