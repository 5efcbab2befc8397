//! eBPF/XDP backend of [`DataPlane`]: loads `bpf/switch.bpf.c` (compiled by
//! build.rs and embedded), owns its maps, attaches it to interfaces, and
//! runs it on crafted packets through BPF_PROG_TEST_RUN for tests and the
//! benchmark.
//!
//! Maps are not pinned: they live as long as the value, or as long as a
//! program using them runs. XDP attachments are bpf_links: unpinned, the
//! kernel detaches them when they are dropped (also when the process dies);
//! pinned in bpffs ([`LinkPins`], [`BpfDataPlane::attach_pinned`]), they
//! keep the program (and so its maps) forwarding after the process dies,
//! until a successor replaces the program in place or the pin is removed.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libbpf_rs::{
    MapCore, MapFlags, MapHandle, Object, ObjectBuilder, RingBuffer, RingBufferBuilder,
};

use crate::abi::*;
use crate::dataplane::{check_range, DataPlane, DataPlaneError, FlowEvent, FlowScanCursor, Result};

/// An XDP attachment: a bpf_link, created with `bpf_link_create` (flags 0:
/// native XDP where the driver has it; generic with
/// [`BpfDataPlane::set_generic_xdp`]) or taken over from a pin. Without a
/// pin it dies with the process and detaches when dropped. Pinned (in the
/// directory of [`LinkPins`]), it outlives the process: the program keeps
/// forwarding until a successor replaces it in place (`BPF_LINK_UPDATE`)
/// or [`BpfDataPlane::detach_all`] removes the pin.
struct XdpLink {
    /// Held to keep the link (dropping it detaches an unpinned one).
    fd: std::os::fd::OwnedFd,
    pin: Option<std::path::PathBuf>,
}

fn os_err(rc: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(-rc)
}

fn create_xdp_link(prog_fd: i32, ifindex: u32, flags: u32) -> Result<std::os::fd::OwnedFd> {
    use libbpf_rs::libbpf_sys;
    use std::os::fd::FromRawFd;
    let opts = libbpf_sys::bpf_link_create_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as _,
        flags,
        ..Default::default()
    };
    // SAFETY: valid program fd and options struct; the returned fd is ours.
    let fd =
        unsafe { libbpf_sys::bpf_link_create(prog_fd, ifindex as i32, libbpf_sys::BPF_XDP, &opts) };
    if fd < 0 {
        return Err(DataPlaneError::Load(format!(
            "attach {}XDP to ifindex {ifindex}: {}",
            if flags == 0 { "" } else { "generic " },
            os_err(fd)
        )));
    }
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// (link type, program id, ifindex) of a bpf_link; ifindex 0 for an XDP
/// link whose device is gone (defunct).
fn xdp_link_info(fd: &std::os::fd::OwnedFd) -> std::io::Result<(u32, u32, u32)> {
    use libbpf_rs::libbpf_sys;
    use std::os::fd::AsRawFd;
    // SAFETY: zeroed plain-data struct, filled by the kernel up to `len`.
    let mut info: libbpf_sys::bpf_link_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_link_info>() as u32;
    // SAFETY: valid fd, buffer and length.
    let rc = unsafe { libbpf_sys::bpf_link_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc < 0 {
        return Err(os_err(rc));
    }
    // SAFETY: the union member of XDP links; for other types the caller
    // looks at the type first.
    let ifindex = unsafe { info.__bindgen_anon_1.xdp.ifindex };
    Ok((info.type_, info.prog_id, ifindex))
}

fn bpf_obj_get(path: &std::path::Path) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: NUL-terminated path; the returned fd is ours.
    let fd = unsafe { libbpf_rs::libbpf_sys::bpf_obj_get(c.as_ptr()) };
    if fd < 0 {
        return Err(os_err(fd));
    }
    // SAFETY: fresh descriptor.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

fn bpf_obj_pin(fd: &std::os::fd::OwnedFd, path: &std::path::Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: valid fd and NUL-terminated path.
    let rc = unsafe { libbpf_rs::libbpf_sys::bpf_obj_pin(fd.as_raw_fd(), c.as_ptr()) };
    if rc < 0 {
        return Err(os_err(rc));
    }
    Ok(())
}

/// (id, map ids) of a loaded program.
fn prog_info(fd: i32, map_ids: &mut Vec<u32>) -> std::io::Result<u32> {
    use libbpf_rs::libbpf_sys;
    // SAFETY: zeroed plain-data struct, filled by the kernel up to `len`.
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: valid fd, buffer and length; no arrays asked for.
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd, &mut info, &mut len) };
    if rc < 0 {
        return Err(os_err(rc));
    }
    let id = info.id;
    let n = info.nr_map_ids as usize;
    if n > 0 {
        let mut ids = vec![0u32; n];
        // SAFETY: as above.
        let mut again: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
        again.nr_map_ids = n as u32;
        again.map_ids = ids.as_mut_ptr() as u64;
        let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
        // SAFETY: `map_ids` points at `n` u32s that outlive the call.
        let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd, &mut again, &mut len) };
        if rc < 0 {
            return Err(os_err(rc));
        }
        ids.truncate((again.nr_map_ids as usize).min(n));
        *map_ids = ids;
    }
    Ok(id)
}

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Whether `path` (or, if it does not exist yet, its nearest existing
/// ancestor) is on a bpffs mount.
pub fn on_bpffs(path: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let mut p = Some(path);
    // Bounded by the path's components.
    while let Some(d) = p {
        if d.exists() {
            let Ok(c) = std::ffi::CString::new(d.as_os_str().as_bytes()) else {
                return false;
            };
            // SAFETY: zeroed plain-data struct filled by statfs.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            // SAFETY: NUL-terminated path, valid out pointer.
            if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
                return false;
            }
            return st.f_type as i64 == BPF_FS_MAGIC;
        }
        p = d.parent();
    }
    false
}

/// The directory of one switchd pair's pinned XDP links
/// (`<root>/net<netns inode>-<election>`: one per network namespace, where
/// interface indexes mean something, and election) and the locks on it:
///
/// - the **owner lock**, an exclusive `flock` on the directory itself,
///   held by the switchd whose program the pinned links run (from before
///   it attaches until it exits). The kernel releases it when the process
///   dies, however it dies: a standby that gets it knows the active is
///   gone, and a live active is never displaced (the fence);
/// - the **standby mark**, a shared `flock` on `<dir>/standby`, held by
///   every standby of this namespace and election: a stopping active that
///   sees it hands its links over (leaves the pins) instead of detaching.
///
/// Not on the per-packet path: a few system calls at start, takeover and
/// stop, and one `flock` per poll while standing by.
pub struct LinkPins {
    dir: std::path::PathBuf,
    owner: Option<std::fs::File>,
    standby: Option<std::fs::File>,
}

fn flock(f: &std::fs::File, op: i32) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on a valid fd.
    if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

impl LinkPins {
    /// The directory for `election` in this network namespace under
    /// `root`, created if needed. Err (with the reason) when `root` is not
    /// on bpffs in this mount namespace or the directory cannot be made.
    pub fn open(root: &std::path::Path, election: &str) -> std::result::Result<Self, String> {
        use std::os::unix::fs::MetadataExt;
        if !on_bpffs(root) {
            return Err(format!(
                "{} is not on a bpffs mount in this mount namespace",
                root.display()
            ));
        }
        let ns = std::fs::metadata("/proc/thread-self/ns/net")
            .map_err(|e| format!("network namespace of this process: {e}"))?
            .ino();
        let name: String = election
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let dir = root.join(format!("net{ns}-{name}"));
        let pins = LinkPins {
            dir,
            owner: None,
            standby: None,
        };
        pins.make_dir()?;
        Ok(pins)
    }

