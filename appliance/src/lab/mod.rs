//! `capybara lab`: a lab of network namespaces joined by veth pairs, in which
//! clients, the switch and servers each have their own network stack.
//!
//! Invariants:
//! - every namespace the lab creates is named `PREFIX-NODE` (see [`plan`]), so
//!   `down` finds everything by name alone, also after the process that built
//!   the lab crashed; nothing else is created outside those namespaces except
//!   the bpffs pin directory [`plan::pin_dir`], which `down` removes;
//! - `up` is idempotent: it creates what is missing and leaves what exists;
//!   when it fails halfway it removes everything of that prefix, so a failed
//!   `up` leaves nothing half-built;
//! - no namespace gets a route outside 198.18.0.0/15.

pub mod fault;
pub mod plan;
mod xdp;

use plan::{LabPlan, Node, NODE_IFACE};
use std::process::Command;

/// An error from a lab operation, naming the command that failed.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("`{cmd}` failed: {stderr}")]
    Command { cmd: String, stderr: String },
    #[error("cannot run `{cmd}`: {source}")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
}

/// Runs a command, returning its stdout or an error with its stderr.
pub(crate) fn run(args: &[&str]) -> Result<String, LabError> {
    let cmd = args.join(" ");
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|source| LabError::Spawn {
            cmd: cmd.clone(),
            source,
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(LabError::Command {
            cmd,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Names of the existing namespaces that belong to the lab with `prefix`.
pub fn lab_namespaces(prefix: &str) -> Result<Vec<String>, LabError> {
    let out = run(&["ip", "netns", "list"])?;
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| {
            name.strip_prefix(prefix)
                .and_then(|r| r.strip_prefix('-'))
                .and_then(Node::parse)
                .is_some()
        })
        .map(str::to_string)
        .collect();
    v.sort();
    Ok(v)
}

fn ns_exists(existing: &[String], ns: &str) -> bool {
    existing.iter().any(|e| e == ns)
}

fn link_exists(ns: &str, iface: &str) -> bool {
    run(&["ip", "-n", ns, "link", "show", "dev", iface]).is_ok()
}

/// Builds (or completes) the lab. On failure everything of the prefix is
/// removed again.
pub fn up(plan: &LabPlan) -> Result<(), LabError> {
    match build(plan) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = down(&plan.prefix);
            Err(e)
        }
    }
}

fn build(plan: &LabPlan) -> Result<(), LabError> {
    let existing = lab_namespaces(&plan.prefix)?;
    let wanted: Vec<String> = plan.nodes().iter().map(|n| plan.namespace(*n)).collect();
    // Nodes of an earlier, larger lab with the same prefix go away.
    for ns in existing.iter().filter(|e| !wanted.contains(e)) {
        delete_namespace(ns)?;
    }
    for node in plan.nodes() {
        let ns = plan.namespace(node);
        if !ns_exists(&existing, &ns) {
            run(&["ip", "netns", "add", &ns])?;
        }
        run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        let forward = if node == Node::Switch { "1" } else { "0" };
        // IPv6 off: no router solicitations or DAD noise in captures and
        // counters. Forwarding only in the switch. rp_filter off because the
        // switch sees asymmetric paths once connections migrate.
        let script = format!(
            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; \
             echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; \
             echo {forward} > /proc/sys/net/ipv4/ip_forward; \
             echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter; \
             echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter; \
             echo 0 > /proc/sys/net/ipv4/conf/all/send_redirects; \
             echo 0 > /proc/sys/net/ipv4/conf/default/send_redirects"
        );
        run(&["ip", "netns", "exec", &ns, "sh", "-c", &script])?;
    }
    let sw = plan.namespace(Node::Switch);
    for node in plan.nodes().into_iter().filter(|n| *n != Node::Switch) {
        let ns = plan.namespace(node);
        let sw_if = node
            .switch_side_iface()
            .expect("non-switch node has a link");
        if !(link_exists(&sw, &sw_if) && link_exists(&ns, NODE_IFACE)) {
            // A half-present pair (one end deleted by hand) is rebuilt whole.
            let _ = run(&["ip", "-n", &sw, "link", "del", &sw_if]);
            let _ = run(&["ip", "-n", &ns, "link", "del", NODE_IFACE]);
            run(&[
                "ip", "link", "add", "name", &sw_if, "netns", &sw, "type", "veth", "peer", "name",
                NODE_IFACE, "netns", &ns,
            ])?;
        }
        for (n, dev) in [(&sw, sw_if.as_str()), (&ns, NODE_IFACE)] {
            // User-space stacks read raw frames: they need real checksums and
            // MTU-sized frames, not offloaded partial checksums or GSO blobs.
            let _ = run(&[
                "ip", "netns", "exec", n, "ethtool", "-K", dev, "rx", "off", "tx", "off", "tso",
                "off", "gso", "off", "gro", "off",
            ]);
            run(&["ip", "-n", n, "link", "set", dev, "up"])?;
        }
        xdp::attach_pass(&ns, NODE_IFACE)?;
        let (sw_addr, node_addr) = match node {
            Node::Client(i) => (plan::SWITCH_CLIENT_SIDE, plan::client_addr(i)),
            Node::Server(j) => (plan::SWITCH_SERVER_SIDE, plan::server_mgmt_addr(j)),
            Node::Switch => unreachable!(),
        };
        let h = |a: std::net::Ipv4Addr| format!("{a}/32");
        run(&[
            "ip",
            "-n",
            &sw,
            "addr",
            "replace",
            &h(sw_addr),
            "dev",
            &sw_if,
        ])?;
        run(&[
            "ip",
            "-n",
            &sw,
            "route",
            "replace",
            &h(node_addr),
            "dev",
            &sw_if,
        ])?;
        if let Node::Server(j) = node {
            let data = h(plan::server_data_addr(j));
            run(&["ip", "-n", &sw, "route", "replace", &data, "dev", &sw_if])?;
        }
        run(&[
            "ip",
            "-n",
            &ns,
            "addr",
            "replace",
            &h(node_addr),
            "dev",
            NODE_IFACE,
        ])?;
        run(&[
            "ip",
            "-n",
            &ns,
            "route",
            "replace",
            &h(sw_addr),
            "dev",
            NODE_IFACE,
        ])?;
        let lab_net = format!("{}/{}", plan::LAB_NET.0, plan::LAB_NET.1);
        run(&[
            "ip",
            "-n",
            &ns,
            "route",
            "replace",
            &lab_net,
            "via",
            &sw_addr.to_string(),
            "dev",
            NODE_IFACE,
            "src",
            &node_addr.to_string(),
        ])?;
    }
    Ok(())
}

/// Stops every process in `ns` and deletes it (its interfaces and the eBPF
/// programs attached to them go with it).
fn delete_namespace(ns: &str) -> Result<(), LabError> {
    kill_namespace_processes(ns);
    // Detach tc programs (fault injectors) first: namespace teardown is
    // asynchronous in the kernel, and `down` promises that no program of the
    // lab is left when it returns.
    if let Ok(links) = run(&["ip", "-n", ns, "-o", "link", "show"]) {
        for dev in links.lines().filter_map(|l| l.split(':').nth(1)) {
            let dev = dev.trim().split('@').next().unwrap_or("");
            if !dev.is_empty() && dev != "lo" {
                let _ = run(&["tc", "-n", ns, "qdisc", "del", "dev", dev, "clsact"]);
            }
        }
    }
    run(&["ip", "netns", "del", ns]).map(|_| ())
}

fn kill_namespace_processes(ns: &str) {
    let pids = |ns: &str| -> Vec<i32> {
        run(&["ip", "netns", "pids", ns])
            .map(|o| o.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    };
    for sig in [libc::SIGTERM, libc::SIGKILL] {
        let p = pids(ns);
        if p.is_empty() {
            return;
        }
        for pid in &p {
            // SAFETY: plain kill(2) on a pid we just listed.
            unsafe { libc::kill(*pid, sig) };
        }
        for _ in 0..50 {
            if pids(ns).is_empty() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// Removes everything the lab with `prefix` created. Safe to run when the lab
/// does not exist or was half-built by a crashed process.
pub fn down(prefix: &str) -> Result<Vec<String>, LabError> {
    plan::validate_prefix(prefix).map_err(LabError::Invalid)?;
    let namespaces = lab_namespaces(prefix)?;
    let mut first_err = None;
    for ns in &namespaces {
        if let Err(e) = delete_namespace(ns) {
            first_err.get_or_insert(e);
        }
    }
    let pins = plan::pin_dir(prefix);
    if std::path::Path::new(&pins).exists() {
        if let Err(e) = std::fs::remove_dir_all(&pins) {
            first_err.get_or_insert(LabError::Invalid(format!("cannot remove {pins}: {e}")));
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(namespaces),
    }
}

/// A human-readable description of the lab's nodes and addresses.
pub fn status(prefix: &str) -> Result<String, LabError> {
    let namespaces = lab_namespaces(prefix)?;
    if namespaces.is_empty() {
        return Ok(format!(
            "lab {prefix}: down (no namespace named {prefix}-*)\n"
        ));
    }
    let mut s = format!("lab {prefix}: {} namespaces\n", namespaces.len());
    for ns in &namespaces {
        let addrs = run(&["ip", "-n", ns, "-br", "-4", "addr", "show"]).unwrap_or_default();
        let pids = run(&["ip", "netns", "pids", ns]).unwrap_or_default();
        s.push_str(&format!("  {ns} ({} processes)\n", pids.lines().count()));
        for l in addrs.lines().filter(|l| !l.starts_with("lo ")) {
            s.push_str(&format!(
                "    {}\n",
                l.split_whitespace().collect::<Vec<_>>().join(" ")
            ));
        }
    }
    Ok(s)
}

/// Runs `f` on a thread that has entered network namespace `ns`, so that
/// netlink and ifindex lookups see that namespace.
pub(crate) fn in_namespace<T: Send>(
    ns: &str,
    f: impl FnOnce() -> Result<T, LabError> + Send,
) -> Result<T, LabError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let path = format!("/run/netns/{ns}");
            let file = std::fs::File::open(&path)
                .map_err(|e| LabError::Invalid(format!("no lab namespace {ns}: {e}")))?;
            use std::os::fd::AsRawFd;
            // SAFETY: setns on a valid namespace fd affects only this thread,
            // which ends when the closure returns.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(LabError::Invalid(format!(
                    "cannot enter namespace {ns}: {}",
                    std::io::Error::last_os_error()
                )));
            }
            f()
        })
        .join()
        .map_err(|_| LabError::Invalid("namespace worker thread panicked".into()))?
    })
}

pub(crate) fn ifindex(iface: &str, ns: &str) -> Result<i32, LabError> {
    let c = std::ffi::CString::new(iface)
        .map_err(|_| LabError::Invalid(format!("invalid interface name {iface:?}")))?;
    // SAFETY: c is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(LabError::Invalid(format!(
            "no interface {iface} in namespace {ns}"
        )));
    }
    Ok(idx as i32)
}

pub(crate) fn bpf_err(what: &str) -> impl Fn(libbpf_rs::Error) -> LabError + '_ {
    move |e| LabError::Invalid(format!("{what}: {e}"))
}
