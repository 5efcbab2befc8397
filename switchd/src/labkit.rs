//! Support for the lab test (`tests/lab.rs`) and the failover benchmark
//! (`bench-failover`): not used by the daemon.
//!
//! It builds a lab with `capybara lab up`, runs switchd in the switch
//! namespace, and plays the servers with a **kernel stand-in** until the
//! user-space stack replaces it:
//! - the server's data address is assigned to its kernel (test only: the
//!   real data address belongs to the user-space stack), so it answers ARP
//!   and receives LOAD-NOTIFICATIONs;
//! - the VIP is on the server's `lo`, and an nftables rule at prerouting
//!   rewrites the destination of TCP to the data address back to the VIP,
//!   statelessly (notrack), so the kernel's listener answers *from the VIP*
//!   as the real stack does (a conntrack DNAT would un-NAT the replies);
//! - a registration helper speaks the control channel (REGISTER, then
//!   HEARTBEAT every 100 ms until told to stop) from the management address.
//!
//! Every resource is released by `Drop` (switchd processes killed, lab
//! torn down), also when a test panics.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use capybara_proto::control::{ControlBody, ControlRepr, Heartbeat, Register, ServiceList};
use capybara_proto::{MigrationKey, ServerId};

pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 1);
pub const SWITCH_SV: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
pub const KEY_HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

pub fn client_addr(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, (10 + i) as u8)
}
pub fn mgmt_addr(j: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, (10 + j) as u8)
}
pub fn data_addr(j: u32) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 2, (10 + j) as u8)
}

