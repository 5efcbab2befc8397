//! AF_PACKET backend with mmap'ed TPACKET_V2 receive and transmit rings.
//!
//! One socket bound to one interface. The kernel writes received frames into
//! the RX ring and flips each slot's status to `TP_STATUS_USER`; we read the
//! frame in place and hand the slot back (`TP_STATUS_KERNEL`). For transmit
//! we fill `TP_STATUS_AVAILABLE` slots of the TX ring, mark them
//! `TP_STATUS_SEND_REQUEST`, and kick the kernel with one `sendto` per batch.
//! `PACKET_QDISC_BYPASS` skips the qdisc layer; `PACKET_IGNORE_OUTGOING`
//! keeps our own (and the kernel's) outgoing frames out of the RX ring, with a
//! `PACKET_OUTGOING` check per frame as a fallback for kernels before 4.20.
//!
//! Invariants: slot indices stay below the slot count; a slot's status is read
//! with acquire and written with release ordering, since the kernel reads and
//! writes the same memory concurrently; kernel-written offsets are
//! bounds-checked before a slice is formed.
//!
//! The kernel still sees every frame too (AF_PACKET taps, it does not
//! steal): the stack's data address must not be one the kernel owns, or the
//! kernel would answer and reset the stack's connections. With
//! `kernel_drop` set, a tc ingress program (`kernel_drop.rs`) drops the
//! stack's frames right after the tap has copied them into the ring, so the
//! kernel's IPv4 input path never runs for them.

use super::kernel_drop::KernelDrop;
use super::{Device, DeviceError};
use crate::latency::LatencyHistogram;
use crate::wire::EthernetAddress;
use capybara_proto::time::Duration;
use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};

// <linux/if_packet.h>; defined here because not every libc release exports them.
const PACKET_RX_RING: libc::c_int = 5;
const PACKET_STATISTICS: libc::c_int = 6;
const PACKET_VERSION: libc::c_int = 10;
const PACKET_TX_RING: libc::c_int = 13;
const PACKET_QDISC_BYPASS: libc::c_int = 20;
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
const TPACKET_V2: libc::c_int = 1;
const TP_STATUS_KERNEL: u32 = 0;
const TP_STATUS_USER: u32 = 1;
const TP_STATUS_AVAILABLE: u32 = 0;
const TP_STATUS_SEND_REQUEST: u32 = 1;
const TP_STATUS_SENDING: u32 = 2;
const TP_STATUS_WRONG_FORMAT: u32 = 4;
const PACKET_OUTGOING: u8 = 4;
/// TPACKET_ALIGN(sizeof(struct tpacket2_hdr)): where `sockaddr_ll` starts in
/// an RX slot and where frame data starts in a TX slot.
const TPACKET2_HDR_ALIGNED: usize = 32;
/// Offset of `sll_pkttype` inside `sockaddr_ll`.
const SLL_PKTTYPE: usize = 10;

#[repr(C)]
struct TpacketReq {
    tp_block_size: u32,
    tp_block_nr: u32,
    tp_frame_size: u32,
    tp_frame_nr: u32,
}

/// `struct tpacket2_hdr`, the head of every ring slot.
#[repr(C)]
struct Tpacket2Hdr {
    tp_status: u32,
    tp_len: u32,
    tp_snaplen: u32,
    tp_mac: u16,
    tp_net: u16,
    tp_sec: u32,
    tp_nsec: u32,
    tp_vlan_tci: u16,
    tp_vlan_tpid: u16,
    tp_padding: [u8; 4],
}

#[repr(C)]
struct TpacketStats {
    tp_packets: u32,
    tp_drops: u32,
}

/// Ring geometry and socket options.
#[derive(Debug, Clone)]
pub struct AfPacketConfig {
    pub interface: String,
    /// Bytes per slot (header + frame); a power of two, at least 2048 for a
    /// 1500-byte MTU.
    pub frame_size: u32,
    pub rx_frames: u32,
    pub tx_frames: u32,
    pub qdisc_bypass: bool,
    /// IPv4 addresses the stack owns whose frames the kernel should not
    /// process after the tap (see `kernel_drop.rs`); empty: off. If the
    /// program cannot be attached (old kernel, no CAP_BPF) the device still
    /// opens and `kernel_drop_error` says why.
    pub kernel_drop: Vec<Ipv4Addr>,
}

