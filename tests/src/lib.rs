//! Support for cross-component tests: a lab guard that builds a lab with a
//! unique prefix and always tears it down, processes started inside lab
//! namespaces that are killed when the guard drops, and lookup of the
//! project's binaries.
//!
//! Tests here run real programs (the `capybara` and `hostagent` binaries,
//! curl, wrk, ping) in real network namespaces; they need root.

pub mod bench_run;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Path of a binary of this workspace. System tests run the release build
/// that `make setup` produces (`CAPYBARA_BIN_DIR` overrides the directory).
pub fn bin(name: &str) -> PathBuf {
    if let Ok(dir) = std::env::var("CAPYBARA_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    let release = target.join("release").join(name);
    if release.exists() {
        return release;
    }
    target.join("debug").join(name)
}

/// A hostagent started by [`Lab::start_hostagents`]: its config (to
/// start it again with [`Lab::spawn_hostagent`]) and its pid.
pub struct Hostagent {
    pub config: PathBuf,
    pub pid: u32,
}

/// A lab that exists for the guard's lifetime.
pub struct Lab {
    pub prefix: String,
    children: Vec<Child>,
    /// Removed when the guard drops, after the children are killed (a
    /// store's data directory, say).
    scratch_dirs: Vec<PathBuf>,
}

static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The lab node where switchd (and `capybara run`) runs.
pub const SWITCH_NODE: &str = "sw";

/// The bpffs directory of lab `prefix` that `capybara lab down` removes
/// (appliance/src/lab/plan.rs `pin_dir`).
fn lab_bpffs_dir(prefix: &str) -> String {
    format!("/sys/fs/bpf/capybara-lab-{prefix}")
}

/// switchd's default `ha.pin_dir` (switchd/src/config.rs): a switchd of a
/// lab config that does not name the lab's pin directory pins here.
const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/capybara";

impl Lab {
    /// Builds a lab with `servers` servers and a prefix unique to this
    /// process and call (`tag` helps when reading `ip netns`).
    pub fn up(tag: &str, servers: u32) -> Lab {
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let prefix = format!("{tag}{}{n}", std::process::id() % 100_000);
        let out = Command::new(bin("capybara"))
            .args([
                "lab",
                "up",
                "--prefix",
                &prefix,
                "--servers",
                &servers.to_string(),
            ])
            .output()
            .expect("run capybara lab up");
        assert!(
            out.status.success(),
            "lab up failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Lab {
            prefix,
            children: Vec::new(),
            scratch_dirs: Vec::new(),
        }
    }

    pub fn namespace(&self, node: &str) -> String {
        format!("{}-{node}", self.prefix)
    }

    /// A command that runs `program` inside `node`.
    ///
    /// The switch node ([`SWITCH_NODE`]) is entered network namespace only
    /// (`setns` in the child before exec, as `nsenter --net` does): switchd
    /// there sees the machine's bpffs and pins its XDP links in
    /// [`Lab::pin_dir`], so that a takeover or restart replaces the program
    /// in place, as in a deployment. `ip netns exec` would mount a fresh
    /// /sys without bpffs (switchd then falls back to unpinned links: a
    /// takeover gap of tens of ms and a TCP retransmission). Other nodes
    /// keep `ip netns exec`: their /sys shows their own interfaces, for
    /// tools that read /sys/class/net.
    pub fn command(&self, node: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        if node != SWITCH_NODE {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &self.namespace(node)])
                .arg(program);
            return c;
        }
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let path = format!("/run/netns/{}", self.namespace(node));
        let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
        let mut c = Command::new(program);
        // SAFETY: setns(2) only (async-signal-safe) on a descriptor the
        // closure owns, open until the command is dropped (close-on-exec:
        // the program does not inherit it).
        unsafe {
            c.pre_exec(move || {
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        c
    }

    /// `ha.pin_dir` for the switchds of this lab (the config writers here
    /// put it in every switchd config): unique to the lab, under the bpffs
    /// directory that `capybara lab down --prefix` removes, so that pins a
    /// killed switchd left (their programs forward until the pins go) are
    /// removed with the lab by the guard's drop, or by `lab down` after a
    /// crashed test.
    pub fn pin_dir(&self) -> String {
        format!("{}/switchd", lab_bpffs_dir(&self.prefix))
    }

    /// Runs a command inside `node` to completion, with a time limit.
    pub fn run(&self, node: &str, program: &str, args: &[&str], limit: Duration) -> Output {
        let mut c = self.command(node, program);
        c.args(args);
        run_with_timeout(c, limit)
    }

    /// [`Lab::run`] for probes that are retried (conditions polled with
    /// [`Lab::wait_for`], metrics scrapes): `None` when the command
    /// outlived `limit`, which on a loaded machine says nothing about the
    /// lab (`ip netns exec` alone took 0.5 s at load average 11 here).
    pub fn try_run(
        &self,
        node: &str,
        program: &str,
        args: &[&str],
        limit: Duration,
    ) -> Option<Output> {
        let mut c = self.command(node, program);
        c.args(args);
        try_run_with_timeout(c, limit).ok()
    }

    /// Starts a long-running process inside `node`; it is killed when the lab
    /// guard drops (and by `lab down` in any case).
    pub fn spawn(
        &mut self,
        node: &str,
        program: impl AsRef<std::ffi::OsStr>,
        args: &[&str],
    ) -> u32 {
        let child = self
            .command(node, program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn in lab namespace");
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Starts a hostagent on server `j` with config `cfg`, its metrics on
    /// the server's management address (198.18.1.(10+j):9100, where
    /// [`Lab::server_metrics`] reads them), stdout and stderr to `log`.
    /// Returns its pid.
    pub fn spawn_hostagent(&mut self, j: u32, cfg: &std::path::Path, log: &std::path::Path) -> u32 {
        self.spawn_hostagent_env(j, cfg, log, &[])
    }

    /// [`Lab::spawn_hostagent`] with `env` added to its environment (test
    /// knobs such as `CAPYBARA_TEST_FIRST_MIGRATION_SEQ`).
    pub fn spawn_hostagent_env(
        &mut self,
        j: u32,
        cfg: &std::path::Path,
        log: &std::path::Path,
        env: &[(&str, &str)],
    ) -> u32 {
        let metrics = format!("198.18.1.{}:9100", 10 + j);
        let cfg = cfg.to_str().expect("config path is UTF-8");
        self.spawn_logged_env(
            &format!("s{j}"),
            bin("hostagent"),
            &["--config", cfg, "--metrics", &metrics],
            env,
            log,
        )
    }

    /// Starts switchd in the switch node with config `cfg`, stdout and
    /// stderr to `log`. Returns its pid.
    pub fn spawn_switchd(&mut self, cfg: &std::path::Path, log: &std::path::Path) -> u32 {
        let cfg = cfg.to_str().expect("config path is UTF-8");
        self.spawn_logged(SWITCH_NODE, bin("switchd"), &["--config", cfg], log)
    }

    /// Waits (30 s) until the switchd or appliance logging to `log` has
    /// registered servers 1..=`servers`.
    pub fn wait_registered(&self, log: &std::path::Path, servers: u32) {
        self.wait_for("every server to register", Duration::from_secs(30), || {
            let l = log_of(log);
            (1..=servers).all(|j| l.contains(&format!("registered s{j}")))
        });
    }

    /// Waits (5 s) until switchd's `/status` (published every few hundred
    /// ms) says `want` for server `id`'s state; `when` names the moment in
    /// the timeout's message.
    pub fn wait_switchd_state(&self, id: u32, want: &str, when: &str) {
        self.wait_for(
            &format!("s{id} {want} in switchd's /status {when}"),
            Duration::from_secs(5),
            || switchd_status_state(self, id).as_deref() == Some(want),
        );
    }

    /// Waits (30 s) until an HTTP GET from client c1 to the VIP
    /// (198.18.100.1:80) succeeds.
    pub fn wait_vip_http(&self) {
        self.wait_for("the VIP to answer", Duration::from_secs(30), || {
            self.try_run(
                "c1",
                "curl",
                &["-s", "-m", "1", "-o", "/dev/null", "http://198.18.100.1/"],
                Duration::from_secs(5),
            )
            .is_some_and(|o| o.status.success())
        });
    }

    /// One hostagent per server 1..=`servers` behind the switch, the way
    /// the appliance tests start them: services on the VIP, migration and
    /// control channel on ([`hostagent_migrating_config`], key `key`),
    /// policies off ([`disable_policies`]: only the test decides what
    /// migrates), logs in `dir/hostagent-sJ.log`. Killed when the guard
    /// drops.
    pub fn start_hostagents(
        &mut self,
        dir: &std::path::Path,
        key: &std::path::Path,
        servers: u32,
    ) -> Vec<Hostagent> {
        self.start_hostagents_with(dir, key, servers, |_, config| disable_policies(config))
    }

    /// [`Lab::start_hostagents`] with `edit(j, config)` in place of
    /// [`disable_policies`]: it changes server `j`'s config file (written
    /// by [`hostagent_migrating_config`]) before its hostagent starts;
    /// `|_, _| {}` leaves the policies on.
    pub fn start_hostagents_with(
        &mut self,
        dir: &std::path::Path,
        key: &std::path::Path,
        servers: u32,
        mut edit: impl FnMut(u32, &std::path::Path),
    ) -> Vec<Hostagent> {
        (1..=servers)
            .map(|j| {
                let config = hostagent_migrating_config(dir, j, key, None);
                edit(j, &config);
                let log = dir.join(format!("hostagent-s{j}.log"));
                let pid = self.spawn_hostagent(j, &config, &log);
                Hostagent { config, pid }
            })
            .collect()
    }

    /// Starts a process with its stdout captured to `log`.
    pub fn spawn_logged(
        &mut self,
        node: &str,
        program: impl AsRef<std::ffi::OsStr>,
        args: &[&str],
        log: &std::path::Path,
    ) -> u32 {
        self.spawn_logged_env(node, program, args, &[], log)
    }

    /// [`Lab::spawn_logged`] with `env` added to the process's environment.
    pub fn spawn_logged_env(
        &mut self,
        node: &str,
        program: impl AsRef<std::ffi::OsStr>,
        args: &[&str],
        env: &[(&str, &str)],
        log: &std::path::Path,
    ) -> u32 {
        let f = std::fs::File::create(log).expect("create log");
        let child = self
            .command(node, program)
            .args(args)
            .envs(env.iter().copied())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .expect("spawn in lab namespace");
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Kills (SIGKILL) a process started by [`Lab::spawn`] or
    /// [`Lab::spawn_logged`] and waits until it has exited, as a supervisor
    /// does before starting it again: until then its sockets (metrics and
    /// control listeners) and XDP links may still be held. Bounded: gives
    /// up waiting after 10 s.
    pub fn kill_and_wait(&mut self, pid: u32) {
        let Some(c) = self.children.iter_mut().find(|c| c.id() == pid) else {
            panic!("pid {pid} was not started by this lab");
        };
        let _ = c.kill();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("pid {pid} still running 10 s after SIGKILL");
    }

    /// Server `j`'s hostagent metrics (Prometheus text, from its management
    /// address 198.18.1.(10+j):9100); empty if the page cannot be fetched
    /// within 20 s. A scrape that fails or times out is tried again: under
    /// CPU contention one `curl` in the namespace can outlive any fixed
    /// limit while the hostagent is fine (the server_liveness flake: a 5 s
    /// limit on one scrape, at load average 9 on 2 vCPUs).
    pub fn server_metrics(&self, j: u32) -> String {
        let url = format!("http://198.18.1.{}:9100/metrics", 10 + j);
        let start = Instant::now();
        loop {
            let out = self.try_run(
                &format!("s{j}"),
                "curl",
                &["-s", "-m", "5", &url],
                Duration::from_secs(10),
            );
            match out {
                Some(o) if o.status.success() && !o.stdout.is_empty() => {
                    let text = String::from_utf8_lossy(&o.stdout).into_owned();
                    assert_exposition(&text, &format!("s{j}'s hostagent /metrics"));
                    return text;
                }
                _ if start.elapsed() >= Duration::from_secs(20) => return String::new(),
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Panics unless every server in `servers` reports zero TCP resets sent.
    pub fn assert_no_resets(&self, servers: impl IntoIterator<Item = u32>) {
        for j in servers {
            let sent = metric_sum(
                &self.server_metrics(j),
                "capybara_tcp_resets_sent_total",
                "",
            );
            assert_eq!(
                sent,
                Some(0.0),
                "server s{j} sent resets (or its metrics are unreachable)"
            );
        }
    }

    /// Starts a one-member etcd (Debian's etcd-server: `/usr/bin/etcd`, or
    /// `$ETCD_BIN`) inside `node`, clients on 127.0.0.1:2379 there (the
    /// namespace is the lab's own: no port is shared with the host), its
    /// data in `data_dir` (emptied first, removed when the guard drops) and
    /// its output in `log`; waits (20 s) until it reports healthy. Returns
    /// its pid (for SIGSTOP/SIGCONT) and client URL. The member also dies
    /// with the thread that started it (`PR_SET_PDEATHSIG`), should the
    /// test process be killed before the guard drops. Fast elections as in
    /// the store's test harness (`store/src/testing.rs`; the minimum lease
    /// TTL is then 1 s); etcd's defaults otherwise, as a deployment has
    /// them (`max-txn-ops` 128, what the appliance's etcd client assumes).
    pub fn spawn_etcd(
        &mut self,
        node: &str,
        data_dir: &std::path::Path,
        log: &std::path::Path,
    ) -> (u32, String) {
        use std::os::unix::process::CommandExt;
        let etcd = std::env::var("ETCD_BIN").unwrap_or_else(|_| "/usr/bin/etcd".into());
        assert!(
            std::path::Path::new(&etcd).exists(),
            "no etcd binary at {etcd}: `make setup` installs etcd-server (or set ETCD_BIN)"
        );
        let _ = std::fs::remove_dir_all(data_dir);
        self.scratch_dirs.push(data_dir.to_path_buf());
        let client = "http://127.0.0.1:2379";
        let peer = "http://127.0.0.1:2380";
        let f = std::fs::File::create(log).expect("create log");
        let mut cmd = self.command(node, &etcd);
        cmd.args(["--name", "m0", "--data-dir"])
            .arg(data_dir)
            .args([
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
            ])
            .args([
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
            ])
            .args(["--initial-cluster", &format!("m0={peer}")])
            .args(["--initial-cluster-token", &self.prefix])
            .args(["--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f);
        // SAFETY: prctl is async-signal-safe and touches no Rust state.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start etcd in the lab namespace");
        let pid = child.id();
        self.children.push(child);
        let health = format!("{client}/health");
        self.wait_for("etcd to report healthy", Duration::from_secs(20), || {
            self.try_run(
                node,
                "curl",
                &["-s", "-m", "1", &health],
                Duration::from_secs(3),
            )
            .is_some_and(|o| String::from_utf8_lossy(&o.stdout).contains("\"health\":\"true\""))
        });
        (pid, client.to_string())
    }

    /// Runs `f` on a thread of its own inside `node`'s network namespace
    /// (`setns`, that thread only) and returns what it returns: sockets it
    /// opens are the namespace's, with no `ip netns exec` per call (which
    /// can take 0.5 s on a loaded machine), for measurements that poll.
    pub fn in_netns<T: Send>(&self, node: &str, f: impl FnOnce() -> T + Send) -> T {
        use std::os::fd::AsRawFd;
        let path = format!("/run/netns/{}", self.namespace(node));
        std::thread::scope(|s| {
            s.spawn(|| {
                let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                // SAFETY: plain syscall on a valid fd; affects this thread only.
                let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .expect("the thread in the namespace panicked")
        })
    }

    /// One TCP connect from `node` to `addr` ("IP:PORT"), given 5 s: its
    /// outcome (`ok`, `refused`, `timeout`, or the error) and how long it
    /// took in seconds (99 when the client printed nothing).
    pub fn connect_outcome(&self, node: &str, addr: &str) -> (String, f64) {
        const CONNECT: &str = r#"
import socket, sys, time
host, port = sys.argv[1].split(":")
t0 = time.monotonic()
try:
    s = socket.create_connection((host, int(port)), timeout=5)
    s.close()
    r = "ok"
except ConnectionRefusedError:
    r = "refused"
except socket.timeout:
    r = "timeout"
except OSError as e:
    r = "error:%s" % e
print(r, "%.3f" % (time.monotonic() - t0))
"#;
        let out = self.run(
            node,
            "python3",
            &["-c", CONNECT, addr],
            Duration::from_secs(15),
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (r, secs) = text.trim().split_once(' ').unwrap_or(("no answer", "99"));
        (r.to_string(), secs.parse().unwrap_or(99.0))
    }

    /// Waits until `cond` holds, polling every 20 ms, up to `limit`.
    pub fn wait_for(&self, what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < limit,
                "timed out after {limit:?} waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Lab {
    /// Removes pins a switchd of this lab left under switchd's default pin
    /// root (`<root>/net<switch namespace inode>-*`: a config written
    /// without [`Lab::pin_dir`]), saying so: their programs would forward
    /// on, holding their maps, until the pins go. Before `lab down` (the
    /// namespace's inode names the directory).
    fn remove_default_root_pins(&self) {
        use std::os::unix::fs::MetadataExt;
        let ns = format!("/run/netns/{}", self.namespace(SWITCH_NODE));
        let Ok(ino) = std::fs::metadata(&ns).map(|m| m.ino()) else {
            return;
        };
        let mine = format!("net{ino}-");
        let Ok(entries) = std::fs::read_dir(DEFAULT_PIN_ROOT) else {
            return;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&mine) {
                eprintln!(
                    "lab {}: a switchd pinned in {} (its config lacks `pin_dir = Lab::pin_dir()`): removing",
                    self.prefix,
                    e.path().display()
                );
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let _ = std::fs::remove_dir(DEFAULT_PIN_ROOT);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.remove_default_root_pins();
        // Also removes the lab's bpffs directory: the pins of switchds
        // killed above (SIGKILL leaves them; their programs run on).
        let _ = Command::new(bin("capybara"))
            .args(["lab", "down", "--prefix", &self.prefix])
            .output();
        let pins = lab_bpffs_dir(&self.prefix);
        if std::path::Path::new(&pins).exists() {
            if let Err(e) = std::fs::remove_dir_all(&pins) {
                eprintln!("lab {}: cannot remove {pins}: {e}", self.prefix);
            }
        }
        for d in &self.scratch_dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Panics unless `text` is what a Prometheus scraper parses (text
/// exposition): every line empty, a comment starting at its first column
/// (`# HELP`, `# TYPE`, `# ...`), or a sample `name{labels} value
/// [timestamp]` with a valid metric name and a numeric value. `what` names
/// the source in the panic, with the offending line.
pub fn assert_exposition(text: &str, what: &str) {
    for (n, line) in text.lines().enumerate() {
        let ok = if line.is_empty() {
            true
        } else if let Some(c) = line.strip_prefix('#') {
            c.is_empty() || c.starts_with(' ')
        } else {
            let name = &line[..line.find(['{', ' ']).unwrap_or(line.len())];
            let value = line.rsplit(' ').next().unwrap_or("");
            name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_' || c == ':')
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                && line.len() > name.len()
                && (value.parse::<f64>().is_ok() || ["NaN", "+Inf", "-Inf"].contains(&value))
        };
        assert!(
            ok,
            "{what}: line {} is not Prometheus text exposition: {line:?}",
            n + 1
        );
    }
}

/// The sum of metric `name` over its label sets that contain `label` (all of
/// them when `label` is empty) in a Prometheus text page; `None` if absent.
pub fn metric_sum(text: &str, name: &str, label: &str) -> Option<f64> {
    let mut found = None;
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((k, v)) = l.rsplit_once(' ') else {
            continue;
        };
        let labels = match k.strip_prefix(name) {
            Some("") => "",
            Some(rest) if rest.starts_with('{') => rest,
            _ => continue,
        };
        if labels.contains(label) {
            if let Ok(v) = v.parse::<f64>() {
                *found.get_or_insert(0.0) += v;
            }
        }
    }
    found
}

/// `bpftool -j ARGS`, its JSON output (panics if it fails).
pub fn bpftool(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .expect("run bpftool");
    assert!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("bpftool {args:?} JSON: {e}"))
}

/// The raw bytes of a `bpftool -j map dump` field ("0x.." strings).
fn raw_bytes(v: &serde_json::Value) -> Vec<u8> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
        .collect()
}

/// The maps of the XDP program a lab switchd runs, by name (`flows`,
/// `migrations`, ...), found through its pinned links (`/status.pin_dir`
/// of the switchd whose status port is `status_port`).
pub struct SwitchMaps {
    ids: std::collections::HashMap<String, u64>,
}

impl SwitchMaps {
    pub fn of(lab: &Lab, status_port: u16) -> SwitchMaps {
        // A probe that outlived its limit on a loaded machine is tried again.
        let mut st = serde_json::Value::Null;
        lab.wait_for("switchd's /status", Duration::from_secs(20), || {
            st = switchd_status_at(lab, status_port).unwrap_or_default();
            !st.is_null()
        });
        let pin_dir = st["pin_dir"].as_str().expect("switchd pins its links");
        let link = std::fs::read_dir(pin_dir)
            .expect("read the pin directory")
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("xdp-"))
            })
            .unwrap_or_else(|| panic!("no pinned XDP link in {pin_dir}"));
        let prog = bpftool(&["link", "show", "pinned", link.to_str().unwrap()])["prog_id"]
            .as_u64()
            .expect("the link's program");
        let maps = bpftool(&["prog", "show", "id", &prog.to_string()])["map_ids"].clone();
        let mut ids = std::collections::HashMap::new();
        for id in maps.as_array().expect("the program's maps") {
            let id = id.as_u64().unwrap();
            let m = bpftool(&["map", "show", "id", &id.to_string()]);
            ids.insert(m["name"].as_str().unwrap_or("").to_string(), id);
        }
        SwitchMaps { ids }
    }

    fn id(&self, name: &str) -> String {
        self.ids
            .get(name)
            .unwrap_or_else(|| panic!("no map {name:?} in {:?}", self.ids))
            .to_string()
    }

    /// Every (key, value) of map `name`, as raw bytes.
    pub fn dump(&self, name: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
        bpftool(&["map", "dump", "id", &self.id(name)])
            .as_array()
            .expect("a map dump")
            .iter()
            .map(|e| (raw_bytes(&e["key"]), raw_bytes(&e["value"])))
            .collect()
    }

    /// Deletes the entry of map `name` under `key` (raw bytes).
    pub fn delete(&self, name: &str, key: &[u8]) {
        let mut args = vec![
            "map".to_string(),
            "delete".into(),
            "id".into(),
            self.id(name),
        ];
        args.push("key".into());
        args.extend(key.iter().map(|b| format!("0x{b:02x}")));
        let out = std::process::Command::new("bpftool")
            .args(&args)
            .output()
            .expect("run bpftool");
        assert!(
            out.status.success(),
            "bpftool {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Switches the load-balancing policies off in a hostagent config (for
/// tests where only the test itself may decide what migrates).
pub fn disable_policies(cfg: &std::path::Path) {
    let mut text = std::fs::read_to_string(cfg).expect("read hostagent config");
    text.push_str("[policy]\nenabled = false\n");
    std::fs::write(cfg, text).expect("write hostagent config");
}

/// An appliance config (`capybara run`) for `lab`: the lab's switchd
/// settings under `[switchd]` ([`switchd_config`]; the store named once,
/// the default SQLite in `dir`), the API on `api_listen` inside the switch
/// namespace, the admin token written to `dir/admin-token`.
pub fn appliance_config(
    lab: &Lab,
    dir: &std::path::Path,
    servers: u32,
    key: &std::path::Path,
    api_listen: &str,
) -> PathBuf {
    let mut t = format!(
        "state_dir = \"{}\"\n[api]\nlisten = \"{api_listen}\"\nadmin_token_file = \"{}\"\n",
        dir.display(),
        dir.join("admin-token").display()
    );
    t.push_str(&switchd_section(&switchd_config(lab, dir, servers, key)));
    let path = dir.join("capybara.toml");
    std::fs::write(&path, t).expect("write appliance config");
    path
}

/// A lab switchd config file (see [`switchd_config`]) as the `[switchd]`
/// table of an appliance config: its `store` line left out (the appliance
/// names the store once), its tables under `switchd.`.
fn switchd_section(switchd_toml: &std::path::Path) -> String {
    let sw = std::fs::read_to_string(switchd_toml).expect("read switchd config");
    let mut t = String::from("[switchd]\n");
    for line in sw.lines() {
        if line.starts_with("store =") {
            continue;
        }
        let line = match line {
            "[ha]" => "[switchd.ha]",
            "[[interfaces]]" => "[[switchd.interfaces]]",
            "[[services]]" => "[[switchd.services]]",
            l => l,
        };
        t.push_str(line);
        t.push('\n');
    }
    t
}

/// The config files of an active/standby switchd pair on one box, as
/// docs/OPERATIONS.md (Switch failover) describes it: one `capybara run`
/// config per switchd (a `[switchd]` table, no `[api]`) with
/// `[switchd.ha] enabled = true` plus `ha_lines`, differing only in
/// `metrics_listen` (127.0.0.1:`status_ports[i]`, in the switch namespace)
/// and state_dir; and an API-only one (`[api]` on `api_listen`, admin
/// token in `dir/admin-token`, `switchd` = every status URL). All on the
/// etcd at `etcd` (a client URL). Both switchds pin their XDP links in
/// the lab's [`Lab::pin_dir`] (one pin directory per namespace and
/// election: the pair shares it). Returns (switchd configs, API config).
#[allow(clippy::too_many_arguments)]
pub fn ha_appliance_configs(
    lab: &Lab,
    dir: &std::path::Path,
    servers: u32,
    key: &std::path::Path,
    etcd: &str,
    api_listen: &str,
    status_ports: &[u16],
    ha_lines: &str,
) -> (Vec<PathBuf>, PathBuf) {
    let store = format!("[store]\netcd = [\"{etcd}\"]\n");
    let sw = switchd_config(lab, dir, servers, key);
    let base = std::fs::read_to_string(&sw).expect("read switchd config");
    assert!(base.contains("[ha]\nenabled = false\n"));
    let mut switchds = Vec::new();
    for (i, port) in status_ports.iter().enumerate() {
        let text = base
            .replace(
                "[ha]\nenabled = false\n",
                &format!("[ha]\nenabled = true\n{ha_lines}"),
            )
            .replace(
                "metrics_listen = \"127.0.0.1:9102\"",
                &format!("metrics_listen = \"127.0.0.1:{port}\""),
            );
        std::fs::write(&sw, text).expect("write switchd config");
        let t = format!(
            "state_dir = \"{}\"\n{store}{}",
            dir.join(format!("switchd-{i}")).display(),
            switchd_section(&sw)
        );
        let path = dir.join(format!("capybara-switchd-{i}.toml"));
        std::fs::write(&path, t).expect("write appliance config");
        switchds.push(path);
    }
    let urls: Vec<String> = status_ports
        .iter()
        .map(|p| format!("\"http://127.0.0.1:{p}\""))
        .collect();
    let t = format!(
        "state_dir = \"{}\"\n{store}[api]\nlisten = \"{api_listen}\"\nadmin_token_file = \"{}\"\nswitchd = [{}]\n",
        dir.join("api").display(),
        dir.join("admin-token").display(),
        urls.join(", ")
    );
    let api = dir.join("capybara-api.toml");
    std::fs::write(&api, t).expect("write appliance config");
    (switchds, api)
}

/// `capybara run CONFIG` inside the switch namespace, logging to `log`.
pub fn start_appliance(lab: &Lab, config: &std::path::Path, log: &std::path::Path) -> Child {
    let f = std::fs::File::create(log).expect("create log");
    lab.command("sw", bin("capybara"))
        .args(["run", config.to_str().unwrap()])
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .expect("start capybara run")
}

/// SIGTERM to a [`start_appliance`] process, then waits (bounded, 15 s)
/// for a clean exit.
pub fn stop_appliance(child: &mut Child) -> std::process::ExitStatus {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let start = std::time::Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        if start.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            panic!("capybara run did not stop within 15 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A log file's text so far (empty while it does not exist).
pub fn log_of(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Waits (30 s each) until the appliance logging to `log` registered
/// servers 1..=`servers` and its API at `api` answers; returns the admin
/// token it wrote to `dir/admin-token`.
pub fn wait_appliance_ready(
    lab: &Lab,
    log: &std::path::Path,
    servers: u32,
    api: &str,
    dir: &std::path::Path,
) -> String {
    lab.wait_registered(log, servers);
    lab.wait_for("the API", Duration::from_secs(30), || {
        lab.api_call(api, "", "GET", "/healthz", None).0 == 200
    });
    std::fs::read_to_string(dir.join("admin-token"))
        .expect("admin token file")
        .trim()
        .to_string()
}

/// Waits up to `limit` until the load generator logging to
/// `dir/loadgen.log` printed its `RESULT ` line and wrote `json`, then
/// reads that JSON report.
pub fn wait_loadgen_report(
    lab: &Lab,
    dir: &std::path::Path,
    json: &std::path::Path,
    limit: Duration,
) -> serde_json::Value {
    lab.wait_for("the load generator's report", limit, || {
        log_of(&dir.join("loadgen.log")).contains("RESULT ") && json.exists()
    });
    std::thread::sleep(Duration::from_millis(200));
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).expect("loadgen JSON")
}

/// Server `id` in switchd's `/status` (`metrics_listen` of the lab's
/// switchd config, in the switch namespace).
pub fn switchd_status_server(lab: &Lab, id: u32) -> Option<serde_json::Value> {
    switchd_status_server_at(lab, 9102, id)
}

/// Server `id`'s `state` in switchd's `/status` ([`switchd_status_server`]):
/// `live`, `draining`, `dead`, ...; `None` when switchd does not answer or
/// does not list it.
pub fn switchd_status_state(lab: &Lab, id: u32) -> Option<String> {
    Some(
        switchd_status_server(lab, id)?["state"]
            .as_str()?
            .to_string(),
    )
}

/// The `/status` of the switchd whose `metrics_listen` is
/// 127.0.0.1:`port` in the switch namespace; `None` when it does not
/// answer within 1 s (stopped, or not listening yet).
pub fn switchd_status_at(lab: &Lab, port: u16) -> Option<serde_json::Value> {
    switchd_status_within(lab, port, "1", Duration::from_secs(5))
}

/// The `/status` on `port` (see [`switchd_status_at`]): `curl -m
/// curl_secs`, the command given up after `limit`.
fn switchd_status_within(
    lab: &Lab,
    port: u16,
    curl_secs: &str,
    limit: Duration,
) -> Option<serde_json::Value> {
    let url = format!("http://127.0.0.1:{port}/status");
    let out = lab.try_run("sw", "curl", &["-s", "-m", curl_secs, &url], limit)?;
    serde_json::from_slice(&out.stdout).ok()
}

/// `GET path` over HTTP/1.0 to `addr` from the calling thread (see
/// [`Lab::in_netns`]): the body of a 200 answer; `None` on anything else
/// or when no answer came within `limit`.
pub fn http_get(addr: std::net::SocketAddr, path: &str, limit: Duration) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, limit).ok()?;
    s.set_read_timeout(Some(limit)).ok()?;
    s.set_write_timeout(Some(limit)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut buf = Vec::new();
    s.take(16 << 20).read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.split_whitespace()
        .nth(1)
        .filter(|code| *code == "200")
        .map(|_| body.to_string())
}

/// [`switchd_status_server`] of the switchd on status port `port`.
pub fn switchd_status_server_at(lab: &Lab, port: u16, id: u32) -> Option<serde_json::Value> {
    let v = switchd_status_within(lab, port, "5", Duration::from_secs(10))?;
    v["servers"]
        .as_array()?
        .iter()
        .find(|s| s["id"] == id)
        .cloned()
}

/// Opens `n` new echo connections (port 7) from c1 and returns how many
/// the API at `api` lists on each of servers 1..=`servers` (index 0: s1),
/// after checking they echo; then closes them.
pub fn place_echo_connections(
    lab: &Lab,
    api: &str,
    token: &str,
    n: usize,
    servers: u32,
) -> Vec<usize> {
    let mut h = EchoHolder::start(lab, n);
    let servers = servers as usize;
    let mut counts = vec![0; servers];
    lab.wait_for(
        "the new connections in GET /v1/connections",
        Duration::from_secs(10),
        || {
            let (code, body) = lab.api_call(api, token, "GET", "/v1/connections?limit=10000", None);
            if code != 200 {
                return false;
            }
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            counts = vec![0; servers];
            let mut seen = 0;
            for c in v["items"].as_array().into_iter().flatten() {
                let port = c["client_port"].as_u64().unwrap_or(0) as u16;
                if c["port"] == 7 && h.ports.contains(&port) {
                    let s = c["server"].as_u64().unwrap_or(0) as usize;
                    if (1..=servers).contains(&s) {
                        counts[s - 1] += 1;
                        seen += 1;
                    }
                }
            }
            seen == n
        },
    );
    assert_eq!(h.round_trip(), "ok", "the new connections echo");
    assert_eq!(h.close(), "closed");
    eprintln!("new connections per server (s1, s2, ...): {counts:?}");
    counts
}

/// One echo round trip from client c1 to `addr` (VIP:port): connect within
/// 2 s, send, read the same bytes back within 2 s.
pub fn echo_once(lab: &Lab, addr: &str) -> bool {
    const ONCE: &str = r#"
import socket, sys
host, port = sys.argv[1].split(":")
try:
    s = socket.create_connection((host, int(port)), timeout=2)
    s.sendall(b"capybara-once")
    got = b""
    while len(got) < 13:
        c = s.recv(64)
        if not c:
            break
        got += c
    sys.exit(0 if got == b"capybara-once" else 1)
except OSError:
    sys.exit(2)
"#;
    lab.command("c1", "timeout")
        .args(["5", "python3", "-c", ONCE, addr])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

impl Lab {
    /// A REST call with `curl` inside the switch namespace to `base` +
    /// `path`, with a bearer token and an optional JSON body: (status, body);
    /// status 0 when there was no answer.
    pub fn api_call(
        &self,
        base: &str,
        token: &str,
        method: &str,
        path: &str,
        json: Option<&str>,
    ) -> (u16, String) {
        let auth = format!("Authorization: Bearer {token}");
        let url = format!("{base}{path}");
        let mut args = vec![
            "-s",
            "-m",
            "5",
            "-X",
            method,
            "-H",
            &auth,
            "-w",
            "\n%{http_code}",
        ];
        if let Some(j) = json {
            args.extend(["-H", "Content-Type: application/json", "-d", j]);
        }
        args.push(&url);
        let Some(out) = self.try_run("sw", "curl", &args, Duration::from_secs(10)) else {
            return (0, String::new());
        };
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    /// Server `id` as the REST API at `base` tells it (`GET
    /// /v1/servers/{id}`, checked to answer 200): (`state`, `liveness`),
    /// each empty when absent.
    pub fn api_server(&self, base: &str, token: &str, id: u32) -> (String, String) {
        let (code, body) = self.api_call(base, token, "GET", &format!("/v1/servers/{id}"), None);
        assert_eq!(code, 200, "GET /v1/servers/{id}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("server JSON");
        (
            v["state"].as_str().unwrap_or("").to_string(),
            v["liveness"].as_str().unwrap_or("").to_string(),
        )
    }

    /// Sets server `id`'s operator weight through the REST API at `base`
    /// (`PUT /v1/servers/{id}/weight`), checked to answer 200.
    pub fn set_weight(&self, base: &str, token: &str, id: u32, weight: u32) {
        let (code, body) = self.api_call(
            base,
            token,
            "PUT",
            &format!("/v1/servers/{id}/weight"),
            Some(&format!("{{\"weight\": {weight}}}")),
        );
        assert_eq!(code, 200, "set s{id}'s weight to {weight}: {body}");
    }

    /// Starts draining server `id` through the REST API at `base` (`POST
    /// /v1/servers/{id}/drain`, mode `migrate`, the deadline in seconds),
    /// checked to answer 202.
    pub fn start_drain(&self, base: &str, token: &str, id: u32, deadline_seconds: u32) {
        let (code, body) = self.api_call(
            base,
            token,
            "POST",
            &format!("/v1/servers/{id}/drain"),
            Some(&format!(
                "{{\"deadline_seconds\": {deadline_seconds}, \"mode\": \"migrate\"}}"
            )),
        );
        assert_eq!(code, 202, "drain s{id}: {body}");
    }
}

/// A Python client in the client namespace `c1` holding established echo
/// connections to the service 198.18.100.1:7 (or another VIP:port:
/// [`EchoHolder::start_to`]): one checked round trip on each when it
/// starts, then another on each for every [`EchoHolder::round_trip`];
/// [`EchoHolder::close`] closes them cleanly. Started with
/// [`EchoHolder::start_reporting`] instead, it reports how each
/// connection's echo ended ([`EchoHolder::round_outcomes`]). Killed when
/// dropped.
pub struct EchoHolder {
    child: Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    /// The client's local ports, one per connection.
    pub ports: Vec<u16>,
}

const ECHO_HOLDER: &str = r#"
import socket, sys, time
n = int(sys.argv[1])
host, port = sys.argv[2].split(":")
socks = [socket.create_connection((host, int(port)), timeout=20) for _ in range(n)]
def roundtrip(tag):
    worst = 0.0
    for i, s in enumerate(socks):
        msg = ("%s-%d;" % (tag, i)).encode() * 50
        t0 = time.monotonic()
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            c = s.recv(65536)
            if not c:
                sys.exit("connection %d closed by the peer" % i)
            got += c
        if got != msg:
            sys.exit("connection %d: echo differs" % i)
        worst = max(worst, time.monotonic() - t0)
    return worst
roundtrip("before")
for s in socks:
    print(s.getsockname()[1])
print("ready", flush=True)
k = 0
for line in sys.stdin:
    if line.strip() == "close":
        for s in socks:
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
            s.close()
        print("closed", flush=True)
        break
    k += 1
    worst = roundtrip("round%d" % k)
    if line.strip() == "timed":
        print("ok %.1f" % (worst * 1e3), flush=True)
    else:
        print("ok", flush=True)
"#;

/// The client of [`EchoHolder::start_reporting`]: it holds `n` echo
/// connections; each round sends on all of them at once and reports per
/// connection how its echo ended: `ok` (byte-exact), `reset`, `closed`
/// (FIN), `differs`, or `hang` (no answer within the round's limit), with
/// the milliseconds it took. A connection that ended is left out of later
/// rounds.
const ECHO_OUTCOMES: &str = r#"
import errno, select, socket, sys, time
n = int(sys.argv[1])
host, port = sys.argv[2].split(":")
socks = [socket.create_connection((host, int(port)), timeout=20) for _ in range(n)]
ports = [s.getsockname()[1] for s in socks]
for p in ports:
    print(p)
print("ready", flush=True)
live = set(range(n))
k = 0
for line in sys.stdin:
    limit = float(line.strip())
    k += 1
    want, got, t0, out = {}, {}, time.monotonic(), {}
    for i in sorted(live):
        msg = ("r%d-%d;" % (k, i)).encode() * 50
        want[i], got[i] = msg, b""
        try:
            socks[i].setblocking(True)
            socks[i].sendall(msg)
            socks[i].setblocking(False)
        except ConnectionResetError:
            out[i] = "reset %.1f" % ((time.monotonic() - t0) * 1000)
        except OSError as e:
            out[i] = "error-" + errno.errorcode.get(e.errno, str(e.errno))
    pend = {socks[i].fileno(): i for i in want if i not in out}
    while pend:
        left = limit - (time.monotonic() - t0)
        if left <= 0:
            break
        r, _, _ = select.select(list(pend), [], [], left)
        for fd in r:
            i = pend[fd]
            try:
                c = socks[i].recv(65536)
            except ConnectionResetError:
                c = None
            except BlockingIOError:
                continue
            ms = (time.monotonic() - t0) * 1000
            if c is None:
                out[i] = "reset %.1f" % ms
            elif not c:
                out[i] = "closed %.1f" % ms
            else:
                got[i] += c
                if len(got[i]) < len(want[i]):
                    continue
                out[i] = ("ok %.1f" if got[i] == want[i] else "differs %.1f") % ms
            del pend[fd]
    for i in want:
        o = out.get(i, "hang %d" % (limit * 1000))
        if not o.startswith("ok"):
            live.discard(i)
        print(ports[i], o)
    print("done", flush=True)
"#;

/// How one connection's echo ended in an [`EchoHolder::round_outcomes`]
/// round: `ok`, `reset`, `closed`, `differs`, `hang` or `error-ERRNO`, and
/// after how many ms.
#[derive(Debug, Clone, PartialEq)]
pub struct EchoOutcome {
    pub what: String,
    pub ms: f64,
}

impl EchoHolder {
    /// Opens `n` connections (each echoes once) and returns when all are up.
    pub fn start(lab: &Lab, n: usize) -> EchoHolder {
        Self::start_to(lab, "198.18.100.1:7", n)
    }

    /// [`Self::start`] to the echo service at `addr` (VIP:port).
    pub fn start_to(lab: &Lab, addr: &str, n: usize) -> EchoHolder {
        Self::spawn(lab, ECHO_HOLDER, addr, n)
    }

    /// Opens `n` connections to `addr` (VIP:port), no echo yet, for
    /// [`Self::round_outcomes`] (not [`Self::round_trip`] nor
    /// [`Self::close`]): a connection that ends is reported, not fatal.
    pub fn start_reporting(lab: &Lab, addr: &str, n: usize) -> EchoHolder {
        Self::spawn(lab, ECHO_OUTCOMES, addr, n)
    }

    /// A round trip on every connection still up, all at once, within
    /// `limit` (a holder from [`Self::start_reporting`]): the outcome per
    /// client port.
    pub fn round_outcomes(
        &mut self,
        limit: Duration,
    ) -> std::collections::BTreeMap<u16, EchoOutcome> {
        use std::io::Write;
        writeln!(self.stdin, "{}", limit.as_secs_f64()).expect("signal the echo client");
        self.stdin.flush().unwrap();
        let mut m = std::collections::BTreeMap::new();
        loop {
            let l = self.line();
            assert!(!l.is_empty(), "the echo client stopped during a round");
            if l == "done" {
                return m;
            }
            let mut f = l.split_whitespace();
            let port: u16 = f.next().unwrap().parse().expect("a port");
            let what = f.next().unwrap_or("").to_string();
            let ms = f.next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
            m.insert(port, EchoOutcome { what, ms });
        }
    }

    /// Starts client `script` (its ports, one a line, then `ready`) with
    /// `n` connections to `addr` and waits until they are up.
    fn spawn(lab: &Lab, script: &str, addr: &str, n: usize) -> EchoHolder {
        let mut child = lab
            .command("c1", "python3")
            .args(["-c", script, &n.to_string(), addr])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the echo client");
        let mut h = EchoHolder {
            stdin: child.stdin.take().unwrap(),
            stdout: std::io::BufReader::new(child.stdout.take().unwrap()),
            child,
            ports: Vec::new(),
        };
        loop {
            let l = h.line();
            if l == "ready" {
                break;
            }
            assert!(!l.is_empty(), "the echo client stopped before it was ready");
            h.ports.push(l.parse::<u16>().expect("a port"));
        }
        assert_eq!(h.ports.len(), n);
        h
    }

    /// Another round trip over every connection: the client's answer,
    /// `ok` when every echo came back byte-exact.
    pub fn round_trip(&mut self) -> String {
        use std::io::Write;
        writeln!(self.stdin, "go").expect("signal the echo client");
        self.line()
    }

    /// [`Self::round_trip`] that also times each connection's echo: the
    /// slowest one's round trip in ms, or the client's answer when it was
    /// not `ok` (empty when the client stopped: its reason, e.g.
    /// `connection 3 closed by the peer`, is on the test's stderr).
    pub fn round_trip_timed(&mut self) -> Result<f64, String> {
        use std::io::Write;
        if writeln!(self.stdin, "timed").is_err() {
            return Err("the echo client is gone".into());
        }
        let l = self.line();
        l.strip_prefix("ok ")
            .and_then(|ms| ms.parse().ok())
            .ok_or(l)
    }

    /// Closes every connection cleanly (FIN, then the peer's FIN read):
    /// `closed` when done.
    pub fn close(&mut self) -> String {
        use std::io::Write;
        writeln!(self.stdin, "close").expect("signal the echo client");
        self.line()
    }

    fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut l = String::new();
        self.stdout
            .read_line(&mut l)
            .expect("read the echo client's output");
        l.trim().to_string()
    }
}

impl Drop for EchoHolder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lines of a child's output, read by a thread (for waiting with a limit).
pub fn stdout_lines(out: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits up to `limit` for a line of a load client starting with `prefix`
/// (other lines are echoed to stderr); gives up early when `stop` is set.
pub fn expect_line(
    rx: &std::sync::mpsc::Receiver<String>,
    prefix: &str,
    limit: Duration,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<String, String> {
    use std::sync::mpsc::RecvTimeoutError;
    let end = Instant::now() + limit;
    loop {
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("interrupted".into());
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "the load client did not say {prefix:?} within {limit:?}"
            ));
        }
        match rx.recv_timeout(left.min(Duration::from_millis(100))) {
            Ok(l) if l.starts_with(prefix) => return Ok(l),
            Ok(l) => eprintln!("client: {l}"),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                return Err(format!("the load client exited before saying {prefix:?}"))
            }
        }
    }
}

/// Sends one line to a load client's stdin.
pub fn send_line(to: &mut std::process::ChildStdin, line: &str) -> Result<(), String> {
    use std::io::Write;
    writeln!(to, "{line}")
        .and_then(|_| to.flush())
        .map_err(|e| format!("to the load client: {e}"))
}

/// Runs `cmd` (on the host, no time limit: for quick local tools) to
/// completion: its stdout, trimmed. Panics when it cannot start or fails,
/// naming `what` (and its stderr).
pub fn output_ok(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Panics unless `capybara --check config` passes (`what`: the case).
pub fn assert_check_passes(config: &std::path::Path, what: &str) {
    let mut cmd = Command::new(bin("capybara"));
    cmd.arg("--check").arg(config);
    output_ok(cmd, &format!("capybara --check ({what})"));
}

/// Runs `cmd`, killing it if it outlives `limit`.
pub fn run_with_timeout(cmd: Command, limit: Duration) -> Output {
    let shown = format!("{cmd:?}");
    try_run_with_timeout(cmd, limit).unwrap_or_else(|out| {
        panic!(
            "command timed out after {limit:?}: {shown}\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Runs `cmd` to completion: `Ok` with its output, or `Err` with what it
/// wrote before it was killed for outliving `limit`. Its stdout and stderr
/// are read while it runs (a child writing more than a pipe holds would
/// otherwise block until the limit).
pub fn try_run_with_timeout(mut cmd: Command, limit: Duration) -> Result<Output, Output> {
    use std::io::Read;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let start = Instant::now();
    let (status, timed_out) = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break (st, false);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break (child.wait().expect("wait"), true);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // The pipes close when the child exits, unless it left a process of its
    // own holding them: wait for those a bounded time, not forever.
    let join = |h: std::thread::JoinHandle<Vec<u8>>| {
        let t = Instant::now();
        while !h.is_finished() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if h.is_finished() {
            h.join().unwrap_or_default()
        } else {
            Vec::new()
        }
    };
    let output = Output {
        status,
        stdout: join(out),
        stderr: join(err),
    };
    if timed_out {
        Err(output)
    } else {
        Ok(output)
    }
}

/// Writes a hostagent configuration for lab server `j` serving an HTTP
/// service on port 80 and an echo service on port 7 of `listen_ip` (the
/// server's data address when clients connect directly, a VIP behind the
/// switch). `backend_lines` go into `[interface]` (e.g. the DPDK backend).
pub fn hostagent_config(
    dir: &std::path::Path,
    j: u32,
    listen_ip: &str,
    backend_lines: &str,
) -> PathBuf {
    let data = format!("198.18.2.{}", 10 + j);
    let text = format!(
        "name = \"s{j}\"\n[interface]\nname = \"eth0\"\n{backend_lines}\n[stack]\naddress = \"{data}\"\ngateway = \"198.18.1.1\"\n\
         [[service]]\nlisten = \"{listen_ip}:80\"\napp = \"http\"\n[[service]]\nlisten = \"{listen_ip}:7\"\napp = \"echo\"\n"
    );
    let path = dir.join(format!("hostagent-s{j}.toml"));
    std::fs::write(&path, text).expect("write hostagent config");
    path
}

/// A scratch directory under `test-output/` named after the test, emptied
/// first; logs written there survive a failed run for inspection.
pub fn output_dir(test: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("test-output")
        .join(test);
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("create test output dir");
    root
}

/// Writes a deployment key (hex) into `dir` and returns its path.
pub fn deployment_key(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("deployment.key");
    let bytes: Vec<u8> = (0..32)
        .map(|i| (i * 37 + std::process::id() as usize) as u8)
        .collect();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&path, hex).expect("write key");
    path
}

/// Where an appliance lab test starts: the output directory `test`
/// ([`output_dir`]), a lab of `servers` servers (`tag`: [`Lab::up`]), a
/// deployment key ([`deployment_key`]) and an appliance config for them
/// with its API on `api_listen` ([`appliance_config`]); nothing started
/// yet. Returns (lab, dir, key, config).
pub fn appliance_lab(
    test: &str,
    tag: &str,
    servers: u32,
    api_listen: &str,
) -> (Lab, PathBuf, PathBuf, PathBuf) {
    let dir = output_dir(test);
    let lab = Lab::up(tag, servers);
    let key = deployment_key(&dir);
    let config = appliance_config(&lab, &dir, servers, &key, api_listen);
    (lab, dir, key, config)
}

/// Where a switchd lab test starts: [`appliance_lab`]'s output directory,
/// lab and deployment key, and a switchd config for them
/// ([`switchd_config`]); nothing started yet. Returns (lab, dir, key,
/// switchd config).
pub fn switchd_lab(test: &str, tag: &str, servers: u32) -> (Lab, PathBuf, PathBuf, PathBuf) {
    let dir = output_dir(test);
    let lab = Lab::up(tag, servers);
    let key = deployment_key(&dir);
    let config = switchd_config(&lab, &dir, servers, &key);
    (lab, dir, key, config)
}

/// A switchd configuration for `lab` with `servers` servers and one client:
/// echo on VIP 198.18.100.1:7 and HTTP on :80, every registered server in
/// the pool, SQLite store in `dir`, XDP links pinned in the lab's
/// [`Lab::pin_dir`] (`pin_dir` right after `[ha]`'s `enabled` line).
pub fn switchd_config(
    lab: &Lab,
    dir: &std::path::Path,
    servers: u32,
    key: &std::path::Path,
) -> PathBuf {
    let mut t = format!(
        "control_listen = \"198.18.1.1:7692\"\nkey_file = \"{}\"\nplacement = \"maglev\"\n\
         target_selection = \"round_robin\"\nload_interval_us = 1000\nheartbeat_interval_ms = 100\n\
         dead_after_ms = 1000\nclosed_linger_ms = 5000\nmetrics_listen = \"127.0.0.1:9102\"\n\
         store = \"sqlite:{}\"\n[ha]\nenabled = false\npin_dir = {:?}\n[[interfaces]]\nname = \"cl1\"\nrole = \"client\"\n",
        key.display(),
        dir.join("store.db").display(),
        lab.pin_dir()
    );
    for j in 1..=servers {
        t.push_str(&format!(
            "[[interfaces]]\nname = \"sv{j}\"\nrole = \"server\"\n"
        ));
    }
    t.push_str("[[services]]\nname = \"echo\"\nvip = \"198.18.100.1:7\"\npool = []\n");
    t.push_str("[[services]]\nname = \"web\"\nvip = \"198.18.100.1:80\"\npool = []\n");
    let path = dir.join("switchd.toml");
    std::fs::write(&path, t).expect("write switchd config");
    path
}

/// A hostagent configuration for server `j` behind the switch: services on
/// the VIP, migration and control channel on; `churn` = (every_ms, target
/// server) makes it migrate everything it serves to that server periodically.
pub fn hostagent_migrating_config(
    dir: &std::path::Path,
    j: u32,
    key: &std::path::Path,
    churn: Option<(u64, u32)>,
) -> PathBuf {
    let base = hostagent_config(dir, j, "198.18.100.1", "");
    let mut t = std::fs::read_to_string(&base).expect("read base config");
    t.push_str(&format!(
        "[migration]\nkey_file = \"{}\"\nswitch = \"198.18.1.1\"\n",
        key.display()
    ));
    if let Some((every, to)) = churn {
        t.push_str(&format!(
            "churn_every_ms = {every}\nchurn_to = \"198.18.2.{}\"\n",
            10 + to
        ));
    }
    t.push_str(&format!(
        "[control]\nswitch = \"198.18.1.1:7692\"\nserver_id = {j}\nmanagement = \"198.18.1.{}\"\n",
        10 + j
    ));
    std::fs::write(&base, t).expect("write hostagent config");
    base
}

#[cfg(test)]
mod tests {
    #[test]
    fn exposition_check_takes_what_scrapers_take() {
        super::assert_exposition(
            "# HELP a_b A help.\n# TYPE a_b gauge\na_b{x=\"1 2\"} 3\nc:d 1.5e3 1700000000\n\ne NaN\n#\n",
            "good",
        );
        for bad in [
            "   # TYPE a gauge\n",
            " a 1\n",
            "a{x=\"1\"}\n",
            "1a 2\n",
            "a one\n",
        ] {
            let r = std::panic::catch_unwind(|| super::assert_exposition(bad, "bad"));
            assert!(r.is_err(), "{bad:?} passed");
        }
    }
}