    fn make_dir(&self) -> std::result::Result<(), String> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| format!("cannot create {}: {e}", self.dir.display()))
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Where the link of `ifindex` is pinned.
    pub fn link_path(&self, ifindex: u32) -> std::path::PathBuf {
        self.dir.join(format!("xdp-{ifindex}"))
    }

    /// Takes the owner lock if it is free (non-blocking); true if held now.
    /// A directory removed by a stopping owner meanwhile is made again and
    /// the lock taken on the new one (a lock on a removed directory would
    /// fence nobody).
    pub fn try_own(&mut self) -> std::io::Result<bool> {
        use std::os::unix::fs::MetadataExt;
        if self.owner.is_some() {
            return Ok(true);
        }
        // Bounded: a removal races at most a few times.
        for _ in 0..3 {
            self.make_dir().map_err(std::io::Error::other)?;
            let f = match std::fs::File::open(&self.dir) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            if !flock(&f, libc::LOCK_EX | libc::LOCK_NB)? {
                return Ok(false);
            }
            let same = match (f.metadata(), std::fs::metadata(&self.dir)) {
                (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
                _ => false,
            };
            if same {
                self.owner = Some(f);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// [`Self::try_own`] every 5 ms for up to `limit`, or until `stop`.
    pub fn own_within(
        &mut self,
        limit: std::time::Duration,
        stop: impl Fn() -> bool,
    ) -> std::io::Result<bool> {
        let t0 = std::time::Instant::now();
        // Bounded by `limit`.
        loop {
            if self.try_own()? {
                return Ok(true);
            }
            if t0.elapsed() >= limit || stop() {
                return Ok(false);
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    pub fn owned(&self) -> bool {
        self.owner.is_some()
    }

    /// Releases the owner lock (a standby then takes over).
    pub fn disown(&mut self) {
        self.owner = None;
    }

    /// Marks this process as a standby (shared lock on `<dir>/standby`).
    pub fn stand_by(&mut self) -> std::io::Result<()> {
        if self.standby.is_some() {
            return Ok(());
        }
        let p = self.dir.join("standby");
        match std::fs::create_dir(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let f = std::fs::File::open(&p)?;
        flock(&f, libc::LOCK_SH)?;
        self.standby = Some(f);
        Ok(())
    }

    /// Drops the standby mark (on becoming the owner).
    pub fn end_standby(&mut self) {
        self.standby = None;
    }

    /// Whether another process of this namespace and election stands by.
    pub fn standby_waiting(&self) -> bool {
        let p = self.dir.join("standby");
        let Ok(f) = std::fs::File::open(&p) else {
            return false;
        };
        match flock(&f, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(true) => {
                let _ = flock(&f, libc::LOCK_UN);
                false
            }
            // Held shared by a standby (the owner, who asks, holds no mark).
            Ok(false) => true,
            Err(_) => false,
        }
    }

    /// Removes the directory if nothing is left in it (the standby mark if
    /// no standby holds it, then the directory, then `root` if empty);
    /// best effort, after the pins are gone.
    pub fn remove_if_unused(&mut self) {
        if self.standby.is_some() || self.standby_waiting() {
            return;
        }
        let _ = std::fs::remove_dir(self.dir.join("standby"));
        let _ = std::fs::remove_dir(&self.dir);
        if let Some(root) = self.dir.parent() {
            let _ = std::fs::remove_dir(root);
        }
    }
}

/// How [`BpfDataPlane::attach`] attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attached {
    /// A new link; `pinned`: in the pin directory.
    New { pinned: bool },
    /// A pinned link left by a predecessor (dead, or handing over) now runs
    /// this program: replaced in place with `BPF_LINK_UPDATE`, no packet
    /// without a program. `old_prog`: the predecessor's program id.
    Replaced { old_prog: u32 },
}

/// What a takeover copied from the predecessor's program
/// ([`BpfDataPlane::attach_pinned`], [`BpfDataPlane::finish_adoption`];
/// `/status` `adopted`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Adopted {
    /// Flow entries this table lacked (placed after the last sync from the
    /// store), copied.
    pub flows: usize,
    /// Flow entries not copied: their server or service is unknown here.
    pub flows_skipped: usize,
    /// Migration entries copied, pending and final.
    pub migrations: usize,
    /// Of those, pending: migrations in flight at the takeover.
    pub migrations_pending: usize,
    /// Migration entries not copied: their server is unknown here.
    pub migrations_skipped: usize,
    /// PREPARE steering memories (migration id -> target) copied.
    pub prepare_targets: usize,
    /// Origins whose last migration id (`origin_ids`, for REGISTER_ACK)
    /// was taken from the predecessor's tables.
    pub origin_ids: usize,
    /// Migration entries the predecessor's program changed between the copy
    /// and the last link's switch (a migration settled, started or reset
    /// in that window), applied here by `finish_adoption`.
    pub settled_late: usize,
    /// Final entries naming another owner than this flow table (the
    /// store's): MIGRATED events queued for the store.
    pub owner_events: usize,
    /// Flows whose FINs (one way or both) the predecessor's program saw
    /// and this table (the store's copy) lacked: flags merged here.
    pub fins_merged: usize,
    /// Flows the predecessor's program had seen closed (CLOSING): CLOSED
    /// events queued, so the closed-flow reaper removes them after
    /// `closed_linger` and the store forgets them.
    pub closed: usize,
}

/// The predecessor's maps, held between the copy and
/// [`BpfDataPlane::finish_adoption`] (held, they outlive its program).
struct Predecessor {
    flows: MapHandle,
    migrations: MapHandle,
    servers: MapHandle,
    /// Its server index -> ours (`None`: unknown here).
    server_of: std::collections::HashMap<u32, Option<u32>>,
    /// Migration entries copied: key -> (its value, ours).
    copied: std::collections::HashMap<CFlowKey, (CMigration, CMigration)>,
}

/// Key of `prepare_targets`: a migration id, host order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct MigId(u64);
// SAFETY: one u64, no padding.
unsafe impl Pod for MigId {}

/// Value of `prepare_targets`: a server index.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TargetIdx(u32);
// SAFETY: one u32, no padding.
unsafe impl Pod for TargetIdx {}

/// Key of `origin_ids`: an origin's data address, network order (as read
/// off the wire, in a native u32).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct OriginAddr(u32);
// SAFETY: one u32, no padding.
unsafe impl Pod for OriginAddr {}

impl OriginAddr {
    fn of(ip: std::net::Ipv4Addr) -> Self {
        OriginAddr(u32::from_ne_bytes(ip.octets()))
    }
}

/// The newest id of each origin (its data address, from the id's high 32
/// bits) among `ids`, merged into `into`.
fn newest_per_origin(
    ids: impl IntoIterator<Item = u64>,
    into: &mut std::collections::HashMap<OriginAddr, u64>,
) {
    for id in ids {
        if id >> 32 == 0 {
            continue;
        }
        let origin = OriginAddr::of(std::net::Ipv4Addr::from((id >> 32) as u32));
        let e = into.entry(origin).or_insert(id);
        if capybara_proto::tcpmig::migration_id_newer(id, *e) {
            *e = id;
        }
    }
}

/// A CLOSED event of flow `key` on `server`, for the control plane (its
/// closed-flow reaper) and the store.
fn closed_event(key: CFlowKey, server: u32) -> CFlowEvent {
    CFlowEvent {
        key,
        kind: EV_CLOSED,
        server,
        prev_server: server,
        ts_ns: 0,
    }
}

/// The predecessor's server index `old` as ours: the same data address
/// (`old_servers`: its `servers` map; `by_addr`: our `server_by_addr`).
/// Remembered in `cache`. `None`: an empty slot there, or an address
/// unknown here.
fn translate_server(
    old_servers: &MapHandle,
    by_addr: &MapHandle,
    cache: &mut std::collections::HashMap<u32, Option<u32>>,
    old: u32,
) -> Option<u32> {
    *cache.entry(old).or_insert_with(|| {
        old_servers
            .lookup(&old.to_ne_bytes(), MapFlags::ANY)
            .ok()
            .flatten()
            .and_then(|v| CServer::from_bytes(&v))
            .filter(|s| s.data_ip != 0)
            .and_then(|s| {
                by_addr
                    .lookup(&s.data_ip.to_ne_bytes(), MapFlags::ANY)
                    .ok()
                    .flatten()
            })
            .and_then(|v| {
                v.get(..4)
                    .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            })
    })
}

/// The compiled XDP object.
pub static SWITCH_BPF_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/switch.bpf.o"));

const PROG_NAME: &str = "capy_switch";

/// The compiled table counter (`bpf/count.bpf.c`), loaded after the XDP
/// object with that object's `flows` and `migrations` maps.
pub static COUNT_BPF_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/count.bpf.o"));

const COUNT_PROG_NAME: &str = "capy_count";

/// Most entries the fallback walk counts per table (kernels without
/// `bpf_map_sum_elem_count`, see [`TableCounts`]).
pub const TABLE_COUNT_CAP: usize = 100_000;

/// Entries in the flow and migration tables ([`BpfDataPlane::table_counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableCounts {
    pub flows: usize,
    pub migrations: usize,
    /// True: read from the kernel's per-CPU element counters of both maps
    /// (Linux 6.6 and later), exact and O(1). False: the fallback, a walk of
    /// both maps (`BPF_MAP_LOOKUP_BATCH`, in proportion to their buckets)
    /// that stops at [`TABLE_COUNT_CAP`] entries each ("at least").
    pub exact: bool,
}

/// The loaded `bpf/count.bpf.c`: a syscall program that reads both tables'
/// element counters with the kfunc `bpf_map_sum_elem_count`, run with one
/// BPF_PROG_TEST_RUN (its context, two s64, is copied back).
struct Counter {
    obj: Object,
}

impl Counter {
    /// Loads the counter on `flows` and `migrations`; the error says why it
    /// cannot run here (e.g. a kernel before 6.6 has no such kfunc).
    fn load(flows: &MapHandle, migrations: &MapHandle) -> std::result::Result<Self, String> {
        use std::os::fd::AsFd;
        let mut open = ObjectBuilder::default()
            .open_memory(COUNT_BPF_OBJ)
            .map_err(|e| e.to_string())?;
        for mut m in open.maps_mut() {
            let fd = match m.name().to_str() {
                Some("flows") => flows.as_fd(),
                Some("migrations") => migrations.as_fd(),
                _ => continue,
            };
            m.reuse_fd(fd).map_err(|e| format!("reuse map fd: {e}"))?;
        }
        let c = Counter {
            obj: open.load().map_err(|e| e.to_string())?,
        };
        // Run once: a kernel that loads the program but cannot run it is a
        // fallback case too, found here rather than at the first /status.
        c.run().map_err(|e| e.to_string())?;
        Ok(c)
    }

    /// (flows, migrations) as the kernel counts them.
    fn run(&self) -> Result<(usize, usize)> {
        let p = self
            .obj
            .progs_mut()
            .find(|p| p.name() == COUNT_PROG_NAME)
            .ok_or_else(|| DataPlaneError::Load(format!("program {COUNT_PROG_NAME} missing")))?;
        // struct capy_table_counts: two s64, written by the program.
        let mut ctx = [0u8; 16];
        let out = p
            .test_run(libbpf_rs::ProgramInput {
                context_in: Some(&mut ctx),
                ..Default::default()
            })
            .map_err(|e| DataPlaneError::Map {
                map: "flows",
                op: "count",
                detail: e.to_string(),
            })?;
        if out.return_value != 0 {
            return Err(DataPlaneError::Map {
                map: "flows",
                op: "count",
                detail: format!("counter returned {}", out.return_value),
            });
        }
        // A per-CPU sum read while other CPUs insert and delete is exact
        // only at rest; it is never below 0 for long, but clamp anyway.
        let at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&ctx[i * 8..i * 8 + 8]);
            usize::try_from(i64::from_ne_bytes(b)).unwrap_or(0)
        };
        Ok((at(0), at(1)))
    }
}

/// Map capacities chosen at load time (defaults: the header's).
#[derive(Debug, Clone, Copy)]
pub struct BpfOptions {
    pub max_flows: u32,
    pub max_migrations: u32,
    /// Ring buffer bytes (power of two, >= page size).
    pub event_ring_bytes: u32,
}

impl Default for BpfOptions {
    fn default() -> Self {
        BpfOptions {
            max_flows: MAX_FLOWS,
            max_migrations: MAX_MIGRATIONS,
            event_ring_bytes: 1 << 22,
        }
    }
}

impl BpfOptions {
    /// Small maps for tests: quick to create, little memory.
    pub fn small() -> Self {
        BpfOptions {
            max_flows: 4096,
            max_migrations: 4096,
            event_ring_bytes: 1 << 16,
        }
    }
}

/// Result of one BPF_PROG_TEST_RUN.
#[derive(Debug, Clone)]
pub struct TestRun {
    /// XDP action (XDP_DROP=1, XDP_PASS=2, XDP_TX=3, XDP_REDIRECT=4).
    pub verdict: u32,
    /// The packet as the program left it.
    pub packet: Vec<u8>,
    /// Average time per repetition, as measured by the kernel.
    pub duration: Duration,
}

pub const XDP_ABORTED: u32 = 0;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

/// The Maglev map mapped into this process (it is `BPF_F_MMAPABLE`): a
/// placement change writes its changed slots with plain stores (tens of
/// microseconds, preemptible) instead of BPF_MAP_UPDATE_BATCH system calls
/// (four of 2-4 ms for the half of a table that changes when one of two
/// servers leaves, strace on the loaded lab machine).
///
/// Each slot is an aligned u32 written with one store, so the program sees
/// a slot's old or new server index, never a mix. Order against the other
/// maps is kept by the callers as with system calls: a server entry is
/// written before slots point at it and cleared only after no slot does;
/// [`MaglevMem::store_all`] ends with a full fence, so its stores are
/// visible before any later map update.
struct MaglevMem {
    base: std::ptr::NonNull<u8>,
    len: usize,
    /// Bytes between elements: the kernel's round_up(value_size, 8).
    stride: usize,
    entries: usize,
}

impl MaglevMem {
    fn map(m: &MapHandle) -> Result<Self> {
        use std::os::fd::{AsFd, AsRawFd};
        let err = |detail: String| DataPlaneError::Map {
            map: "maglev",
            op: "mmap",
            detail,
        };
        let value_size = m.value_size() as usize;
        if value_size != 4 {
            return Err(err(format!("value size {value_size}, expected 4")));
        }
        let stride = value_size.next_multiple_of(8);
        let entries = m.max_entries() as usize;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = usize::try_from(page)
            .ok()
            .filter(|p| *p > 0)
            .unwrap_or(4096);
        let len = (entries * stride).next_multiple_of(page);
        // SAFETY: a fresh shared mapping of the map's fd; the kernel checks
        // that the map is mmapable and `len` within its data.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                m.as_fd().as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err(std::io::Error::last_os_error().to_string()));
        }
        let base =
            std::ptr::NonNull::new(p as *mut u8).ok_or_else(|| err("null mapping".into()))?;
        let mem = MaglevMem {
            base,
            len,
            stride,
            entries,
        };
        // The layout is the kernel's, not ours: check it once through the
        // system call on the last element (a wrong stride would miss it).
        let last = (entries - 1) as u32;
        mem.store(last as usize, 0x5A5A_0001);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let seen = m
            .lookup(&last.to_ne_bytes(), MapFlags::ANY)
            .map_err(map_err("maglev", "lookup"))?
            .and_then(|v| {
                v.get(..4)
                    .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            });
        mem.store(last as usize, 0);
        if seen != Some(0x5A5A_0001) {
            return Err(err(format!(
                "layout check: slot {last} reads {seen:?} through the kernel"
            )));
        }
        Ok(mem)
    }

    fn slot(&self, idx: usize) -> &std::sync::atomic::AtomicU32 {
        assert!(idx < self.entries, "maglev slot {idx} out of range");
        // SAFETY: idx < entries, so the element lies inside the mapping,
        // 8-byte aligned (page-aligned base, stride 8); the mapping lives as
        // long as `self`; the kernel and the program access it only with
        // aligned 32-bit loads and stores.
        unsafe {
            std::sync::atomic::AtomicU32::from_ptr(
                self.base.as_ptr().add(idx * self.stride) as *mut u32
            )
        }
    }

    fn store(&self, idx: usize, v: u32) {
        self.slot(idx)
            .store(v, std::sync::atomic::Ordering::Relaxed);
    }

    /// Writes every `(element, value)` pair, then fences.
    fn store_all(&self, writes: impl Iterator<Item = (usize, u32)>) {
        for (i, v) in writes {
            self.store(i, v);
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

// SAFETY: the mapping is process memory, not tied to the thread that made
// it; it is accessed only through atomics and unmapped once, on drop.
// (`BpfDataPlane` is Send, e.g. to be moved into the control thread.)
unsafe impl Send for MaglevMem {}

impl Drop for MaglevMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe {
            libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len);
        }
    }
}

struct Maps {
    flows: MapHandle,
    migrations: MapHandle,
    servers: MapHandle,
    server_by_addr: MapHandle,
    services: MapHandle,
    maglev: MapHandle,
    rings: MapHandle,
    ifaces: MapHandle,
    tx_ports: MapHandle,
    config: MapHandle,
    server_stats: MapHandle,
    stats: MapHandle,
    prepare_targets: MapHandle,
    origin_ids: MapHandle,
    unmatched_outcomes: MapHandle,
}

pub struct BpfDataPlane {
    // Field order matters: the ring buffer borrows `_event_map` and must be
    // dropped first.
    ringbuf: RingBuffer<'static>,
    pending: Arc<Mutex<Vec<FlowEvent>>>,
    _event_map: Box<MapHandle>,
    maglev_mem: MaglevMem,
    maps: Maps,
    links: Vec<(u32, XdpLink)>,
    /// Attach in generic (SKB) mode ([`Self::set_generic_xdp`]).
    generic_xdp: bool,
    live_servers: BTreeSet<u32>,
    /// The predecessor program whose tables were adopted, and what was
    /// copied.
    adopted_from: Option<u32>,
    adopted: Adopted,
    /// The predecessor's maps, held from the copy until
    /// [`Self::finish_adoption`].
    predecessor: Option<Predecessor>,
    /// Exact table counts; `None`: this kernel cannot, counts walk the maps.
    counter: Option<Counter>,
    obj: Object,
}

fn map_err(map: &'static str, op: &'static str) -> impl FnOnce(libbpf_rs::Error) -> DataPlaneError {
    move |e| DataPlaneError::Map {
        map,
        op,
        detail: e.to_string(),
    }
}

impl BpfDataPlane {
    /// Loads the program and creates its maps (needs CAP_BPF / root).
    pub fn load(opts: BpfOptions) -> Result<Self> {
        let load_err = |e: libbpf_rs::Error| DataPlaneError::Load(e.to_string());
        let mut open = ObjectBuilder::default()
            .open_memory(SWITCH_BPF_OBJ)
            .map_err(load_err)?;
        for mut m in open.maps_mut() {
            let n = m.name().to_string_lossy().to_string();
            let size = match n.as_str() {
                "flows" => Some(opts.max_flows),
                "migrations" => Some(opts.max_migrations),
                "flow_events" => Some(opts.event_ring_bytes),
                _ => None,
            };
            if let Some(s) = size {
                m.set_max_entries(s).map_err(load_err)?;
            }
        }
        let obj = open.load().map_err(load_err)?;
        let handle = |name: &'static str| -> Result<MapHandle> {
            let m = obj
                .maps()
                .find(|m| m.name() == name)
                .ok_or_else(|| DataPlaneError::Load(format!("map {name} missing from object")))?;
            MapHandle::try_from(&m).map_err(map_err(name, "open"))
        };
        let maps = Maps {
            flows: handle("flows")?,
            migrations: handle("migrations")?,
            servers: handle("servers")?,
            server_by_addr: handle("server_by_addr")?,
            services: handle("services")?,
            maglev: handle("maglev")?,
            rings: handle("rings")?,
            ifaces: handle("ifaces")?,
            tx_ports: handle("tx_ports")?,
            config: handle("config")?,
            server_stats: handle("server_stats")?,
            stats: handle("stats")?,
            prepare_targets: handle("prepare_targets")?,
            origin_ids: handle("origin_ids")?,
            unmatched_outcomes: handle("unmatched_outcomes")?,
        };
        let maglev_mem = MaglevMem::map(&maps.maglev)?;
        let event_map = Box::new(handle("flow_events")?);
        // SAFETY: the Box is kept in the struct and outlives the ring
        // buffer (declared, hence dropped, before it); its heap address is
        // stable.
        let event_ref: &'static MapHandle = unsafe { &*(event_map.as_ref() as *const MapHandle) };
        let pending = Arc::new(Mutex::new(Vec::new()));
        let sink = pending.clone();
        let mut builder = RingBufferBuilder::new();
        builder
            .add(event_ref, move |bytes: &[u8]| {
                if let (Some(ev), Ok(mut v)) = (CFlowEvent::from_bytes(bytes), sink.lock()) {
                    v.push(ev);
                }
                0
            })
            .map_err(map_err("flow_events", "ringbuf"))?;
        let ringbuf = builder.build().map_err(map_err("flow_events", "ringbuf"))?;
        let counter = match Counter::load(&maps.flows, &maps.migrations) {
            Ok(c) => Some(c),
            Err(e) => {
                // Once per load: the process keeps the walk from then on.
                eprintln!(
                    "switchd: exact table counts unavailable ({e}); flow and migration \
                     counts walk the maps, up to {TABLE_COUNT_CAP} entries each"
                );
                None
            }
        };
        Ok(BpfDataPlane {
            ringbuf,
            pending,
            _event_map: event_map,
            maglev_mem,
            maps,
            links: Vec::new(),
            generic_xdp: false,
            live_servers: BTreeSet::new(),
            adopted_from: None,
            adopted: Adopted::default(),
            predecessor: None,
            counter,
            obj,
        })
    }

    /// Entries in the flow and migration tables: exact from the kernel's
    /// element counters (one system call of a few microseconds whatever
    /// the tables hold), or, where the kernel has no counter, walked and
    /// capped ([`TableCounts::exact`]).
    pub fn table_counts(&mut self) -> Result<TableCounts> {
        if let Some(c) = &self.counter {
            match c.run() {
                Ok((flows, migrations)) => {
                    return Ok(TableCounts {
                        flows,
                        migrations,
                        exact: true,
                    })
                }
                // Not seen; but a count is for status only: never an error
                // that stops the caller, and logged once.
                Err(e) => {
                    eprintln!(
                        "switchd: exact table count failed ({e}); flow and migration counts \
                         walk the maps from now on, up to {TABLE_COUNT_CAP} entries each"
                    );
                    self.counter = None;
                }
            }
        }
        Ok(TableCounts {
            flows: count_entries::<CFlowKey, CFlow>(&self.maps.flows, "flows", TABLE_COUNT_CAP)?,
            migrations: count_entries::<CFlowKey, CMigration>(
                &self.maps.migrations,
                "migrations",
                TABLE_COUNT_CAP,
            )?,
            exact: false,
        })
    }

    /// Whether [`Self::table_counts`] is exact (the kernel's counters).
    pub fn exact_counts(&self) -> bool {
        self.counter.is_some()
    }

    /// Drops the exact counter: counts walk the maps from then on, as on a
    /// kernel without one (tests of that fallback, and measuring it).
    pub fn use_walk_counts(&mut self) {
        self.counter = None;
    }

    fn with_prog<T>(&self, f: impl FnOnce(&libbpf_rs::ProgramMut<'_>) -> T) -> Result<T> {
        let p = self
            .obj
            .progs_mut()
            .find(|p| p.name() == PROG_NAME)
            .ok_or_else(|| DataPlaneError::Load(format!("program {PROG_NAME} missing")))?;
        Ok(f(&p))
    }

    fn prog_fd(&self) -> Result<i32> {
        use std::os::fd::{AsFd, AsRawFd};
        self.with_prog(|p| p.as_fd().as_raw_fd())
    }

    fn xdp_flags(&self) -> u32 {
        if self.generic_xdp {
            libbpf_rs::libbpf_sys::XDP_FLAGS_SKB_MODE
        } else {
            0
        }
    }

    /// Attaches the program to `ifindex` (native XDP where the driver has
    /// it, generic otherwise). Detached when `self` is dropped or by
    /// [`Self::detach_all`].
    pub fn attach(&mut self, ifindex: u32) -> Result<()> {
        let fd = create_xdp_link(self.prog_fd()?, ifindex, self.xdp_flags())?;
        self.links.push((ifindex, XdpLink { fd, pin: None }));
        Ok(())
    }

    /// Attaches the program to `ifindex` through the link pinned at `pin`
    /// ([`LinkPins::link_path`]; the caller owns the pin directory): a live
    /// link left there by a predecessor is made to run this program with
    /// one `BPF_LINK_UPDATE` (atomic: every packet meets one program or the
    /// other); otherwise (no pin, or one whose device is gone) a new link
    /// is created and pinned there. A pin that cannot be made leaves the
    /// link unpinned (it then dies with the process), with a log line.
    pub fn attach_pinned(&mut self, ifindex: u32, pin: &std::path::Path) -> Result<Attached> {
        use libbpf_rs::libbpf_sys;
        use std::os::fd::AsRawFd;
        let prog_fd = self.prog_fd()?;
        match bpf_obj_get(pin) {
            Ok(fd) => match xdp_link_info(&fd) {
                Ok((t, old_prog, idx)) if t == libbpf_sys::BPF_LINK_TYPE_XDP && idx == ifindex => {
                    // Before the switch, while the predecessor's program
                    // (and so its maps) is alive: its flows this table
                    // lacks, its migration entries and PREPARE steering.
                    // Once per predecessor program.
                    if self.adopted_from != Some(old_prog) && old_prog != self.own_prog_id() {
                        self.adopted_from = Some(old_prog);
                        match self.adopt(old_prog) {
                            Ok(n) => self.adopted = n,
                            Err(e) => eprintln!(
                                "switchd: tables of the predecessor's program {old_prog} not copied ({e}); the store's flows are in place, newer ones are recovered by Maglev while the pool is unchanged, migrations in flight are lost"
                            ),
                        }
                    }
                    let opts = libbpf_sys::bpf_link_update_opts {
                        sz: std::mem::size_of::<libbpf_sys::bpf_link_update_opts>() as _,
                        ..Default::default()
                    };
                    // SAFETY: valid link and program fds, options struct.
                    let rc = unsafe { libbpf_sys::bpf_link_update(fd.as_raw_fd(), prog_fd, &opts) };
                    if rc < 0 {
                        return Err(DataPlaneError::Load(format!(
                            "replace the program of the XDP link pinned at {} (ifindex {ifindex}): {}",
                            pin.display(),
                            os_err(rc)
                        )));
                    }
                    self.links.push((
                        ifindex,
                        XdpLink {
                            fd,
                            pin: Some(pin.to_path_buf()),
                        },
                    ));
                    return Ok(Attached::Replaced { old_prog });
                }
                // Its device is gone (ifindex 0), or not an XDP link of
                // this interface: stale, removed below.
                _ => {
                    eprintln!(
                        "switchd: removing the stale pin {} (not a live XDP link of ifindex {ifindex})",
                        pin.display()
                    );
                    let _ = std::fs::remove_file(pin);
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                eprintln!(
                    "switchd: cannot open the pin {} ({e}); removing it",
                    pin.display()
                );
                let _ = std::fs::remove_file(pin);
            }
        }
        let fd = create_xdp_link(prog_fd, ifindex, self.xdp_flags())?;
        let pinned = match bpf_obj_pin(&fd, pin) {
            Ok(()) => true,
            Err(e) => {
                eprintln!(
                    "switchd: cannot pin the XDP link of ifindex {ifindex} at {} ({e}): it detaches when this process ends, a successor attaches after that (a gap)",
                    pin.display()
                );
                false
            }
        };
        self.links.push((
            ifindex,
            XdpLink {
                fd,
                pin: pinned.then(|| pin.to_path_buf()),
            },
        ));
        Ok(Attached::New { pinned })
    }

    /// This data plane's program id (0 if unknown).
    fn own_prog_id(&self) -> u32 {
        self.prog_fd()
            .ok()
            .and_then(|fd| prog_info(fd, &mut Vec::new()).ok())
            .unwrap_or(0)
    }

    /// (copied, skipped) flow entries of the last adoption
    /// ([`Self::adopted`]).
    pub fn adopted_flows(&self) -> (usize, usize) {
        (self.adopted.flows, self.adopted.flows_skipped)
    }

    /// What the last takeover copied from the predecessor's tables
    /// ([`Self::attach_pinned`], [`Self::finish_adoption`]).
    pub fn adopted(&self) -> Adopted {
        self.adopted
    }

    /// Copies what the predecessor's program `old_prog` knows and this
    /// one's tables (the store's copy) lack, while it still forwards:
    /// - flow entries this table lacks (flows it placed after the last sync
    ///   from the store), and the FIN flags of those it has (the store
    ///   keeps none): a flow it saw closed is queued as CLOSED for the
    ///   reaper and the store;
    /// - every migration entry, pending (a migration in flight: the client's
    ///   segments must go on reaching its target, and the CONN_STATE_ACK or
    ///   ABORT that settles it must find it) or final (owners the store may
    ///   not have yet, and the ids the stale PREPARE_ACK checks compare);
    /// - the PREPARE steering memory (retransmissions of a PREPARE reach the
    ///   target its first copy reached).
    ///
    /// Server indexes are translated by data address, services by VIP:port;
    /// an entry naming one unknown here is skipped. The predecessor's maps
    /// are kept until [`Self::finish_adoption`], which applies what its
    /// program changed after this copy.
    fn adopt(&mut self, old_prog: u32) -> Result<Adopted> {
        use libbpf_rs::libbpf_sys;
        use std::collections::HashMap;
        use std::os::fd::{AsRawFd, FromRawFd};
        let err = |op: &'static str, detail: String| DataPlaneError::Map {
            map: "flows",
            op,
            detail,
        };
        // SAFETY: plain syscall; the fd is ours.
        let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(old_prog) };
        if fd < 0 {
            return Err(err("prog_get_fd_by_id", os_err(fd).to_string()));
        }
        // SAFETY: fresh descriptor.
        let prog = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let mut ids = Vec::new();
        prog_info(prog.as_raw_fd(), &mut ids).map_err(|e| err("prog_info", e.to_string()))?;
        let (mut flows, mut servers, mut migrations, mut steering) = (None, None, None, None);
        let mut origin_ids = None;
        for id in ids {
            let Ok(m) = MapHandle::from_map_id(id) else {
                continue;
            };
            match m.name().to_str() {
                Some("flows") => flows = Some(m),
                Some("servers") => servers = Some(m),
                Some("migrations") => migrations = Some(m),
                Some("prepare_targets") => steering = Some(m),
                Some("origin_ids") => origin_ids = Some(m),
                _ => {}
            }
        }
        let (Some(old_flows), Some(old_servers)) = (flows, servers) else {
            return Err(err(
                "adopt",
                "the predecessor's program has no flows or servers map".into(),
            ));
        };
        let mut done = Adopted::default();
        let mut server_of = HashMap::new();
        let ours: HashMap<CFlowKey, CFlow> =
            entries::<CFlowKey, CFlow>(&self.maps.flows, "flows", usize::MAX)?
                .into_iter()
                .collect();
        let mut service_of = HashMap::new();
        let (mut keys, mut vals) = (Vec::new(), Vec::new());
        let (mut merged_keys, mut merged_vals, mut closed) = (Vec::new(), Vec::new(), Vec::new());
        for (k, f) in
            entries::<CFlowKey, CFlow>(&old_flows, "flows", self.maps.flows.max_entries() as usize)?
        {
            if let Some(o) = ours.get(&k) {
                // The store's copy of a flow knows nothing of its FINs: the
                // predecessor's (newer) flags are merged, or its close would
                // never be reaped here and a half-closed flow would not
                // close when its other FIN comes.
                let add = f.flags & (FLOW_FIN_CLIENT | FLOW_FIN_SERVER | FLOW_CLOSING) & !o.flags;
                if add != 0 {
                    merged_keys.push(k);
                    merged_vals.push(CFlow {
                        flags: o.flags | add,
                        ..*o
                    });
                    if add & FLOW_CLOSING != 0 {
                        closed.push(closed_event(k, o.server));
                    }
                }
                continue;
            }
            let server = translate_server(
                &old_servers,
                &self.maps.server_by_addr,
                &mut server_of,
                f.server,
            );
            let skey = CServiceKey {
                vip: k.service_ip,
                port: k.service_port,
                proto: 6,
                pad: 0,
            };
            let service = *service_of
                .entry((k.service_ip, k.service_port))
                .or_insert_with(|| {
                    self.maps
                        .services
                        .lookup(skey.as_bytes(), MapFlags::ANY)
                        .ok()
                        .flatten()
                        .and_then(|v| CService::from_bytes(&v))
                        .and_then(|s| u16::try_from(s.index).ok())
                });
            match (server, service) {
                (Some(server), Some(service)) => {
                    if f.flags & FLOW_CLOSING != 0 {
                        closed.push(closed_event(k, server));
                    }
                    keys.push(k);
                    vals.push(CFlow {
                        server,
                        service,
                        ..f
                    });
                }
                _ => done.flows_skipped += 1,
            }
        }
        batch_update(&self.maps.flows, "flows", &keys, &vals)?;
        done.flows = keys.len();
        batch_update(&self.maps.flows, "flows", &merged_keys, &merged_vals)?;
        done.fins_merged = merged_keys.len();
        done.closed = closed.len();
        if !closed.is_empty() {
            self.pending
                .lock()
                .map_err(|_| DataPlaneError::Load("event buffer poisoned".into()))?
                .extend(closed);
        }

        // Migrations: a failure costs them only (logged), not the flows.
        let Some(old_migrations) = migrations else {
            eprintln!("switchd: the predecessor's program {old_prog} has no migrations map: its migrations in flight are lost");
            return Ok(done);
        };
        if let Err(e) = self.adopt_migrations(
            old_flows,
            old_servers,
            old_migrations,
            steering,
            origin_ids,
            server_of,
            &mut done,
        ) {
            eprintln!("switchd: migration entries of the predecessor's program {old_prog} not copied ({e}): its migrations in flight are lost");
        }
        Ok(done)
    }

    /// [`Self::adopt`]'s migration part: every migration entry and PREPARE
    /// steering memory of the predecessor, translated; keeps its maps
    /// for [`Self::finish_adoption`].
    #[allow(clippy::too_many_arguments)]
    fn adopt_migrations(
        &mut self,
        old_flows: MapHandle,
        old_servers: MapHandle,
        old_migrations: MapHandle,
        steering: Option<MapHandle>,
        old_origin_ids: Option<MapHandle>,
        mut server_of: std::collections::HashMap<u32, Option<u32>>,
        done: &mut Adopted,
    ) -> Result<()> {
        use std::collections::{HashMap, HashSet};
        // Migration entries. This table has none of its own before the
        // first link runs its program (a standby's sync writes flows only),
        // but one it has is newer: kept.
        let ours: HashSet<CFlowKey> =
            entries::<CFlowKey, CMigration>(&self.maps.migrations, "migrations", usize::MAX)?
                .into_iter()
                .map(|(k, _)| k)
                .collect();
        let mut copied = HashMap::new();
        // The newest migration id of each origin the predecessor knew: its
        // `origin_ids` (a program that predates it has none) and the ids
        // of its migration entries and steering memory.
        let mut newest = HashMap::new();
        let (mut keys, mut vals) = (Vec::new(), Vec::new());
        for (k, m) in entries::<CFlowKey, CMigration>(
            &old_migrations,
            "migrations",
            self.maps.migrations.max_entries() as usize,
        )? {
            newest_per_origin([m.migration_id], &mut newest);
            if ours.contains(&k) {
                continue;
            }
            match translate_server(
                &old_servers,
                &self.maps.server_by_addr,
                &mut server_of,
                m.server,
            ) {
                Some(server) => {
                    let n = CMigration { server, ..m };
                    keys.push(k);
                    vals.push(n);
                    copied.insert(k, (m, n));
                    if m.is_pending() {
                        done.migrations_pending += 1;
                    }
                }
                None => done.migrations_skipped += 1,
            }
        }
        batch_update(&self.maps.migrations, "migrations", &keys, &vals)?;
        done.migrations = keys.len();

        // PREPARE steering: migration id -> target.
        if let Some(old) = steering {
            let ours: HashSet<MigId> = entries::<MigId, TargetIdx>(
                &self.maps.prepare_targets,
                "prepare_targets",
                usize::MAX,
            )?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
            let (mut keys, mut vals) = (Vec::new(), Vec::new());
            for (id, t) in entries::<MigId, TargetIdx>(&old, "prepare_targets", usize::MAX)? {
                newest_per_origin([id.0], &mut newest);
                if ours.contains(&id) {
                    continue;
                }
                if let Some(t) =
                    translate_server(&old_servers, &self.maps.server_by_addr, &mut server_of, t.0)
                {
                    keys.push(id);
                    vals.push(TargetIdx(t));
                }
            }
            // An LRU map: never full, the oldest memories give way.
            batch_update(&self.maps.prepare_targets, "prepare_targets", &keys, &vals)?;
            done.prepare_targets = keys.len();
        }

        // Last migration id per origin, for REGISTER_ACK: the newer of the
        // predecessor's and ours (this program may have seen PREPAREs
        // already).
        if let Some(old) = old_origin_ids {
            for (a, id) in entries::<OriginAddr, MigId>(&old, "origin_ids", usize::MAX)? {
                if id.0 >> 32 == u64::from(u32::from_be_bytes(a.0.to_ne_bytes())) {
                    newest_per_origin([id.0], &mut newest);
                }
            }
        }
        for (a, id) in
            entries::<OriginAddr, MigId>(&self.maps.origin_ids, "origin_ids", usize::MAX)?
        {
            if newest
                .get(&a)
                .is_some_and(|n| !capybara_proto::tcpmig::migration_id_newer(*n, id.0))
            {
                newest.remove(&a);
            }
        }
        let (keys, vals): (Vec<OriginAddr>, Vec<MigId>) =
            newest.into_iter().map(|(a, id)| (a, MigId(id))).unzip();
        // An LRU map: never full, addresses long unused give way.
        batch_update(&self.maps.origin_ids, "origin_ids", &keys, &vals)?;
        done.origin_ids = keys.len();
        self.predecessor = Some(Predecessor {
            flows: old_flows,
            migrations: old_migrations,
            servers: old_servers,
            server_of,
            copied,
        });
        Ok(())
    }

    /// The final entry an outcome this program saw of migration `id` made,
    /// had it held its pending entry (`unmatched_outcomes`).
    fn unmatched_outcome(&self, id: u64) -> Result<Option<CMigration>> {
        Ok(self
            .maps
            .unmatched_outcomes
            .lookup(&id.to_ne_bytes(), MapFlags::ANY)
            .map_err(map_err("unmatched_outcomes", "lookup"))?
            .and_then(|v| CMigration::from_bytes(&v))
            .filter(|o| o.migration_id == id && !o.is_pending()))
    }

    /// Ends the adoption of [`Self::attach_pinned`], once every link runs
    /// this program (the predecessor's runs nowhere any more): applies the
    /// migration entries its program changed after the copy (a
    /// CONN_STATE_ACK, ABORT or PREPARE_ACK that passed it in between: the
    /// message went on to its server, which will not send it again), where
    /// this program has not written since; removes the entries of
    /// connections a client reset there meanwhile; and queues, for the
    /// store, a MIGRATED event for every final entry whose owner this flow
    /// table (the store's owners, or the predecessor's placement) does
    /// not name: owner changes the predecessor's writer may not have
    /// persisted before it died. Then lets the predecessor's maps go.
    /// Nothing to do without an adoption; call it once all links are
    /// attached.
    pub fn finish_adoption(&mut self) -> Result<Adopted> {
        let Some(mut p) = self.predecessor.take() else {
            return Ok(self.adopted);
        };
        let now: std::collections::HashMap<CFlowKey, CMigration> =
            entries::<CFlowKey, CMigration>(&p.migrations, "migrations", usize::MAX)?
                .into_iter()
                .collect();
        let mut late = 0;
        for (k, m) in &now {
            let copied = p.copied.get(k).copied();
            if copied.is_some_and(|(raw, _)| raw == *m) {
                continue;
            }
            // Only where this program has not written since the copy: its
            // writes are later than anything the predecessor did. Except
            // the end of a migration this program saw begin: its
            // PREPARE_ACK passed here (pending), the CONN_STATE_ACK or the
            // target's ABORT decision passed the predecessor (final there,
            // same id), and nothing will settle it here again (the entry
            // stayed pending for good: every later PREPARE_ACK of the flow
            // dropped as stale).
            let ours = self.lookup_migration(*k)?;
            let untouched = match copied {
                Some((_, c)) => ours == Some(c),
                None => ours.is_none(),
            };
            let settles_ours = ours.is_some_and(|o| {
                o.is_pending() && !m.is_pending() && o.migration_id == m.migration_id
            });
            if !untouched && !settles_ours {
                continue;
            }
            // A migration pending there whose outcome (CONN_STATE_ACK,
            // the target's ABORT decision) passed this program, which held
            // no pending entry of it then (the copy's older entry): settled
            // as that outcome made it, or it stays pending for good.
            let outcome = if m.is_pending() {
                self.unmatched_outcome(m.migration_id)?
            } else {
                None
            };
            let translated = outcome.or_else(|| {
                translate_server(
                    &p.servers,
                    &self.maps.server_by_addr,
                    &mut p.server_of,
                    m.server,
                )
                .map(|server| CMigration { server, ..*m })
            });
            if let Some(n) = translated {
                self.insert_migration(*k, n)?;
                p.copied.insert(*k, (*m, n));
                late += 1;
            }
        }
        let gone: Vec<(CFlowKey, CMigration)> = p
            .copied
            .iter()
            .filter(|(k, _)| !now.contains_key(k))
            .map(|(k, (_, c))| (*k, *c))
            .collect();
        let mut events = Vec::new();
        for (k, c) in gone {
            p.copied.remove(&k);
            if self.lookup_migration(k)? != Some(c) {
                continue;
            }
            self.delete_migration(k)?;
            late += 1;
            // A client's reset removed both entries there; a SYN reusing
            // the 4-tuple of the closed connection removed the migration
            // entry and made a new flow (on the old connection's last
            // owner): followed here, and told to the store.
            let old_flow = p
                .flows
                .lookup(k.as_bytes(), MapFlags::ANY)
                .map_err(map_err("flows", "lookup"))?
                .and_then(|v| CFlow::from_bytes(&v));
            match old_flow {
                None => {
                    self.delete_flow(k)?;
                    events.push(CFlowEvent {
                        key: k,
                        kind: EV_CLOSED,
                        server: c.server,
                        prev_server: c.server,
                        ts_ns: 0,
                    });
                }
                Some(of) => {
                    let server = translate_server(
                        &p.servers,
                        &self.maps.server_by_addr,
                        &mut p.server_of,
                        of.server,
                    );
                    if let (Some(server), Some(ours)) = (server, self.lookup_flow(k)?) {
                        self.insert_flow(
                            k,
                            CFlow {
                                server,
                                flags: of.flags,
                                created_ns: of.created_ns,
                                ..ours
                            },
                        )?;
                        events.push(CFlowEvent {
                            key: k,
                            kind: EV_NEW,
                            server,
                            prev_server: server,
                            ts_ns: 0,
                        });
                    }
                }
            }
        }
        let mut owner_events = 0;
        for (k, (_, c)) in &p.copied {
            if c.is_pending() || self.lookup_migration(*k)? != Some(*c) {
                continue;
            }
            if let Some(f) = self.lookup_flow(*k)?.filter(|f| f.server != c.server) {
                events.push(CFlowEvent {
                    key: *k,
                    kind: EV_MIGRATED,
                    server: c.server,
                    prev_server: f.server,
                    ts_ns: 0,
                });
                owner_events += 1;
            }
        }
        if !events.is_empty() {
            self.pending
                .lock()
                .map_err(|_| DataPlaneError::Load("event buffer poisoned".into()))?
                .extend(events);
        }
        self.adopted.settled_late = late;
        self.adopted.owner_events = owner_events;
        Ok(self.adopted)
    }

    /// Makes later [`Self::attach`] calls use generic (SKB) XDP: slower,
    /// but XDP_REDIRECT then works into any device, e.g. a veth whose peer
    /// (outside our namespace, on a docker bridge) runs no XDP program.
    pub fn set_generic_xdp(&mut self, on: bool) {
        self.generic_xdp = on;
    }

    /// Detaches the program from every interface: pins removed, links
    /// dropped (the interfaces run no program after this).
    ///
    /// Each link is detached explicitly (`BPF_LINK_DETACH`) before its pin
    /// and descriptor go: the kernel lets go of a removed pin's reference
    /// only after an RCU grace period, so without it the program could
    /// still run for a moment after this returns (a successor attaching
    /// at once, or a test looking, would see it).
    pub fn detach_all(&mut self) {
        use libbpf_rs::libbpf_sys;
        use std::os::fd::AsRawFd;
        for (ifindex, l) in &self.links {
            // SAFETY: a valid link descriptor we own.
            let rc = unsafe { libbpf_sys::bpf_link_detach(l.fd.as_raw_fd()) };
            if rc < 0 {
                eprintln!(
                    "switchd: cannot detach the XDP link of ifindex {ifindex} ({}); it goes with its last reference",
                    os_err(rc)
                );
            }
            if let Some(p) = &l.pin {
                if let Err(e) = std::fs::remove_file(p) {
                    eprintln!("switchd: cannot remove the pin {} ({e})", p.display());
                }
            }
        }
        self.links.clear();
    }

    /// Lets go of the links but leaves the pinned ones attached, running
    /// this program with its maps until a successor replaces it
    /// ([`Self::attach_pinned`]): a hand-over without a gap. Unpinned links
    /// detach. Returns how many stay pinned.
    pub fn release_links(&mut self) -> usize {
        let n = self.links.iter().filter(|(_, l)| l.pin.is_some()).count();
        self.links.clear();
        n
    }

    /// Id of the XDP program attached to `ifindex` (ours or another
    /// process's), 0 if none.
    pub fn attached_prog_id(&self, ifindex: u32) -> Result<u32> {
        use std::os::fd::AsFd;
        let p = self
            .obj
            .progs()
            .find(|p| p.name() == PROG_NAME)
            .ok_or_else(|| DataPlaneError::Load(format!("program {PROG_NAME} missing")))?;
        libbpf_rs::Xdp::new(p.as_fd())
            .query_id(ifindex as i32, libbpf_rs::XdpFlags::NONE)
            .map_err(|e| DataPlaneError::Load(format!("query XDP on ifindex {ifindex}: {e}")))
    }

    /// Interfaces the program is attached to.
    pub fn attached(&self) -> Vec<u32> {
        self.links.iter().map(|(i, _)| *i).collect()
    }

    /// Adds an egress port for XDP_REDIRECT (must exist in the caller's
    /// network namespace).
    pub fn add_tx_port(&mut self, ifindex: u32) -> Result<()> {
        self.maps
            .tx_ports
            .update(
                &ifindex.to_ne_bytes(),
                &ifindex.to_ne_bytes(),
                MapFlags::ANY,
            )
            .map_err(map_err("tx_ports", "update"))
    }

    /// Runs the program once (or `repeat` times) on `packet` as if it had
    /// arrived on `ingress_ifindex` (which must exist in the caller's
    /// network namespace, or be 0 for "unknown interface").
    pub fn test_run(&self, packet: &[u8], ingress_ifindex: u32, repeat: u32) -> Result<TestRun> {
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex,
        // rx_queue_index, egress_ifindex.
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(packet.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&ingress_ifindex.to_ne_bytes());
        let mut out = vec![0u8; packet.len() + 256];
        let r = self.with_prog(|p| {
            let input = libbpf_rs::ProgramInput {
                data_in: Some(packet),
                data_out: Some(&mut out),
                context_in: Some(&mut ctx),
                repeat,
                ..Default::default()
            };
            p.test_run(input).map(|o| {
                (
                    o.return_value,
                    o.data.map(|d| d.len()).unwrap_or(0),
                    o.duration,
                )
            })
        })?;
        let (verdict, len, duration) =
            r.map_err(|e| DataPlaneError::Load(format!("BPF_PROG_TEST_RUN: {e}")))?;
        out.truncate(len);
        Ok(TestRun {
            verdict,
            packet: out,
            duration,
        })
    }

    /// Bulk-loads flow entries (benchmark and store restore).
    pub fn insert_flows_batch(&mut self, keys: &[CFlowKey], vals: &[CFlow]) -> Result<()> {
        batch_update(&self.maps.flows, "flows", keys, vals)
    }
    /// Service `service`'s Maglev table as the kernel (hence the program)
    /// reads it: one lookup system call per slot, for tests and checks,
    /// not for the control loop.
    pub fn maglev_table(&self, service: u32) -> Result<Vec<u32>> {
        check_range("service index", service, MAX_SERVICES)?;
        (service * MAGLEV_SIZE..(service + 1) * MAGLEV_SIZE)
            .map(|i| {
                let v = self
                    .maps
                    .maglev
                    .lookup(&i.to_ne_bytes(), MapFlags::ANY)
                    .map_err(map_err("maglev", "lookup"))?;
                v.and_then(|b| {
                    b.get(..4)
                        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                })
                .ok_or_else(|| DataPlaneError::Map {
                    map: "maglev",
                    op: "lookup",
                    detail: format!("slot {i} missing"),
                })
            })
            .collect()
    }

    pub fn insert_migrations_batch(
        &mut self,
        keys: &[CFlowKey],
        vals: &[CMigration],
    ) -> Result<()> {
        batch_update(&self.maps.migrations, "migrations", keys, vals)
    }
}