impl AfPacketConfig {
    pub fn new(interface: impl Into<String>) -> Self {
        AfPacketConfig {
            interface: interface.into(),
            frame_size: 2048,
            rx_frames: 512,
            tx_frames: 512,
            qdisc_bypass: true,
            kernel_drop: Vec::new(),
        }
    }
}

/// Kernel-side counters of the RX ring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AfPacketStats {
    /// Frames the kernel accepted into the ring since the last call.
    pub packets: u64,
    /// Frames the kernel dropped because the ring was full.
    pub drops: u64,
    /// Our own outgoing frames seen on RX (kernel without
    /// PACKET_IGNORE_OUTGOING) and skipped.
    pub outgoing_skipped: u64,
    /// TX slots the kernel rejected (`TP_STATUS_WRONG_FORMAT`).
    pub tx_wrong_format: u64,
    /// Transmit batches cut short because the TX ring was full.
    pub tx_ring_full: u64,
}

struct Ring {
    base: *mut u8,
    frame_size: usize,
    frames: usize,
    next: usize,
}

impl Ring {
    fn slot(&self, i: usize) -> *mut u8 {
        // i < frames, so the offset stays inside the mapping.
        unsafe { self.base.add(i * self.frame_size) }
    }
    fn status(&self, i: usize) -> &AtomicU32 {
        // tp_status is the first, 4-byte aligned, field of the slot; slots
        // are 16-byte aligned within a page-aligned mapping.
        unsafe { &*(self.slot(i) as *const AtomicU32) }
    }
}

/// An AF_PACKET socket with TPACKET_V2 rings bound to one interface.
pub struct AfPacket {
    fd: RawFd,
    map: *mut libc::c_void,
    map_len: usize,
    rx: Ring,
    tx: Ring,
    interface: String,
    mac: EthernetAddress,
    ignore_outgoing: bool,
    stats: AfPacketStats,
    kernel_drop: Result<Option<KernelDrop>, String>,
    /// Ring-to-handling delay of the first frame of each receive batch.
    rx_delay: LatencyHistogram,
    /// Duration of each transmit kick (`sendto`): on veth it includes the
    /// receiving side's kernel work, which runs inline.
    tx_kick: LatencyHistogram,
}

// The mapping and descriptor are owned exclusively by this value.
unsafe impl Send for AfPacket {}

impl std::fmt::Debug for AfPacket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AfPacket")
            .field("interface", &self.interface)
            .field("fd", &self.fd)
            .field("mac", &self.mac)
            .finish()
    }
}

fn io_err(op: &'static str, interface: &str) -> DeviceError {
    DeviceError::Io {
        op,
        interface: interface.to_string(),
        source: io::Error::last_os_error(),
    }
}

