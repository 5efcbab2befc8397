//! DPDK backend (cargo feature `dpdk`): one port, one RX and one TX queue.
//!
//! FFI to the system's libdpdk 22.11 through `csrc/dpdk_shim.c`, because the
//! burst functions and mbuf accessors are static inline in the headers.
//! Receive lends each mbuf's data to the callback and frees the batch in
//! bulk; transmit takes a batch of mbufs from the mempool, lets the callback
//! fill them in place, and hands them to the NIC with one `tx_burst`.
//! Nothing is copied and nothing touches the heap after `open`.
//!
//! EAL is process-global: it is initialised once, by the first `open`, with
//! that call's arguments. For the lab: `--no-huge --no-pci --no-shconf
//! --vdev=net_af_packet0,iface=eth0` (see `DpdkConfig::lab`) (the vdev opens its AF_PACKET socket in
//! the calling thread's network namespace).
//!
//! DPDK is a polling API: `wait` has no descriptor to sleep on and just
//! sleeps for a short bounded time, so run it in `PollMode::BusyPoll` when
//! latency matters.

use super::{Device, DeviceError};
use crate::wire::EthernetAddress;
use capybara_proto::time::Duration;
use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::Mutex;

/// Frames per burst (receive and transmit).
pub const BURST: usize = 32;

#[repr(C)]
struct RteMbuf {
    _opaque: [u8; 0],
}
#[repr(C)]
struct RteMempool {
    _opaque: [u8; 0],
}

extern "C" {
    fn cpb_eal_init(argc: c_int, argv: *mut *mut c_char) -> c_int;
    fn cpb_strerror(err: c_int) -> *const c_char;
    fn cpb_port_by_name(name: *const c_char, port: *mut u16) -> c_int;
    fn cpb_port_count() -> u16;
    fn cpb_port_setup(
        port: u16,
        pool_name: *const c_char,
        nb_mbufs: u32,
        nb_rxd: u16,
        nb_txd: u16,
        pool_out: *mut *mut RteMempool,
        mac_out: *mut u8,
    ) -> c_int;
    fn cpb_port_close(port: u16);
    fn cpb_rx_burst(port: u16, pkts: *mut *mut RteMbuf, n: u16) -> u16;
    fn cpb_tx_burst(port: u16, pkts: *mut *mut RteMbuf, n: u16) -> u16;
    fn cpb_mbuf_data(m: *const RteMbuf, len: *mut u16) -> *const u8;
    fn cpb_mbuf_alloc_bulk(pool: *mut RteMempool, m: *mut *mut RteMbuf, n: u32) -> c_int;
    fn cpb_mbuf_room(m: *mut RteMbuf, cap: *mut u16) -> *mut u8;
    fn cpb_mbuf_set_len(m: *mut RteMbuf, len: u16);
    fn cpb_mbuf_free_bulk(m: *mut *mut RteMbuf, n: u32);
}

fn strerror(err: c_int) -> String {
    unsafe { CStr::from_ptr(cpb_strerror(err.abs())) }
        .to_string_lossy()
        .into_owned()
}

/// Which port to drive.
#[derive(Debug, Clone)]
pub enum PortSelector {
    /// The n-th available port.
    Index(u16),
    /// A device name, e.g. `net_af_packet0` or a PCI address.
    Name(String),
}

#[derive(Debug, Clone)]
pub struct DpdkConfig {
    /// EAL arguments, without the program name.
    pub eal_args: Vec<String>,
    pub port: PortSelector,
    pub mbufs: u32,
    pub rx_descriptors: u16,
    pub tx_descriptors: u16,
}

impl DpdkConfig {
    /// The lab setup: DPDK's af_packet PMD on `iface`, no hugepages, no PCI.
    pub fn lab(iface: &str) -> Self {
        DpdkConfig {
            eal_args: vec![
                "--no-huge".into(),
                "--no-pci".into(),
                // --in-memory conflicts with --no-huge (legacy memory mode) in
                // 22.11; no shared config plus a per-process prefix keeps
                // several processes apart instead.
                "--no-shconf".into(),
                format!("--file-prefix=capybara-{}", std::process::id()),
                "--no-telemetry".into(),
                "--log-level=error".into(),
                "-l".into(),
                "0".into(),
                format!("--vdev=net_af_packet0,iface={iface}"),
            ],
            port: PortSelector::Name("net_af_packet0".into()),
            mbufs: 4095,
            rx_descriptors: 512,
            tx_descriptors: 512,
        }
    }
}

/// Result of the one EAL initialisation of this process.
static EAL: Mutex<Option<Result<(), String>>> = Mutex::new(None);

fn eal_init(args: &[String]) -> Result<(), DeviceError> {
    let mut g = EAL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = &*g {
        return r.clone().map_err(DeviceError::Dpdk);
    }
    let owned: Vec<CString> = std::iter::once("capybara".to_string())
        .chain(args.iter().cloned())
        .map(|a| {
            CString::new(a).map_err(|_| DeviceError::Config("EAL argument contains NUL".into()))
        })
        .collect::<Result<_, _>>()?;
    // EAL may keep pointers into argv; leak them for the process lifetime.
    let mut argv: Vec<*mut c_char> = owned.into_iter().map(CString::into_raw).collect();
    let r = unsafe { cpb_eal_init(argv.len() as c_int, argv.as_mut_ptr()) };
    std::mem::forget(argv);
    let res = if r < 0 {
        Err(format!("rte_eal_init: {}", strerror(r)))
    } else {
        Ok(())
    };
    *g = Some(res.clone());
    res.map_err(DeviceError::Dpdk)
}