fn batch_update<K: Pod, V: Pod>(
    map: &MapHandle,
    name: &'static str,
    keys: &[K],
    vals: &[V],
) -> Result<()> {
    for (kc, vc) in keys.chunks(8192).zip(vals.chunks(8192)) {
        let kb: Vec<u8> = kc.iter().flat_map(|k| k.as_bytes().to_vec()).collect();
        let vb: Vec<u8> = vc.iter().flat_map(|v| v.as_bytes().to_vec()).collect();
        map.update_batch(&kb, &vb, kc.len() as u32, MapFlags::ANY, MapFlags::ANY)
            .map_err(map_err(name, "update_batch"))?;
    }
    Ok(())
}

/// Reads a hash map in batches of [`BatchReader::CHUNK`] entries, one
/// BPF_MAP_LOOKUP_BATCH each, resumable from the kernel's token (a bucket
/// index for hash maps) whatever changed in between.
///
/// Not libbpf-rs's `lookup_batch` iterator: it takes a short batch for the
/// last one, and the kernel returns short batches all along a hash map (it
/// fills a batch with whole buckets only), so that iterator stopped after
/// the first ~4,095 entries of a larger table.
struct BatchReader<'m, K, V> {
    map: &'m MapHandle,
    name: &'static str,
    keys: Vec<u8>,
    vals: Vec<u8>,
    _kv: std::marker::PhantomData<(K, V)>,
}