fn setsockopt<T>(fd: RawFd, opt: libc::c_int, val: &T) -> io::Result<()> {
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            opt,
            val as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl AfPacket {
    /// Opens the socket, sets up both rings, and binds to the interface.
    /// Requires CAP_NET_RAW in the interface's network namespace.
    pub fn open(config: &AfPacketConfig) -> Result<Self, DeviceError> {
        let name = &config.interface;
        let fs = config.frame_size as usize;
        if !fs.is_power_of_two() || !(2048..=65536).contains(&fs) {
            return Err(DeviceError::Config(format!(
                "frame_size {fs} must be a power of two in 2048..=65536"
            )));
        }
        if config.rx_frames == 0 || config.tx_frames == 0 {
            return Err(DeviceError::Config(
                "rx_frames and tx_frames must be positive".into(),
            ));
        }
        let cname =
            CString::new(name.as_str()).map_err(|_| DeviceError::NoSuchInterface(name.clone()))?;
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if ifindex == 0 {
            return Err(DeviceError::NoSuchInterface(name.clone()));
        }
        // Protocol 0: no frames are queued until `bind`, so the rings start clean.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
            )
        };
        if fd < 0 {
            return Err(io_err("socket(AF_PACKET)", name));
        }
        // From here on, `guard` closes the fd on every error path.
        struct Fd(RawFd);
        impl Drop for Fd {
            fn drop(&mut self) {
                if self.0 >= 0 {
                    unsafe { libc::close(self.0) };
                }
            }
        }
        let mut guard = Fd(fd);
        let opt_err = |op: &'static str, e: io::Error| DeviceError::Io {
            op,
            interface: name.clone(),
            source: e,
        };

        setsockopt(fd, PACKET_VERSION, &TPACKET_V2).map_err(|e| opt_err("PACKET_VERSION", e))?;
        // One slot per page-sized block is the simplest valid geometry for
        // any power-of-two slot size >= 2048 (block = max(slot, page)).
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let block = fs.max(page);
        let per_block = block / fs;
        let req = |frames: u32| {
            let blocks = (frames as usize).div_ceil(per_block);
            TpacketReq {
                tp_block_size: block as u32,
                tp_block_nr: blocks as u32,
                tp_frame_size: fs as u32,
                tp_frame_nr: (blocks * per_block) as u32,
            }
        };
        let (rx_req, tx_req) = (req(config.rx_frames), req(config.tx_frames));
        setsockopt(fd, PACKET_RX_RING, &rx_req).map_err(|e| opt_err("PACKET_RX_RING", e))?;
        setsockopt(fd, PACKET_TX_RING, &tx_req).map_err(|e| opt_err("PACKET_TX_RING", e))?;
        if config.qdisc_bypass {
            setsockopt(fd, PACKET_QDISC_BYPASS, &1i32)
                .map_err(|e| opt_err("PACKET_QDISC_BYPASS", e))?;
        }
        // Older kernels lack it; the per-frame pkttype check covers them.
        let ignore_outgoing = setsockopt(fd, PACKET_IGNORE_OUTGOING, &1i32).is_ok();

        let rx_len = (rx_req.tp_block_size * rx_req.tp_block_nr) as usize;
        let tx_len = (tx_req.tp_block_size * tx_req.tp_block_nr) as usize;
        let map_len = rx_len + tx_len;
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io_err("mmap(packet rings)", name));
        }
        let base = map as *mut u8;
        let mut dev = AfPacket {
            fd,
            map,
            map_len,
            rx: Ring {
                base,
                frame_size: fs,
                frames: rx_req.tp_frame_nr as usize,
                next: 0,
            },
            tx: Ring {
                base: unsafe { base.add(rx_len) },
                frame_size: fs,
                frames: tx_req.tp_frame_nr as usize,
                next: 0,
            },
            interface: name.clone(),
            mac: EthernetAddress::ZERO,
            ignore_outgoing,
            stats: AfPacketStats::default(),
            kernel_drop: Ok(None),
            rx_delay: LatencyHistogram::new(),
            tx_kick: LatencyHistogram::new(),
        };
        guard.0 = -1; // `dev` owns the fd now (its Drop unmaps and closes)

        dev.mac = hardware_address(fd, name)?;
        let sll = libc::sockaddr_ll {
            sll_family: libc::AF_PACKET as u16,
            sll_protocol: (libc::ETH_P_ALL as u16).to_be(),
            sll_ifindex: ifindex as i32,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        let r = unsafe {
            libc::bind(
                fd,
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io_err("bind", name));
        }
        if !config.kernel_drop.is_empty() {
            dev.kernel_drop = KernelDrop::attach(name, ifindex, &config.kernel_drop)
                .map(Some)
                .map_err(|e| e.to_string());
        }
        Ok(dev)
    }

    /// The addresses whose frames the kernel skips, if the drop program is
    /// attached.
    pub fn kernel_drop(&self) -> Option<&[Ipv4Addr]> {
        match &self.kernel_drop {
            Ok(Some(k)) => Some(k.addresses()),
            _ => None,
        }
    }

    /// Why the requested kernel-drop program could not be attached.
    pub fn kernel_drop_error(&self) -> Option<&str> {
        self.kernel_drop.as_ref().err().map(String::as_str)
    }

    pub fn interface(&self) -> &str {
        &self.interface
    }

    /// Whether the kernel filters our outgoing frames (PACKET_IGNORE_OUTGOING).
    pub fn ignores_outgoing_in_kernel(&self) -> bool {
        self.ignore_outgoing
    }

    /// Counters; the kernel's part (`packets`, `drops`) resets on each read.
    pub fn stats(&mut self) -> AfPacketStats {
        let mut st = TpacketStats {
            tp_packets: 0,
            tp_drops: 0,
        };
        let mut len = std::mem::size_of::<TpacketStats>() as libc::socklen_t;
        let r = unsafe {
            libc::getsockopt(
                self.fd,
                libc::SOL_PACKET,
                PACKET_STATISTICS,
                &mut st as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        if r == 0 {
            self.stats.packets += u64::from(st.tp_packets);
            self.stats.drops += u64::from(st.tp_drops);
        }
        self.stats
    }

    fn flush_tx(&mut self) -> Result<(), DeviceError> {
        let start = realtime_ns();
        let r = unsafe {
            libc::sendto(
                self.fd,
                std::ptr::null(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            )
        };
        self.tx_kick
            .record_ns(realtime_ns().saturating_sub(start).max(0) as u64);
        if r < 0 {
            let e = io::Error::last_os_error();
            // Queued slots stay SEND_REQUEST and go out with the next kick.
            if matches!(
                e.raw_os_error(),
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR)
            ) {
                return Ok(());
            }
            return Err(DeviceError::Io {
                op: "sendto(tx ring)",
                interface: self.interface.clone(),
                source: e,
            });
        }
        Ok(())
    }
}

/// Nanoseconds from a ring slot's timestamp to now. The kernel stamps
/// each slot with CLOCK_REALTIME when it copies the frame in (or with the
/// frame's earlier software receive timestamp, if the host enabled them);
/// 0 if the clock stepped back.
fn since_realtime(sec: u32, nsec: u32) -> u64 {
    let now_ns = realtime_ns();
    let now_sec = now_ns.div_euclid(1_000_000_000);
    // tp_sec is the low 32 bits of the seconds: rebuild the rest from now.
    let mut s = (now_sec & !0xffff_ffff) | i64::from(sec);
    if s > now_sec {
        s -= 1 << 32;
    }
    let then_ns = s.wrapping_mul(1_000_000_000).wrapping_add(i64::from(nsec));
    now_ns.saturating_sub(then_ns).max(0) as u64
}

/// CLOCK_REALTIME in nanoseconds (vDSO, no system call).
fn realtime_ns() -> i64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    // time_t and c_long are 32-bit on 32-bit targets.
    #[allow(clippy::unnecessary_cast)]
    (now.tv_sec as i64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(now.tv_nsec as i64)
}

/// Reads the interface's MAC with SIOCGIFHWADDR (works inside a network
/// namespace entered with setns, unlike /sys).
fn hardware_address(fd: RawFd, name: &str) -> Result<EthernetAddress, DeviceError> {
    // struct ifreq: 16-byte name, then a union whose sockaddr holds the MAC.
    #[repr(C)]
    struct IfReq {
        name: [libc::c_char; libc::IFNAMSIZ],
        hwaddr: libc::sockaddr,
        _pad: [u8; 8],
    }
    let mut req: IfReq = unsafe { std::mem::zeroed() };
    for (d, s) in req
        .name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *d = s as libc::c_char;
    }
    if unsafe { libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut req) } != 0 {
        return Err(io_err("ioctl(SIOCGIFHWADDR)", name));
    }
    let mut mac = [0u8; 6];
    for (d, s) in mac.iter_mut().zip(req.hwaddr.sa_data.iter()) {
        *d = *s as u8;
    }
    Ok(EthernetAddress(mac))
}

