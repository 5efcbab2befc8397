//! Identifiers shared by every component: flows and servers.

use std::net::Ipv4Addr;

/// A TCP connection as the client sees it: client address and port, service
/// address (VIP) and port. Stable across migrations, so it is the key of the
/// flow table, the migration table and the store's flow mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    pub client_ip: Ipv4Addr,
    pub client_port: u16,
    pub service_ip: Ipv4Addr,
    pub service_port: u16,
}

impl std::fmt::Display for FlowKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}->{}:{}",
            self.client_ip, self.client_port, self.service_ip, self.service_port
        )
    }
}

/// A server of the pool, named by a small integer assigned at registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerId(pub u32);

impl std::fmt::Display for ServerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s{}", self.0)
    }
}