impl<'m, K: Pod, V: Pod> BatchReader<'m, K, V> {
    /// Whole chunks: a smaller count could be below one bucket's length,
    /// which the kernel refuses (ENOSPC).
    const CHUNK: usize = 4096;

    fn new(map: &'m MapHandle, name: &'static str) -> Result<Self> {
        let (ksz, vsz) = (std::mem::size_of::<K>(), std::mem::size_of::<V>());
        if map.key_size() as usize != ksz || map.value_size() as usize != vsz {
            return Err(DataPlaneError::Map {
                map: name,
                op: "lookup_batch",
                detail: format!(
                    "key/value sizes {}/{} where {ksz}/{vsz} were expected",
                    map.key_size(),
                    map.value_size()
                ),
            });
        }
        Ok(BatchReader {
            map,
            name,
            keys: vec![0u8; Self::CHUNK * ksz],
            vals: vec![0u8; Self::CHUNK * vsz],
            _kv: std::marker::PhantomData,
        })
    }

    /// Appends the batch at `token` (`None`: the start of the map) to
    /// `out`; returns the token of the next batch, `None` at the end.
    fn read(&mut self, token: Option<u32>, out: &mut Vec<(K, V)>) -> Result<Option<u32>> {
        use libbpf_rs::libbpf_sys;
        use std::os::fd::{AsFd, AsRawFd};
        let (ksz, vsz) = (std::mem::size_of::<K>(), std::mem::size_of::<V>());
        let opts = libbpf_sys::bpf_map_batch_opts {
            sz: std::mem::size_of::<libbpf_sys::bpf_map_batch_opts>() as _,
            elem_flags: 0,
            flags: 0,
        };
        let mut in_batch: u32 = token.unwrap_or(0);
        let mut out_batch: u32 = 0;
        let mut count: u32 = Self::CHUNK as u32;
        // SAFETY: the buffers hold `count` keys and values of the map's
        // sizes (checked in `new`); the tokens are u32 as the kernel expects
        // for hash maps; `in_batch` is NULL at the start of a pass.
        let rc = unsafe {
            libbpf_sys::bpf_map_lookup_batch(
                self.map.as_fd().as_raw_fd(),
                if token.is_some() {
                    &mut in_batch as *mut u32 as *mut _
                } else {
                    std::ptr::null_mut()
                },
                &mut out_batch as *mut u32 as *mut _,
                self.keys.as_mut_ptr() as *mut _,
                self.vals.as_mut_ptr() as *mut _,
                &mut count,
                &opts,
            )
        };
        if rc < 0 && rc != -libc::ENOENT {
            return Err(DataPlaneError::Map {
                map: self.name,
                op: "lookup_batch",
                detail: std::io::Error::from_raw_os_error(-rc).to_string(),
            });
        }
        for i in 0..(count as usize).min(Self::CHUNK) {
            if let (Some(k), Some(v)) = (
                K::from_bytes(&self.keys[i * ksz..]),
                V::from_bytes(&self.vals[i * vsz..]),
            ) {
                out.push((k, v));
            }
        }
        Ok((rc != -libc::ENOENT).then_some(out_batch))
    }
}

