//! A throw-away network namespace for tests that need real interfaces
//! (BPF_PROG_TEST_RUN resolves ingress and devmap ifindexes in the caller's
//! namespace). The calling thread enters it; dropping the guard returns the
//! thread to its namespace and deletes the namespace, also on panic.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static SEQ: AtomicU32 = AtomicU32::new(0);

pub struct TestNetns {
    pub name: String,
    home: File,
}

fn ip(args: &[&str]) -> std::io::Result<String> {
    let out = Command::new("ip").args(args).output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl TestNetns {
    /// Creates `capy-sw-<pid>-<n>` with veth interfaces `names` (up; peers `<name>p`) and
    /// moves the calling thread into it.
    pub fn enter(names: &[&str]) -> std::io::Result<Self> {
        let name = format!(
            "capy-sw-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        );
        let home = File::open("/proc/thread-self/ns/net")?;
        ip(&["netns", "add", &name])?;
        let guard = TestNetns { name, home };
        for n in names {
            // veth rather than dummy: always built into test kernels.
            let peer = format!("{n}p");
            ip(&[
                "-n",
                &guard.name,
                "link",
                "add",
                n,
                "type",
                "veth",
                "peer",
                "name",
                &peer,
            ])?;
            ip(&["-n", &guard.name, "link", "set", n, "up"])?;
            ip(&["-n", &guard.name, "link", "set", &peer, "up"])?;
        }
        let f = File::open(format!("/run/netns/{}", guard.name))?;
        // SAFETY: plain syscall on valid fds; affects this thread only.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(guard)
    }

    /// ifindex of an interface of this namespace.
    pub fn ifindex(&self, dev: &str) -> std::io::Result<u32> {
        let out = ip(&["-n", &self.name, "-o", "link", "show", "dev", dev])?;
        out.split(':')
            .next()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no ifindex for {dev}: {out}")))
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::setns(self.home.as_raw_fd(), libc::CLONE_NEWNET) };
        let _ = ip(&["netns", "del", &self.name]);
    }
}
