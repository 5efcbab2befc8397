//! eBPF/XDP backend of [`DataPlane`]: loads `bpf/switch.bpf.c` (compiled by
//! build.rs and embedded), owns its maps, attaches it to interfaces, and
//! runs it on crafted packets through BPF_PROG_TEST_RUN for tests and the
//! benchmark.
//!
//! Everything this backend creates lives only as long as the value: maps
//! are not pinned, and XDP attachments are bpf_links that the kernel
//! detaches when they are dropped (also when the process dies).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libbpf_rs::{
    Link, MapCore, MapFlags, MapHandle, Object, ObjectBuilder, RingBuffer, RingBufferBuilder,
};

use crate::abi::*;
use crate::dataplane::{check_range, DataPlane, DataPlaneError, FlowEvent, FlowScanCursor, Result};

/// An XDP attachment: a bpf_link either way, so it dies with the process
/// (what the HA fast takeover relies on) and detaches when dropped. Held
/// only to be dropped.
#[allow(dead_code)]
enum XdpLink {
    Native(Link),
    /// Generic mode: libbpf has no attach-with-flags for XDP links, so the
    /// link is created with `bpf_link_create` and held as its fd.
    Generic(std::os::fd::OwnedFd),
}

fn attach_xdp_generic(p: &libbpf_rs::ProgramMut<'_>, ifindex: u32) -> Result<std::os::fd::OwnedFd> {
    use libbpf_rs::libbpf_sys;
    use std::os::fd::{AsFd, AsRawFd, FromRawFd};
    let opts = libbpf_sys::bpf_link_create_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as _,
        flags: libbpf_sys::XDP_FLAGS_SKB_MODE,
        ..Default::default()
    };
    // SAFETY: valid program fd and options struct; the returned fd is ours.
    let fd = unsafe {
        libbpf_sys::bpf_link_create(
            p.as_fd().as_raw_fd(),
            ifindex as i32,
            libbpf_sys::BPF_XDP,
            &opts,
        )
    };
    if fd < 0 {
        return Err(DataPlaneError::Load(format!(
            "attach generic XDP to ifindex {ifindex}: {}",
            std::io::Error::from_raw_os_error(-fd)
        )));
    }
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
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

    /// Attaches the program to `ifindex` (native XDP where the driver has
    /// it, generic otherwise). Detached when `self` is dropped or by
    /// [`Self::detach_all`].
    pub fn attach(&mut self, ifindex: u32) -> Result<()> {
        if self.generic_xdp {
            let fd = self.with_prog(|p| attach_xdp_generic(p, ifindex))??;
            self.links.push((ifindex, XdpLink::Generic(fd)));
            return Ok(());
        }
        let link = self
            .with_prog(|p| p.attach_xdp(ifindex as i32))?
            .map_err(|e| DataPlaneError::Load(format!("attach XDP to ifindex {ifindex}: {e}")))?;
        self.links.push((ifindex, XdpLink::Native(link)));
        Ok(())
    }

    /// Makes later [`Self::attach`] calls use generic (SKB) XDP: slower,
    /// but XDP_REDIRECT then works into any device, e.g. a veth whose peer
    /// (outside our namespace, on a docker bridge) runs no XDP program.
    pub fn set_generic_xdp(&mut self, on: bool) {
        self.generic_xdp = on;
    }

    pub fn detach_all(&mut self) {
        self.links.clear();
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
    fn remove_flows_of(&mut self, server: u32) -> Result<Vec<CFlowKey>> {
        // Runs only when a server dies: reads both tables in batches (one
        // syscall per 4,096 entries), deletes the dead server's entries one
        // by one (an LRU eviction meanwhile must not abort the rest).
        let mut removed = Vec::new();
        // Keys with a migration entry, to it (removed) or elsewhere (kept).
        let mut migrated_away = std::collections::HashSet::new();
        for (k, m) in
            entries::<CFlowKey, CMigration>(&self.maps.migrations, "migrations", usize::MAX)?
        {
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
