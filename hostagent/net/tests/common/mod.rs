//! Lab helpers for tests that need real interfaces: two network namespaces
//! ("server" and "switch") joined by a veth pair, removed on drop even when
//! the test panics.

#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::process::{Command, Output};

pub const SERVER_MGMT: &str = "198.18.1.11/24";
pub const SWITCH_ADDR: &str = "198.18.1.1/24";
pub const SWITCH_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
pub const DATA_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 11);

fn run(args: &[&str]) -> Output {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("running {args:?}: {e}"))
}

pub fn must(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Why the lab cannot run here, if it cannot (not root, no `ip`).
pub fn lab_unavailable() -> Option<String> {
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("needs iproute2".into()),
    }
}

/// The two namespaces; deleting them deletes the veth pair too.
pub struct Lab {
    pub server: String,
    pub switch: String,
}

impl Lab {
    /// `tag` keeps concurrent tests in one process apart; the pid keeps
    /// concurrent processes apart.
    pub fn new(tag: &str) -> Lab {
        let pid = std::process::id();
        let lab = Lab {
            server: format!("nettest-{pid}-{tag}-s"),
            switch: format!("nettest-{pid}-{tag}-w"),
        };
        // Leftovers of a crashed earlier run with the same pid would make
        // `add` fail; they are ours by name.
        lab.delete();
        must(&["ip", "netns", "add", &lab.server]);
        must(&["ip", "netns", "add", &lab.switch]);
        let (s, w) = (lab.server.as_str(), lab.switch.as_str());
        must(&[
            "ip", "-n", s, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns",
            w,
        ]);
        for ns in [s, w] {
            // IPv6 autoconfiguration chatter is noise for these tests.
            must(&[
                "ip",
                "netns",
                "exec",
                ns,
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
            ]);
            must(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        // A new namespace inherits ip_forward from the initial one (often 1
        // on container hosts). A forwarding server kernel answers every
        // packet for the stack's data address with ICMP unreachable, which
        // makes Linux clients abort connects in SYN-SENT. A non-forwarding
        // one drops them silently.
        must(&[
            "ip",
            "netns",
            "exec",
            s,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=0",
        ]);
        must(&["ip", "-n", s, "addr", "add", SERVER_MGMT, "dev", "eth0"]);
        must(&["ip", "-n", w, "addr", "add", SWITCH_ADDR, "dev", "eth0"]);
        for ns in [s, w] {
            must(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
        }
        // The switch reaches data addresses directly on the link.
        must(&[
            "ip",
            "-n",
            w,
            "route",
            "add",
            "198.18.2.0/24",
            "dev",
            "eth0",
        ]);
        lab
    }

    pub fn mac_of(&self, ns: &str) -> String {
        let out = must(&["ip", "-n", ns, "-o", "link", "show", "eth0"]);
        out.split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .unwrap_or_default()
            .to_string()
    }

    fn delete(&self) {
        for ns in [&self.server, &self.switch] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.delete();
    }
}

/// Moves the calling thread into namespace `name`.
pub fn enter_netns(name: &str) -> std::io::Result<()> {
    let f = std::fs::File::open(format!("/var/run/netns/{name}"))?;
    use std::os::fd::AsRawFd;
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