/// A started DPDK port.
pub struct Dpdk {
    port: u16,
    pool: *mut RteMempool,
    mac: EthernetAddress,
    burst: [*mut RteMbuf; BURST],
    /// Transmit bursts that found the mempool empty.
    pub alloc_failures: u64,
    /// Frames the NIC did not take (freed and lost).
    pub tx_dropped: u64,
}

// The port and its queues are used by one thread at a time (the owner).
unsafe impl Send for Dpdk {}

impl std::fmt::Debug for Dpdk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dpdk")
            .field("port", &self.port)
            .field("mac", &self.mac)
            .finish()
    }
}

impl Dpdk {
    pub fn open(config: &DpdkConfig) -> Result<Self, DeviceError> {
        eal_init(&config.eal_args)?;
        let port = match &config.port {
            PortSelector::Index(i) => {
                let n = unsafe { cpb_port_count() };
                if *i >= n {
                    return Err(DeviceError::Dpdk(format!(
                        "port {i} requested, {n} available"
                    )));
                }
                *i
            }
            PortSelector::Name(name) => {
                let c = CString::new(name.as_str())
                    .map_err(|_| DeviceError::NoSuchInterface(name.clone()))?;
                let mut p = 0u16;
                if unsafe { cpb_port_by_name(c.as_ptr(), &mut p) } != 0 {
                    return Err(DeviceError::NoSuchInterface(name.clone()));
                }
                p
            }
        };
        let pool_name = CString::new(format!("cpb_pool_{port}")).expect("no NUL");
        let mut pool = std::ptr::null_mut();
        let mut mac = [0u8; 6];
        let r = unsafe {
            cpb_port_setup(
                port,
                pool_name.as_ptr(),
                config.mbufs,
                config.rx_descriptors,
                config.tx_descriptors,
                &mut pool,
                mac.as_mut_ptr(),
            )
        };
        if r < 0 {
            return Err(DeviceError::Dpdk(format!(
                "setting up port {port}: {}",
                strerror(r)
            )));
        }
        Ok(Dpdk {
            port,
            pool,
            mac: EthernetAddress(mac),
            burst: [std::ptr::null_mut(); BURST],
            alloc_failures: 0,
            tx_dropped: 0,
        })
    }
}

impl Drop for Dpdk {
    fn drop(&mut self) {
        // The mempool stays: EAL memory lives until the process exits.
        unsafe { cpb_port_close(self.port) };
    }
}

impl Device for Dpdk {
    fn receive(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Result<usize, DeviceError> {
        let want = max.min(BURST) as u16;
        let n = unsafe { cpb_rx_burst(self.port, self.burst.as_mut_ptr(), want) } as usize;
        for &m in &self.burst[..n] {
            let mut len = 0u16;
            // SAFETY: the mbuf is ours until freed below; data_len bytes are valid.
            let data = unsafe { cpb_mbuf_data(m, &mut len) };
            f(unsafe { std::slice::from_raw_parts(data, usize::from(len)) });
        }
        if n > 0 {
            unsafe { cpb_mbuf_free_bulk(self.burst.as_mut_ptr(), n as u32) };
        }
        Ok(n)
    }

    fn transmit(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> Result<usize, DeviceError> {
        let want = max.min(BURST);
        if want == 0 {
            return Ok(0);
        }
        if unsafe { cpb_mbuf_alloc_bulk(self.pool, self.burst.as_mut_ptr(), want as u32) } != 0 {
            self.alloc_failures += 1;
            return Ok(0);
        }
        let mut filled = 0;
        while filled < want {
            let m = self.burst[filled];
            let mut cap = 0u16;
            let room = unsafe { cpb_mbuf_room(m, &mut cap) };
            let buf = unsafe { std::slice::from_raw_parts_mut(room, usize::from(cap)) };
            let Some(len) = f(buf) else { break };
            unsafe { cpb_mbuf_set_len(m, len.min(usize::from(cap)) as u16) };
            filled += 1;
        }
        let sent = if filled > 0 {
            usize::from(unsafe { cpb_tx_burst(self.port, self.burst.as_mut_ptr(), filled as u16) })
        } else {
            0
        };
        // Unsent and unused mbufs go back to the pool.
        if sent < want {
            self.tx_dropped += (filled - sent) as u64;
            unsafe { cpb_mbuf_free_bulk(self.burst.as_mut_ptr().add(sent), (want - sent) as u32) };
        }
        Ok(sent)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), DeviceError> {
        let cap = Duration::from_micros(100);
        std::thread::sleep(timeout.map_or(cap, |t| t.min(cap)));
        Ok(())
    }

    fn mac(&self) -> Option<EthernetAddress> {
        Some(self.mac)
    }

    fn max_frame_len(&self) -> usize {
        1514
    }
}