impl Drop for AfPacket {
    fn drop(&mut self) {
        unsafe {
            libc::munmap(self.map, self.map_len);
            libc::close(self.fd);
        }
    }
}

impl Device for AfPacket {
    fn receive(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Result<usize, DeviceError> {
        let mut n = 0;
        while n < max {
            let i = self.rx.next;
            let status = self.rx.status(i);
            if status.load(Ordering::Acquire) & TP_STATUS_USER == 0 {
                break;
            }
            let slot = self.rx.slot(i);
            let fs = self.rx.frame_size;
            // SAFETY: the slot is ours until we store TP_STATUS_KERNEL.
            let (mac_off, snap, sec, nsec) = unsafe {
                let h = &*(slot as *const Tpacket2Hdr);
                (
                    usize::from(h.tp_mac),
                    h.tp_snaplen as usize,
                    h.tp_sec,
                    h.tp_nsec,
                )
            };
            let pkttype = unsafe { *slot.add(TPACKET2_HDR_ALIGNED + SLL_PKTTYPE) };
            if pkttype == PACKET_OUTGOING {
                self.stats.outgoing_skipped += 1;
            } else if mac_off.checked_add(snap).is_some_and(|end| end <= fs) {
                if n == 0 {
                    // The frame that ended the driver's sleep (or waited
                    // behind its previous batch): one clock reading per
                    // batch, through the vDSO.
                    self.rx_delay.record_ns(since_realtime(sec, nsec));
                }
                let frame = unsafe { std::slice::from_raw_parts(slot.add(mac_off), snap) };
                f(frame);
                n += 1;
            }
            status.store(TP_STATUS_KERNEL, Ordering::Release);
            self.rx.next = (i + 1) % self.rx.frames;
        }
        Ok(n)
    }

    fn transmit(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> Result<usize, DeviceError> {
        let cap = self.tx.frame_size - TPACKET2_HDR_ALIGNED;
        let mut n = 0;
        while n < max {
            let i = self.tx.next;
            let status = self.tx.status(i);
            match status.load(Ordering::Acquire) {
                TP_STATUS_AVAILABLE => {}
                TP_STATUS_WRONG_FORMAT => {
                    self.stats.tx_wrong_format += 1;
                    status.store(TP_STATUS_AVAILABLE, Ordering::Release);
                }
                s if s & (TP_STATUS_SEND_REQUEST | TP_STATUS_SENDING) != 0 => {
                    self.stats.tx_ring_full += 1;
                    break;
                }
                _ => {}
            }
            let slot = self.tx.slot(i);
            // SAFETY: AVAILABLE slots belong to user space until SEND_REQUEST.
            let buf =
                unsafe { std::slice::from_raw_parts_mut(slot.add(TPACKET2_HDR_ALIGNED), cap) };
            let Some(len) = f(buf) else { break };
            let len = len.min(cap);
            unsafe { (*(slot as *mut Tpacket2Hdr)).tp_len = len as u32 };
            status.store(TP_STATUS_SEND_REQUEST, Ordering::Release);
            self.tx.next = (i + 1) % self.tx.frames;
            n += 1;
        }
        if n > 0 {
            self.flush_tx()?;
        }
        Ok(n)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), DeviceError> {
        if self.rx.status(self.rx.next).load(Ordering::Acquire) & TP_STATUS_USER != 0 {
            return Ok(());
        }
        let mut pfd = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        let r = unsafe { libc::ppoll(&mut pfd, 1, tsp, std::ptr::null()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(DeviceError::Io {
                    op: "ppoll",
                    interface: self.interface.clone(),
                    source: e,
                });
            }
        }
        Ok(())
    }

    fn raw_fd(&self) -> Option<RawFd> {
        Some(self.fd)
    }

    fn rx_delay(&self) -> Option<&LatencyHistogram> {
        Some(&self.rx_delay)
    }

    fn tx_kick(&self) -> Option<&LatencyHistogram> {
        Some(&self.tx_kick)
    }

    fn mac(&self) -> Option<EthernetAddress> {
        Some(self.mac)
    }

    fn max_frame_len(&self) -> usize {
        self.tx.frame_size - TPACKET2_HDR_ALIGNED
    }
}