/// How many entries a hash map holds, counting up to `limit` (the
/// fallback of [`BpfDataPlane::table_counts`]).
fn count_entries<K: Pod, V: Pod>(
    map: &MapHandle,
    name: &'static str,
    limit: usize,
) -> Result<usize> {
    let mut reader = BatchReader::<K, V>::new(map, name)?;
    let mut batch = Vec::with_capacity(BatchReader::<K, V>::CHUNK);
    let (mut n, mut token) = (0usize, None);
    // Bounded by the table: each read moves the token past >= 1 bucket.
    loop {
        batch.clear();
        token = reader.read(token, &mut batch)?;
        n += batch.len();
        if token.is_none() || n >= limit {
            return Ok(n.min(limit));
        }
    }
}

/// Up to `limit` entries of a hash map (a batch read past `limit` is cut).
fn entries<K: Pod, V: Pod>(
    map: &MapHandle,
    name: &'static str,
    limit: usize,
) -> Result<Vec<(K, V)>> {
    let mut reader = BatchReader::<K, V>::new(map, name)?;
    let mut out = Vec::new();
    let mut token = None;
    // Bounded by the table: each read moves the token past >= 1 bucket.
    loop {
        token = reader.read(token, &mut out)?;
        if token.is_none() || out.len() >= limit {
            out.truncate(limit);
            return Ok(out);
        }
    }
}