fn sh(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `f` on a thread inside network namespace `ns` (sockets created
/// there stay in that namespace wherever they are used later).
pub fn in_ns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> anyhow::Result<T> {
    let path = format!("/run/netns/{ns}");
    let h = std::thread::spawn(move || -> anyhow::Result<T> {
        let fd = std::fs::File::open(&path)?;
        // SAFETY: plain syscall on a valid fd; affects this thread only.
        anyhow::ensure!(
            unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } == 0,
            "setns {path}: {}",
            std::io::Error::last_os_error()
        );
        Ok(f())
    });
    h.join()
        .map_err(|_| anyhow::anyhow!("thread in {ns} panicked"))?
}

/// The `capybara` binary (for `lab up` / `lab down`): `CAPYBARA_BIN`, else
/// `CAPYBARA_BIN_DIR/capybara` (as the system tests), else the workspace's
/// `target/release` (what `make setup` builds), else `target/debug`.
pub fn capybara_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("CAPYBARA_BIN") {
        return PathBuf::from(p);
    }
    if let Some(d) = std::env::var_os("CAPYBARA_BIN_DIR") {
        return PathBuf::from(d).join("capybara");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let release = target.join("release/capybara");
    if release.exists() {
        return release;
    }
    target.join("debug/capybara")
}

/// Whether the namespace lab tests can run: `Err` with the reason when this
/// is not root (they are skipped then); a missing `capybara` binary is a
/// failure, not a skip, so that a suite run as root never passes them
/// without running them.
pub fn lab_available() -> Result<(), String> {
    if !is_root() {
        return Err("needs root (network namespaces, XDP)".into());
    }
    let bin = capybara_bin();
    assert!(
        bin.exists(),
        "{} missing: build the appliance (`make setup` or `cargo build --release -p capybara-appliance`) or set CAPYBARA_BIN",
        bin.display()
    );
    Ok(())
}

pub fn is_root() -> bool {
    // SAFETY: no arguments, no memory.
    unsafe { libc::geteuid() == 0 }
}

/// A lab with `servers` servers and one client; torn down on drop.
pub struct Lab {
    /// `store = ...` for switchd configs (default: SQLite in `dir`).
    pub store: Option<String>,
    pub prefix: String,
    pub dir: PathBuf,
    switchds: Vec<Child>,
    stop: Arc<AtomicBool>,
    /// `ha.pin_dir` of the switchds this lab starts: unique to the lab,
    /// removed with it (pins a SIGKILLed switchd left included).
    pub pin_dir: String,
}

impl Lab {
    pub fn up(tag: &str, servers: u32) -> anyhow::Result<Lab> {
        let prefix = format!("{tag}{}", std::process::id() % 1_000_000);
        let dir = std::env::temp_dir().join(format!("capy-switchd-{prefix}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let lab = Lab {
            store: None,
            pin_dir: format!("/sys/fs/bpf/capy-switchd-{prefix}"),
            prefix,
            dir,
            switchds: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let bin = capybara_bin();
        sh(&[
            bin.to_str().unwrap_or("capybara"),
            "lab",
            "up",
            "--prefix",
            &lab.prefix,
            "--servers",
            &servers.to_string(),
        ])?;
        std::fs::write(lab.dir.join("key"), KEY_HEX)?;
        for j in 1..=servers {
            lab.stand_in_server(j)?;
        }
        Ok(lab)
    }

    pub fn ns(&self, node: &str) -> String {
        format!("{}-{node}", self.prefix)
    }

    fn stand_in_server(&self, j: u32) -> anyhow::Result<()> {
        let ns = self.ns(&format!("s{j}"));
        let data = data_addr(j).to_string();
        sh(&[
            "ip",
            "-n",
            &ns,
            "addr",
            "replace",
            &format!("{data}/32"),
            "dev",
            "eth0",
        ])?;
        sh(&[
            "ip",
            "-n",
            &ns,
            "addr",
            "replace",
            &format!("{VIP}/32"),
            "dev",
            "lo",
        ])?;
        let rules = format!(
            "table ip capylab {{\n chain pre {{\n  type filter hook prerouting priority -300;\n  \
             ip daddr {data} tcp dport 80 ip daddr set {VIP} notrack\n }}\n \
             chain out {{\n  type filter hook output priority -300;\n  ip saddr {VIP} tcp sport 80 notrack\n }}\n}}\n"
        );
        let f = self.dir.join(format!("s{j}.nft"));
        std::fs::write(&f, rules)?;
        sh(&[
            "ip",
            "netns",
            "exec",
            &ns,
            "nft",
            "-f",
            f.to_str().unwrap_or_default(),
        ])?;
        // The kernel listener: writes "s<j>\n" on accept, then echoes lines.
        let stop = self.stop.clone();
        let listener = in_ns(&ns, || TcpListener::bind("0.0.0.0:80"))??;
        listener.set_nonblocking(true)?;
        std::thread::spawn(move || {
            // Bounded by the stop flag, polled every 2 ms.
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut c, _)) => {
                        let _ = c.set_nonblocking(false);
                        let _ = c.set_read_timeout(Some(Duration::from_secs(600)));
                        if c.write_all(format!("s{j}\n").as_bytes()).is_err() {
                            continue;
                        }
                        std::thread::spawn(move || {
                            let mut r = BufReader::new(match c.try_clone() {
                                Ok(x) => x,
                                Err(_) => return,
                            });
                            let mut line = String::new();
                            // Ends at EOF, error or timeout.
                            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                                if c.write_all(format!("s{j} {line}").as_bytes()).is_err() {
                                    break;
                                }
                                line.clear();
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Ok(())
    }

    /// Writes a switchd config for this lab and returns its path.
    pub fn switchd_config(
        &self,
        name: &str,
        servers: u32,
        weights: &[u32],
        metrics_port: u16,
        extra: &str,
    ) -> anyhow::Result<PathBuf> {
        // The lab's pin directory, in the `[ha]` table `extra` may open.
        let pin = format!("pin_dir = {:?}\n", self.pin_dir);
        let extra = match extra.find("[ha]\n") {
            Some(i) => format!("{}{pin}{}", &extra[..i + 5], &extra[i + 5..]),
            None => format!("{extra}\n[ha]\n{pin}"),
        };
        let mut t = format!(
            "control_listen = \"{SWITCH_SV}:7692\"\nkey_file = \"{}\"\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\n\
             store = \"{}\"\nheartbeat_interval_ms = 100\ndead_after_ms = 500\nclosed_linger_ms = 1000\nmax_flows = 65536\n{extra}\n\
             [[interfaces]]\nname = \"cl1\"\nrole = \"client\"\n",
            self.dir.join("key").display(),
            self.store.clone().unwrap_or_else(|| format!("sqlite:{}", self.dir.join("store.db").display()))
        );
        for j in 1..=servers {
            t += &format!("[[interfaces]]\nname = \"sv{j}\"\nrole = \"server\"\n");
        }
        t += &format!("[[services]]\nname = \"web\"\nvip = \"{VIP}:80\"\npool = [");
        for (j, w) in weights.iter().enumerate() {
            t += &format!(
                "{}{{ server = {}, weight = {w} }}",
                if j > 0 { ", " } else { "" },
                j + 1
            );
        }
        t += "]\n";
        let p = self.dir.join(format!("{name}.toml"));
        std::fs::write(&p, t)?;
        Ok(p)
    }

    /// Starts switchd in the switch namespace; returns its index for [`Self::kill`].
    ///
    /// Only the network namespace is entered (`setns` in the child before
    /// exec), not `ip netns exec`, which also mounts a fresh /sys and so
    /// hides bpffs: switchd pins its XDP links in the lab's
    /// [`Lab::pin_dir`] on the machine's bpffs.
    pub fn start_switchd(
        &mut self,
        bin: &std::path::Path,
        config: &std::path::Path,
        log: &str,
    ) -> anyhow::Result<usize> {
        use std::os::unix::process::CommandExt;
        let logf = std::fs::File::create(self.dir.join(log))?;
        let ns = std::fs::File::open(format!("/run/netns/{}", self.ns("sw")))?;
        let nsfd = ns.as_raw_fd();
        let mut cmd = Command::new(bin);
        cmd.arg("--config")
            .arg(config)
            .stdout(Stdio::from(logf.try_clone()?))
            .stderr(Stdio::from(logf));
        // SAFETY: setns(2) only, async-signal-safe, on an fd kept open by
        // `ns` until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(nsfd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        drop(ns);
        self.switchds.push(child);
        Ok(self.switchds.len() - 1)
    }

    pub fn kill(&mut self, i: usize, signal: i32) {
        if let Some(c) = self.switchds.get_mut(i) {
            // Spawned directly (setns before exec): the child pid is switchd's.
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as i32, signal) };
        }
    }

    pub fn wait(&mut self, i: usize, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(s)) = self.switchds[i].try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(name)).unwrap_or_default()
    }

    /// GET `path` from a switchd status endpoint in the switch namespace.
    pub fn fetch(&self, port: u16, path: &str) -> anyhow::Result<String> {
        let path = path.to_string();
        in_ns(&self.ns("sw"), move || {
            crate::daemon::fetch(SocketAddr::from(([127, 0, 0, 1], port)), &path)
        })?
    }

    pub fn status(&self, port: u16) -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::from_str(&self.fetch(port, "/status")?)?)
    }

    /// Polls `/status` until `pred` holds; returns the status and elapsed time.
    pub fn wait_status(
        &self,
        port: u16,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> anyhow::Result<(serde_json::Value, Duration)> {
        let start = Instant::now();
        let mut last = serde_json::Value::Null;
        while start.elapsed() < timeout {
            if let Ok(s) = self.status(port) {
                if pred(&s) {
                    return Ok((s, start.elapsed()));
                }
                last = s;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        anyhow::bail!("{what}: not reached within {timeout:?}; last status {last}")
    }

    /// Registers server `j` and heartbeats every 100 ms until the returned
    /// handle is stopped or dropped. A stand-in without an instance id, like
    /// servers that predate it (docs/SWITCHD.md "Stalled and restarted
    /// servers"): its seqs start at 1.
    pub fn register_server(&self, j: u32, weight: u16) -> anyhow::Result<ServerAgent> {
        self.register_server_as(j, weight, 0, 1)
    }

    /// [`Lab::register_server`] as process `instance` (0: none) whose
    /// REGISTER has seq `first_seq`, each heartbeat one more.
    pub fn register_server_as(
        &self,
        j: u32,
        weight: u16,
        instance: u64,
        first_seq: u64,
    ) -> anyhow::Result<ServerAgent> {
        let ns = self.ns(&format!("s{j}"));
        let out = sh(&["ip", "-n", &ns, "-o", "link", "show", "eth0"])?;
        let mac = out
            .split_whitespace()
            .skip_while(|t| *t != "link/ether")
            .nth(1)
            .and_then(crate::sys::parse_mac)
            .ok_or_else(|| anyhow::anyhow!("no MAC for eth0 in {ns}"))?;
        let sock = in_ns(&ns, move || {
            UdpSocket::bind(SocketAddrV4::new(mgmt_addr(j), 0))
        })??;
        sock.set_read_timeout(Some(Duration::from_millis(200)))?;
        let key = MigrationKey::from_hex(KEY_HEX)?;
        let switch = SocketAddrV4::new(SWITCH_SV, capybara_proto::ports::CONTROL);
        let mut seq = first_seq;
        let services = [SocketAddrV4::new(VIP, 80)];
        let reg = ControlRepr {
            server_id: ServerId(j),
            seq,
            body: ControlBody::Register(Register {
                mgmt_addr: mgmt_addr(j),
                data_addr: data_addr(j),
                data_mac: mac,
                weight,
                services: ServiceList::Slice(&services),
                instance,
                reads_last_id: false,
            }),
        };
        let mut buf = vec![0u8; reg.buffer_len()];
        reg.emit_with_mac(&mut buf, &key)?;
        let mut acked = false;
        let mut rbuf = [0u8; 1500];
        // Bounded: 50 tries of 200 ms.
        for _ in 0..50 {
            sock.send_to(&buf, switch)?;
            if let Ok((n, _)) = sock.recv_from(&mut rbuf) {
                match ControlRepr::parse_verified(&rbuf[..n], &key) {
                    Ok(ControlRepr {
                        body: ControlBody::RegisterAck(_),
                        ..
                    }) => {
                        acked = true;
                        break;
                    }
                    Ok(other) => {
                        anyhow::bail!("server {j}: REGISTER answered with {:?}", other.body)
                    }
                    Err(_) => {}
                }
            }
        }
        anyhow::ensure!(acked, "server {j}: no REGISTER_ACK from {switch}");
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let drains = Arc::new(AtomicU64::new(0));
        let flags = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (stop2, sent2, drains2, flags2) =
            (stop.clone(), sent.clone(), drains.clone(), flags.clone());
        let _ = sock.set_nonblocking(true);
        std::thread::spawn(move || {
            // Bounded by the stop flag.
            while !stop2.load(Ordering::Relaxed) {
                seq += 1;
                let b = heartbeat_with_flags(j, seq, &key, flags2.load(Ordering::Relaxed));
                if sock.send_to(&b, switch).is_ok() {
                    sent2.fetch_add(1, Ordering::Relaxed);
                }
                // Replies are counted, not acted on, by the stand-in.
                let mut r = [0u8; 1500];
                while let Ok((n, _)) = sock.recv_from(&mut r) {
                    if let Ok(ControlRepr {
                        body: ControlBody::Drain(_),
                        ..
                    }) = ControlRepr::parse_verified(&r[..n], &key)
                    {
                        drains2.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Ok(ServerAgent {
            stop,
            heartbeats: sent,
            drains_received: drains,
            flags,
        })
    }

    /// Sends raw datagrams to the control channel from server `j`'s
    /// management address (hostile-input tests).
    pub fn send_raw_control(&self, j: u32, datagrams: Vec<Vec<u8>>) -> anyhow::Result<()> {
        let sock = in_ns(&self.ns(&format!("s{j}")), move || {
            UdpSocket::bind(SocketAddrV4::new(mgmt_addr(j), 0))
        })??;
        for d in datagrams {
            sock.send_to(
                &d,
                SocketAddrV4::new(SWITCH_SV, capybara_proto::ports::CONTROL),
            )?;
        }
        Ok(())
    }

    /// POST `path` to a switchd status endpoint; returns the status line's code.
    pub fn post(&self, port: u16, path: &str) -> anyhow::Result<String> {
        let path = path.to_string();
        in_ns(&self.ns("sw"), move || -> anyhow::Result<String> {
            use std::io::Read;
            let mut c = TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], port)))?;
            c.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(c, "POST {path} HTTP/1.1\r\nHost: switchd\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
            let mut s = String::new();
            c.read_to_string(&mut s)?;
            Ok(s.lines().next().unwrap_or("").to_string())
        })?
    }

    /// A UDP socket on server `j`'s data address, LOAD port (stand-in).
    pub fn load_listener(&self, j: u32) -> anyhow::Result<UdpSocket> {
        let s = in_ns(&self.ns(&format!("s{j}")), move || {
            UdpSocket::bind(SocketAddrV4::new(data_addr(j), capybara_proto::ports::LOAD))
        })??;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        Ok(s)
    }

    /// Opens `n` connections from client 1 to the VIP; each tells which
    /// server answered. Returns (local port, server, stream) per connection.
    pub fn connect_many(
        &self,
        n: usize,
        keep: bool,
    ) -> anyhow::Result<Vec<(u16, u32, Option<TcpStream>)>> {
        in_ns(
            &self.ns("c1"),
            move || -> anyhow::Result<Vec<(u16, u32, Option<TcpStream>)>> {
                let mut out = Vec::with_capacity(n);
                for i in 0..n {
                    let c = TcpStream::connect_timeout(
                        &SocketAddr::from((VIP, 80)),
                        Duration::from_secs(3),
                    )
                    .map_err(|e| anyhow::anyhow!("connection {i}: {e}"))?;
                    c.set_read_timeout(Some(Duration::from_secs(3)))?;
                    let port = c.local_addr()?.port();
                    let mut line = String::new();
                    BufReader::new(&c)
                        .read_line(&mut line)
                        .map_err(|e| anyhow::anyhow!("connection {i} (port {port}): {e}"))?;
                    let server: u32 = line
                        .trim()
                        .trim_start_matches('s')
                        .parse()
                        .map_err(|_| anyhow::anyhow!("connection {i}: greeting {line:?}"))?;
                    out.push((port, server, keep.then_some(c)));
                }
                Ok(out)
            },
        )?
    }
}

/// Sends one line on an established connection and checks the echo.
pub fn ping(c: &mut TcpStream, server: u32, tag: &str) -> anyhow::Result<()> {
    c.write_all(format!("{tag}\n").as_bytes())?;
    let mut line = String::new();
    let mut r = BufReader::new(c.try_clone()?);
    r.read_line(&mut line)?;
    anyhow::ensure!(
        line == format!("s{server} {tag}\n"),
        "echo {line:?}, expected from s{server}"
    );
    Ok(())
}

pub struct ServerAgent {
    stop: Arc<AtomicBool>,
    pub heartbeats: Arc<AtomicU64>,
    /// Authenticated DRAIN messages received from the switch.
    pub drains_received: Arc<AtomicU64>,
    /// The `flags` of the heartbeats it sends from now on (health bits:
    /// [`ServerAgent::report_health`]).
    flags: Arc<std::sync::atomic::AtomicU32>,
}

impl ServerAgent {
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// From the next heartbeat on, reports application health: the
    /// services of its REGISTER list (the lab's VIP:80 only, index 0) whose
    /// application is down.
    pub fn report_health(&self, down: &[usize]) {
        use capybara_proto::control::{HEARTBEAT_DOWN_SHIFT, HEARTBEAT_HEALTH};
        let bits = down.iter().fold(HEARTBEAT_HEALTH, |f, i| {
            f | 1 << (HEARTBEAT_DOWN_SHIFT + *i as u32)
        });
        self.flags.store(bits, Ordering::Relaxed);
    }
}

impl Drop for ServerAgent {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for c in &mut self.switchds {
            // SAFETY: signalling our own child; SIGTERM first for a clean detach.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        for c in &mut self.switchds {
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(3) {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // Pins of switchds that did not stop cleanly (SIGKILL): their
        // programs forward until the pins go.
        remove_pin_dir(&self.pin_dir);
        let bin = capybara_bin();
        let _ = Command::new(bin)
            .args(["lab", "down", "--prefix", &self.prefix])
            .output();
        if std::env::var_os("CAPY_KEEP_LAB_DIR").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Removes a pin directory tree (bpffs: pins and directories), best effort.
pub fn remove_pin_dir(dir: &str) {
    if Path::new(dir).exists() {
        if let Err(e) = std::fs::remove_dir_all(dir) {
            eprintln!("labkit: cannot remove {dir}: {e}");
        }
    }
}

/// Files under `dir` (recursively; pins of a pin directory).
pub fn pins_under(dir: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![PathBuf::from(dir)];
    // Bounded by the tree.
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Outcome of one failover run.
#[derive(Debug, Clone)]
pub struct FailoverResult {
    /// SIGKILL of the active -> the standby reports itself active.
    pub takeover_ms: f64,
    /// The new active's own sync-and-attach time after winning the lease.
    pub attach_ms: f64,
    /// Established connections that failed an echo after the takeover.
    pub connections_lost: usize,
    /// Longest wait for an echo on a connection pinging every 20 ms across
    /// the failover: the client-visible stall.
    pub max_stall_ms: f64,
    pub flows_restored: u64,
    /// The client saw the new active's gratuitous ARP for the VIP.
    pub garp_seen: bool,
    /// Interfaces whose pinned link the new active took over in place.
    pub links_taken_over: u64,
    /// Segments TCP retransmitted in the client and server namespaces from
    /// just before the stop to the end (after the check of every held
    /// connection): a packet lost in the takeover shows here (a tail loss
    /// probe or timeout ~200 ms later), a slow machine does not.
    pub tcp_retransmits: u64,
}

/// Segments TCP retransmitted in network namespace `ns` (`Tcp:
/// RetransSegs`: timeouts, tail loss probes, fast retransmits).
pub fn tcp_retransmits(ns: &str) -> anyhow::Result<u64> {
    let text = in_ns(ns, || std::fs::read_to_string("/proc/thread-self/net/snmp"))??;
    let mut lines = text.lines();
    // Pairs of lines: names, then values, per protocol.
    while let (Some(names), Some(values)) = (lines.next(), lines.next()) {
        if !names.starts_with("Tcp:") {
            continue;
        }
        let i = names
            .split_whitespace()
            .position(|n| n == "RetransSegs")
            .ok_or_else(|| anyhow::anyhow!("no RetransSegs in {ns}'s snmp"))?;
        return values
            .split_whitespace()
            .nth(i)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("bad RetransSegs value in {ns}'s snmp"));
    }
    anyhow::bail!("no Tcp line in {ns}'s snmp")
}

/// How [`failover_run_with`] stops the active and measures.
#[derive(Debug, Clone)]
pub struct FailoverOptions {
    /// Established connections held across the takeover.
    pub connections: usize,
    /// Same-box fast takeover (false: the standby waits for the lease).
    pub fast_takeover: bool,
    /// Pin the XDP links in the lab's pin directory (false: `ha.pin_dir =
    /// ""`, links die with the process, the behaviour before 2026-11-24).
    pub pins: bool,
    /// Signal that stops the active: SIGKILL (a crash) or SIGTERM (a clean
    /// stop, e.g. for an upgrade: hand-over to the standby).
    pub signal: i32,
    /// Interval of the pinging connection: well below the gap a takeover
    /// without pins leaves (25-90 ms), so a gap always costs one RTO.
    pub ping_every: Duration,
}

impl Default for FailoverOptions {
    fn default() -> Self {
        FailoverOptions {
            connections: 200,
            fast_takeover: true,
            pins: true,
            signal: libc::SIGKILL,
            ping_every: Duration::from_millis(2),
        }
    }
}

/// A raw socket receiving every ARP frame of this namespace.
fn arp_listener() -> anyhow::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let proto = (libc::ETH_P_ARP as u16).to_be();
    // SAFETY: plain syscall; ownership taken at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK,
            proto as i32,
        )
    };
    anyhow::ensure!(
        fd >= 0,
        "AF_PACKET socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: fresh descriptor.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Whether a gratuitous ARP for `ip` arrives within `timeout` (or already did).
fn saw_garp(fd: &std::os::fd::OwnedFd, ip: Ipv4Addr, timeout: Duration) -> bool {
    let start = Instant::now();
    let mut buf = [0u8; 128];
    // Bounded by `timeout`.
    while start.elapsed() < timeout {
        // SAFETY: valid buffer of the given length.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
            )
        };
        if n >= 42
            && buf[12..14] == [0x08, 0x06]
            && buf[28..32] == ip.octets()
            && buf[38..42] == ip.octets()
        {
            return true;
        }
        if n < 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    false
}

/// Active + standby switchd in one switch namespace, `n` established
/// connections, SIGKILL of the active (see docs/SWITCHD.md, HA).
///
/// `fast_takeover = false` waits for the lease (the cross-box behaviour);
/// `store_setup` may start a store inside the lab (e.g. etcd in the switch
/// namespace) and return its `store = ` value plus a guard kept for the run.
pub fn failover_run<G>(
    switchd: &std::path::Path,
    n: usize,
    fast_takeover: bool,
    store_setup: impl FnOnce(&Lab) -> anyhow::Result<(Option<String>, G)>,
) -> anyhow::Result<FailoverResult> {
    let opts = FailoverOptions {
        connections: n,
        fast_takeover,
        ..Default::default()
    };
    failover_run_with(switchd, &opts, store_setup)
}

/// [`failover_run`] with every option.
pub fn failover_run_with<G>(
    switchd: &std::path::Path,
    opts: &FailoverOptions,
    store_setup: impl FnOnce(&Lab) -> anyhow::Result<(Option<String>, G)>,
) -> anyhow::Result<FailoverResult> {
    let (n, fast_takeover) = (opts.connections, opts.fast_takeover);
    let mut lab = Lab::up("swh", 3)?;
    if !opts.pins {
        lab.pin_dir = String::new();
    }
    let (store, _store_guard) = store_setup(&lab)?;
    lab.store = store;
    let ha = format!(
        "[ha]\nenabled = true\nlease_ttl_ms = 1000\nflow_sync_interval_ms = 200\nfast_takeover = {fast_takeover}\nclaim_vips = true\n"
    );
    let ha = ha.as_str();
    let a = lab.switchd_config("a", 3, &[1, 1, 1], 9102, ha)?;
    let b = lab.switchd_config("b", 3, &[1, 1, 1], 9103, ha)?;
    let ia = lab.start_switchd(switchd, &a, "a.log")?;
    lab.wait_status(9102, Duration::from_secs(10), "first switchd active", |s| {
        s["role"] == "active"
    })
    .map_err(|e| anyhow::anyhow!("{e}\n{}", lab.log("a.log")))?;
    lab.start_switchd(switchd, &b, "b.log")?;
    lab.wait_status(
        9103,
        Duration::from_secs(10),
        "second switchd standby",
        |s| s["role"] == "standby",
    )
    .map_err(|e| anyhow::anyhow!("{e}\n{}", lab.log("b.log")))?;
    let _agents: Vec<ServerAgent> = (1..=3)
        .map(|j| lab.register_server(j, 1))
        .collect::<anyhow::Result<_>>()?;
    let mut held = lab.connect_many(n, true)?;
    for (_, s, c) in held.iter_mut() {
        ping(c.as_mut().expect("kept"), *s, "before")?;
    }
    let mut pinger = lab.connect_many(1, true)?;
    let (_, psrv, pc) = pinger.pop().expect("one");
    let mut pc = pc.expect("kept");
    pc.set_read_timeout(Some(Duration::from_secs(10)))?;
    lab.wait_status(9103, Duration::from_secs(5), "standby warm", |s| {
        s["warm_flows"].as_u64().unwrap_or(0) >= (n + 1) as u64
    })
    .map_err(|e| anyhow::anyhow!("{e}\n{}", lab.log("b.log")))?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let ping_every = opts.ping_every;
    let stall = std::thread::spawn(move || -> anyhow::Result<f64> {
        let mut worst: f64 = 0.0;
        let mut i = 0u64;
        // Bounded by the stop flag (and the 10 s read timeout per echo).
        while !stop2.load(Ordering::Relaxed) {
            let t = Instant::now();
            ping(&mut pc, psrv, &format!("p{i}"))?;
            worst = worst.max(t.elapsed().as_secs_f64() * 1e3);
            i += 1;
            std::thread::sleep(ping_every);
        }
        Ok(worst)
    });
    let arp = in_ns(&lab.ns("c1"), arp_listener)??;
    std::thread::sleep(Duration::from_millis(200));
    let namespaces = ["c1", "s1", "s2", "s3"].map(|n| lab.ns(n));
    let retransmits =
        || -> anyhow::Result<u64> { namespaces.iter().map(|n| tcp_retransmits(n)).sum() };
    let retransmits_before = retransmits()?;
    lab.kill(ia, opts.signal);
    let killed = Instant::now();
    let (st, _) = lab
        .wait_status(9103, Duration::from_secs(15), "standby takes over", |s| {
            s["role"] == "active"
        })
        .map_err(|e| anyhow::anyhow!("{e}\n{}", lab.log("b.log")))?;
    let takeover_ms = killed.elapsed().as_secs_f64() * 1e3;
    // The lease follows (at once, or when the dead one's expires).
    lab.wait_status(
        9103,
        Duration::from_secs(5),
        "new active holds the lease",
        |s| !s["lease_term"].is_null(),
    )
    .map_err(|e| anyhow::anyhow!("{e}\n{}", lab.log("b.log")))?;
    let mut lost = 0;
    for (_, s, c) in held.iter_mut() {
        if let Err(e) = ping(c.as_mut().expect("kept"), *s, "after") {
            eprintln!("connection to s{s} lost: {e}");
            lost += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let max_stall_ms = match stall.join() {
        Ok(Ok(w)) => w,
        Ok(Err(e)) => {
            eprintln!("pinging connection lost: {e}");
            lost += 1;
            f64::NAN
        }
        Err(_) => f64::NAN,
    };
    let tcp_retransmits = retransmits()?.saturating_sub(retransmits_before);
    let garp_seen = saw_garp(&arp, VIP, Duration::from_secs(1));
    let result = FailoverResult {
        garp_seen,
        takeover_ms,
        attach_ms: st["takeover_ms"].as_f64().unwrap_or(f64::NAN),
        connections_lost: lost,
        max_stall_ms,
        flows_restored: st["restored_flows"].as_u64().unwrap_or(0),
        links_taken_over: st["links_taken_over"].as_u64().unwrap_or(0),
        tcp_retransmits,
    };
    // Switchds first, then the store they talk to.
    drop(lab);
    Ok(result)
}

/// A HEARTBEAT of server `j` with sequence number `seq` reporting nothing
/// (no connections, no load), MAC'd with `key`: what the stand-in agents
/// send, and what hostile-input tests replay or forge.
pub fn idle_heartbeat(j: u32, seq: u64, key: &MigrationKey) -> Vec<u8> {
    heartbeat_with_flags(j, seq, key, 0)
}

/// [`idle_heartbeat`] with heartbeat `flags` (draining, health bits).
pub fn heartbeat_with_flags(j: u32, seq: u64, key: &MigrationKey, flags: u32) -> Vec<u8> {
    let hb = ControlRepr {
        server_id: ServerId(j),
        seq,
        body: ControlBody::Heartbeat(Heartbeat {
            connections: 0,
            migrations_in_flight: 0,
            load_pps: 0,
            rx_backlog_bytes: 0,
            flags,
            policy_generation: 0,
        }),
    };
    let mut b = vec![0u8; hb.buffer_len()];
    hb.emit_with_mac(&mut b, key)
        .expect("a buffer of buffer_len() bytes fits the message");
    b
}
