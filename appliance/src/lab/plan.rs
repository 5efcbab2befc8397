//! The lab's address plan: the one place that says which namespace, interface
//! and address every node of the lab gets.
//!
//! Everything lives in the benchmarking range 198.18.0.0/15 (RFC 2544), which
//! no real network uses, and no namespace gets a route outside it:
//!
//! | what                              | address                 |
//! |-----------------------------------|-------------------------|
//! | client `i` (1-based)              | 198.18.0.(10+i)         |
//! | switch, on every client link      | 198.18.0.1              |
//! | switch, on every server link      | 198.18.1.1              |
//! | server `j` management (kernel)    | 198.18.1.(10+j)         |
//! | server `j` data (user-space stack)| 198.18.2.(10+j)         |
//! | service VIPs (owned by switchd)   | 198.18.100.x            |
//!
//! The data address is routed to the server's link by the switch but never
//! assigned to the server's kernel, so the kernel never answers or resets the
//! stack's connections.

use std::net::Ipv4Addr;

/// Most clients a lab can have (addresses .11 ..= .210 of 198.18.0.0/24).
pub const MAX_CLIENTS: u32 = 200;
/// Most servers a lab can have.
pub const MAX_SERVERS: u32 = 200;
/// Longest name prefix: namespace and pin names stay short and readable.
pub const MAX_PREFIX_LEN: usize = 12;

pub const SWITCH_CLIENT_SIDE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub const SWITCH_SERVER_SIDE: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
/// The whole lab range; every lab route points into it.
pub const LAB_NET: (Ipv4Addr, u8) = (Ipv4Addr::new(198, 18, 0, 0), 15);

pub fn client_addr(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, (10 + i) as u8)
}
pub fn server_mgmt_addr(j: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, (10 + j) as u8)
}
pub fn server_data_addr(j: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 2, (10 + j) as u8)
}

/// The role of a lab node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    Switch,
    Client(u32),
    Server(u32),
}

impl Node {
    /// Short name used in namespace names and on the command line: `sw`,
    /// `c1`, `s3`.
    pub fn short(&self) -> String {
        match self {
            Node::Switch => "sw".into(),
            Node::Client(i) => format!("c{i}"),
            Node::Server(j) => format!("s{j}"),
        }
    }

    /// Parses `sw`, `switch`, `cN`, `clientN`, `sN`, `serverN`.
    pub fn parse(s: &str) -> Option<Node> {
        let num = |rest: &str| rest.parse::<u32>().ok().filter(|n| *n >= 1);
        if s == "sw" || s == "switch" {
            return Some(Node::Switch);
        }
        for (p, ctor) in [
            ("client", Node::Client as fn(u32) -> Node),
            ("server", Node::Server),
            ("c", Node::Client),
            ("s", Node::Server),
        ] {
            if let Some(rest) = s.strip_prefix(p) {
                return num(rest).map(ctor);
            }
        }
        None
    }

    /// Interface name of this node's link as seen from the switch namespace.
    pub fn switch_side_iface(&self) -> Option<String> {
        match self {
            Node::Switch => None,
            Node::Client(i) => Some(format!("cl{i}")),
            Node::Server(j) => Some(format!("sv{j}")),
        }
    }
}

/// Interface name inside client and server namespaces.
pub const NODE_IFACE: &str = "eth0";

/// A validated lab shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabPlan {
    pub prefix: String,
    pub clients: u32,
    pub servers: u32,
}

impl LabPlan {
    pub fn namespace(&self, node: Node) -> String {
        format!("{}-{}", self.prefix, node.short())
    }

    pub fn nodes(&self) -> Vec<Node> {
        let mut v = vec![Node::Switch];
        v.extend((1..=self.clients).map(Node::Client));
        v.extend((1..=self.servers).map(Node::Server));
        v
    }
}

/// The bpffs directory where lab tools pin their objects.
pub fn pin_dir(prefix: &str) -> String {
    format!("/sys/fs/bpf/capybara-lab-{prefix}")
}

/// Checks a name prefix: lowercase letters, digits; starts with a letter.
pub fn validate_prefix(p: &str) -> Result<(), String> {
    if p.is_empty() || p.len() > MAX_PREFIX_LEN {
        return Err(format!(
            "invalid lab prefix {p:?}: must be 1 to {MAX_PREFIX_LEN} characters"
        ));
    }
    if !p.starts_with(|c: char| c.is_ascii_lowercase())
        || !p
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    {
        return Err(format!(
            "invalid lab prefix {p:?}: use lowercase letters and digits, starting with a letter"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_follow_the_plan() {
        assert_eq!(client_addr(1), Ipv4Addr::new(198, 18, 0, 11));
        assert_eq!(server_mgmt_addr(3), Ipv4Addr::new(198, 18, 1, 13));
        assert_eq!(server_data_addr(3), Ipv4Addr::new(198, 18, 2, 13));
        assert_eq!(
            server_data_addr(MAX_SERVERS),
            Ipv4Addr::new(198, 18, 2, 210)
        );
    }

    #[test]
    fn node_names_round_trip() {
        for n in [Node::Switch, Node::Client(2), Node::Server(17)] {
            assert_eq!(Node::parse(&n.short()), Some(n));
        }
        assert_eq!(Node::parse("server2"), Some(Node::Server(2)));
        assert_eq!(Node::parse("s0"), None);
        assert_eq!(Node::parse("x1"), None);
    }

    #[test]
    fn prefixes_are_checked() {
        assert!(validate_prefix("cpb").is_ok());
        assert!(validate_prefix("t12345").is_ok());
        assert!(validate_prefix("").is_err());
        assert!(validate_prefix("Bad").is_err());
        assert!(validate_prefix("a-b").is_err());
        assert!(validate_prefix("1abc").is_err());
        assert!(validate_prefix("abcdefghijklm").is_err());
    }
}