fn percpu_sum(values: &[Vec<u8>], offset: usize) -> u64 {
    values
        .iter()
        .filter_map(|v| v.get(offset..offset + 8))
        .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
        .sum()
}

impl BpfDataPlane {
    /// The u64 at `offset` of every live server's `capy_server_stats`,
    /// summed over CPUs, indexed by server index.
    fn server_stat(&mut self, offset: usize) -> Result<Vec<u64>> {
        let mut out = vec![0u64; MAX_SERVERS as usize];
        for idx in self.live_servers.iter().copied() {
            if let Some(v) = self
                .maps
                .server_stats
                .lookup_percpu(&idx.to_ne_bytes(), MapFlags::ANY)
                .map_err(map_err("server_stats", "lookup"))?
            {
                out[idx as usize] = percpu_sum(&v, offset);
            }
        }
        Ok(out)
    }
}

impl DataPlane for BpfDataPlane {
    fn set_config(&mut self, cfg: CConfig) -> Result<()> {
        self.maps
            .config
            .update(&0u32.to_ne_bytes(), cfg.as_bytes(), MapFlags::ANY)
            .map_err(map_err("config", "update"))
    }
    fn set_iface(&mut self, ifindex: u32, iface: CIface) -> Result<()> {
        self.maps
            .ifaces
            .update(&ifindex.to_ne_bytes(), iface.as_bytes(), MapFlags::ANY)
            .map_err(map_err("ifaces", "update"))
    }
    fn set_server(&mut self, index: u32, server: CServer) -> Result<()> {
        check_range("server index", index, MAX_SERVERS)?;
        self.maps
            .servers
            .update(&index.to_ne_bytes(), server.as_bytes(), MapFlags::ANY)
            .map_err(map_err("servers", "update"))?;
        self.maps
            .server_by_addr
            .update(
                &server.data_ip.to_ne_bytes(),
                &index.to_ne_bytes(),
                MapFlags::ANY,
            )
            .map_err(map_err("server_by_addr", "update"))?;
        self.live_servers.insert(index);
        Ok(())
    }
    fn clear_server(&mut self, index: u32, data_ip: u32) -> Result<()> {
        check_range("server index", index, MAX_SERVERS)?;
        self.maps
            .servers
            .update(
                &index.to_ne_bytes(),
                CServer::default().as_bytes(),
                MapFlags::ANY,
            )
            .map_err(map_err("servers", "update"))?;
        let _ = self.maps.server_by_addr.delete(&data_ip.to_ne_bytes());
        self.live_servers.remove(&index);
        Ok(())
    }
    fn set_service(&mut self, key: CServiceKey, svc: CService) -> Result<()> {
        check_range("service index", svc.index, MAX_SERVICES)?;
        self.maps
            .services
            .update(key.as_bytes(), svc.as_bytes(), MapFlags::ANY)
            .map_err(map_err("services", "update"))
    }
    fn remove_service(&mut self, key: CServiceKey) -> Result<()> {
        let _ = self.maps.services.delete(key.as_bytes());
        Ok(())
    }
    fn write_maglev(&mut self, service: u32, delta: &[(u32, u32)]) -> Result<()> {
        // Through the mapping (`MaglevMem`): no system call. All or nothing:
        // the delta is checked before the first store.
        check_range("service index", service, MAX_SERVICES)?;
        for (slot, _) in delta {
            check_range("maglev slot", *slot, MAGLEV_SIZE)?;
        }
        let row = (service * MAGLEV_SIZE) as usize;
        self.maglev_mem
            .store_all(delta.iter().map(|(slot, v)| (row + *slot as usize, *v)));
        Ok(())
    }
    fn write_ring(&mut self, service: u32, kind: u32, ring: &CRing) -> Result<()> {
        check_range("service index", service, MAX_SERVICES)?;
        check_range("ring kind", kind, RING_KINDS)?;
        let idx = service * RING_KINDS + kind;
        self.maps
            .rings
            .update(&idx.to_ne_bytes(), ring.as_bytes(), MapFlags::ANY)
            .map_err(map_err("rings", "update"))
    }
    fn server_packets(&mut self) -> Result<Vec<u64>> {
        self.server_stat(std::mem::offset_of!(CServerStats, packets))
    }
    fn server_request_packets(&mut self) -> Result<Vec<u64>> {
        self.server_stat(std::mem::offset_of!(CServerStats, requests))
    }
    fn stats(&mut self) -> Result<Vec<u64>> {
        let mut out = vec![0u64; STAT_MAX as usize];
        for (i, slot) in out.iter_mut().enumerate() {
            if let Some(v) = self
                .maps
                .stats
                .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
                .map_err(map_err("stats", "lookup"))?
            {
                *slot = percpu_sum(&v, 0);
            }
        }
        Ok(out)
    }
    fn stat_counter(&mut self, idx: usize) -> Result<u64> {
        Ok(self
            .maps
            .stats
            .lookup_percpu(&(idx as u32).to_ne_bytes(), MapFlags::ANY)
            .map_err(map_err("stats", "lookup"))?
            .map_or(0, |v| percpu_sum(&v, 0)))
    }
    fn insert_flow(&mut self, key: CFlowKey, flow: CFlow) -> Result<()> {
        self.maps
            .flows
            .update(key.as_bytes(), flow.as_bytes(), MapFlags::ANY)
            .map_err(map_err("flows", "update"))
    }
    fn insert_migration(&mut self, key: CFlowKey, m: CMigration) -> Result<()> {
        self.maps
            .migrations
            .update(key.as_bytes(), m.as_bytes(), MapFlags::ANY)
            .map_err(map_err("migrations", "update"))
    }
    fn delete_migration(&mut self, key: CFlowKey) -> Result<()> {
        let _ = self.maps.migrations.delete(key.as_bytes());
        Ok(())
    }
    fn delete_flow(&mut self, key: CFlowKey) -> Result<()> {
        let _ = self.maps.flows.delete(key.as_bytes());
        Ok(())
    }
    fn insert_flows(&mut self, flows: &[(CFlowKey, CFlow)]) -> Result<()> {
        let keys: Vec<CFlowKey> = flows.iter().map(|(k, _)| *k).collect();
        let vals: Vec<CFlow> = flows.iter().map(|(_, v)| *v).collect();
        if keys.is_empty() {
            return Ok(());
        }
        batch_update(&self.maps.flows, "flows", &keys, &vals)
    }
    fn table_sizes(&mut self) -> Result<(usize, usize)> {
        let c = self.table_counts()?;
        Ok((c.flows, c.migrations))
    }
    fn lookup_flow(&mut self, key: CFlowKey) -> Result<Option<CFlow>> {
        Ok(self
            .maps
            .flows
            .lookup(key.as_bytes(), MapFlags::ANY)
            .map_err(map_err("flows", "lookup"))?
            .and_then(|v| CFlow::from_bytes(&v)))
    }
    fn lookup_migration(&mut self, key: CFlowKey) -> Result<Option<CMigration>> {
        Ok(self
            .maps
            .migrations
            .lookup(key.as_bytes(), MapFlags::ANY)
            .map_err(map_err("migrations", "lookup"))?
            .and_then(|v| CMigration::from_bytes(&v)))
    }
    fn last_migration_id(&mut self, origin: std::net::Ipv4Addr) -> Result<Option<u64>> {
        Ok(self
            .maps
            .origin_ids
            .lookup(OriginAddr::of(origin).as_bytes(), MapFlags::ANY)
            .map_err(map_err("origin_ids", "lookup"))?
            .and_then(|v| Some(u64::from_ne_bytes(v.get(..8)?.try_into().ok()?)))
            .filter(|id| id >> 32 == u64::from(u32::from(origin))))
    }
    fn remove_flows_of(&mut self, server: u32) -> Result<Vec<CFlowKey>> {
        // Runs only when a server dies: reads both tables in batches (one
        // syscall per 4,096 entries), deletes the dead server's entries one
        // by one (an LRU eviction meanwhile must not abort the rest).
        let mut removed = Vec::new();
        // Keys with a migration entry, to it (removed) or elsewhere (kept).
        let mut migrated_away = std::collections::HashSet::new();
        let maps = &self.maps;
        let server_at = |ip: u32| {
            let v = maps
                .server_by_addr
                .lookup(&ip.to_ne_bytes(), MapFlags::ANY)
                .ok()??;
            let i = u32::from_ne_bytes(v.get(..4)?.try_into().ok()?);
            let s = maps
                .servers
                .lookup(&i.to_ne_bytes(), MapFlags::ANY)
                .ok()??;
            Some((i, CServer::from_bytes(&s)?.state))
        };
        for (k, m) in
            entries::<CFlowKey, CMigration>(&self.maps.migrations, "migrations", usize::MAX)?
        {
            if let Some(o) = crate::dataplane::pending_back_to_origin(&m, server, server_at) {
                // Only over the entry still there (EXIST): the target, dead,
                // sends nothing that could change it meanwhile.
                let back = CMigration::owner(o, m.migration_id);
                if maps
                    .migrations
                    .update(k.as_bytes(), back.as_bytes(), MapFlags::EXIST)
                    .is_ok()
                {
                    migrated_away.insert(k);
                    continue;
                }
            }
            if m.server == server {
                let _ = self.maps.migrations.delete(k.as_bytes());
                let _ = self.maps.flows.delete(k.as_bytes());
                removed.push(k);
            }
            migrated_away.insert(k);
        }
        for (k, f) in entries::<CFlowKey, CFlow>(&self.maps.flows, "flows", usize::MAX)? {
            if f.server == server && !migrated_away.contains(&k) {
                let _ = self.maps.flows.delete(k.as_bytes());
                removed.push(k);
            }
        }
        Ok(removed)
    }
    fn remove_flows_of_service(&mut self, key: CServiceKey) -> Result<Vec<(CFlowKey, u32)>> {
        // Runs only when a service is removed: reads both tables in batches
        // and deletes the service's entries one by one (as remove_flows_of).
        let of = |k: &CFlowKey| k.service_ip == key.vip && k.service_port == key.port;
        let mut owner = std::collections::HashMap::new();
        for (k, m) in
            entries::<CFlowKey, CMigration>(&self.maps.migrations, "migrations", usize::MAX)?
        {
            if of(&k) {
                owner.insert(k, m.server);
            }
        }
        let mut removed = Vec::new();
        for (k, f) in entries::<CFlowKey, CFlow>(&self.maps.flows, "flows", usize::MAX)? {
            if of(&k) {
                let _ = self.maps.flows.delete(k.as_bytes());
                let server = owner.remove(&k).unwrap_or(f.server);
                let _ = self.maps.migrations.delete(k.as_bytes());
                removed.push((k, server));
            }
        }
        for (k, server) in owner {
            let _ = self.maps.migrations.delete(k.as_bytes());
            removed.push((k, server));
        }
        Ok(removed)
    }
    fn scan_flows(
        &mut self,
        cursor: &mut FlowScanCursor,
        budget: usize,
        out: &mut Vec<(CFlowKey, CFlow)>,
    ) -> Result<bool> {
        // One BPF_MAP_LOOKUP_BATCH per chunk, resumable whatever changed
        // in between (`BatchReader`).
        let mut reader = BatchReader::<CFlowKey, CFlow>::new(&self.maps.flows, "flows")?;
        let start = out.len();
        // Bounded by `budget` (at least one chunk) or the end of the table.
        loop {
            match reader.read(cursor.pos.map(|p| p as u32), out) {
                Err(e) => {
                    cursor.pos = None;
                    return Err(e);
                }
                Ok(None) => {
                    cursor.pos = None;
                    return Ok(true);
                }
                Ok(Some(next)) => {
                    cursor.pos = Some(u64::from(next));
                    if out.len() - start >= budget {
                        return Ok(false);
                    }
                }
            }
        }
    }
    fn drain_events(&mut self, out: &mut Vec<FlowEvent>) -> Result<usize> {
        self.ringbuf
            .consume()
            .map_err(map_err("flow_events", "consume"))?;
        let mut p = self
            .pending
            .lock()
            .map_err(|_| DataPlaneError::Load("event buffer poisoned".into()))?;
        let n = p.len();
        out.append(&mut p);
        Ok(n)
    }
}
