//! Keeps the kernel from processing the frames an AF_PACKET stack consumes.
//!
//! AF_PACKET taps frames; it does not steal them. Every frame addressed to
//! the stack's data address therefore also climbs the kernel's IPv4 input
//! path (header checks, route lookup) only to be dropped there, because the
//! kernel does not own the address. That work runs in softirq on the shared
//! cores for every packet the stack receives.
//!
//! [`KernelDrop`] attaches a tiny tc (TCX) ingress program to the interface
//! that drops IPv4 frames whose destination is one of the stack's addresses.
//! The kernel delivers a frame to AF_PACKET taps (`ptype_all`) *before* the
//! tc ingress hook, so the stack still sees every frame; only the kernel's
//! own processing is skipped. Everything else (ARP, the management address,
//! other programs' traffic) passes untouched (`TCX_NEXT`).
//!
//! The program is 10 + n eBPF instructions assembled here, loaded with
//! `bpf(BPF_PROG_LOAD)` and attached with `bpf(BPF_LINK_CREATE)` (TCX,
//! Linux >= 6.6): no clang, no object file, no netlink. The attachment is a
//! BPF link owned by a file descriptor, so it goes away when the value is
//! dropped or the process dies; nothing is left behind on the interface.

use super::DeviceError;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_TCX_INGRESS: u32 = 46;
/// Size of `union bpf_attr` we pass (the kernel accepts larger, zeroed).
const ATTR_LEN: usize = 144;
/// `struct __sk_buff` offsets of `data` and `data_end`.
const SKB_DATA: i16 = 76;
const SKB_DATA_END: i16 = 80;
const TCX_NEXT: i32 = -1;
const TCX_DROP: i32 = 2;
/// Most addresses one program matches (the data address plus VIPs).
pub const MAX_ADDRESSES: usize = 64;

/// One eBPF instruction (`struct bpf_insn`).
#[derive(Clone, Copy)]
#[repr(C)]
struct Insn {
    code: u8,
    regs: u8, // dst in the low nibble, src in the high nibble
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

// Opcodes (class | op | source).
const MOV64_X: u8 = 0xbf;
const MOV64_K: u8 = 0xb7;
const ADD64_K: u8 = 0x07;
const LDX_W: u8 = 0x61;
const LDX_H: u8 = 0x69;
const JGT_X: u8 = 0x2d;
const JNE32_K: u8 = 0x56;
const JEQ32_K: u8 = 0x16;
const JA: u8 = 0x05;
const EXIT: u8 = 0x95;

/// The filter program: drop IPv4 frames to any of `addrs`, pass the rest.
fn program(addrs: &[Ipv4Addr]) -> Vec<Insn> {
    let n = addrs.len() as i16;
    let mut p = vec![
        insn(LDX_W, 2, 1, SKB_DATA, 0),     // r2 = skb->data
        insn(LDX_W, 3, 1, SKB_DATA_END, 0), // r3 = skb->data_end
        insn(MOV64_X, 4, 2, 0, 0),          // r4 = r2
        insn(ADD64_K, 4, 0, 0, 34),         // r4 += 14 (Ethernet) + 20 (IPv4)
        // Too short for an IPv4 header: pass (skip the checks, the jump
        // to "drop" and the drop itself).
        insn(JGT_X, 4, 3, 3 + n + 1 + 2, 0),
        insn(LDX_H, 5, 2, 12, 0), // r5 = ethertype, as stored (big-endian)
        insn(
            JNE32_K,
            5,
            0,
            1 + n + 1 + 2,
            i32::from(u16::from_ne_bytes([0x08, 0x00])),
        ),
        insn(LDX_W, 5, 2, 30, 0), // r5 = IPv4 destination, as stored
    ];
    for (i, a) in addrs.iter().enumerate() {
        // Jump to "drop" (past the remaining compares and the pass jump).
        let to_drop = (n - i as i16 - 1) + 1;
        p.push(insn(JEQ32_K, 5, 0, to_drop, i32::from_ne_bytes(a.octets())));
    }
    p.push(insn(JA, 0, 0, 2, 0)); // no match: to "pass"
    p.push(insn(MOV64_K, 0, 0, 0, TCX_DROP)); // drop:
    p.push(insn(EXIT, 0, 0, 0, 0));
    p.push(insn(MOV64_K, 0, 0, 0, TCX_NEXT)); // pass:
    p.push(insn(EXIT, 0, 0, 0, 0));
    p
}

fn bpf(cmd: libc::c_long, attr: &mut [u8; ATTR_LEN]) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a zero-padded `union bpf_attr` of ATTR_LEN bytes
    // whose pointers (instructions, license, log) outlive the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), ATTR_LEN as u32) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: on success both commands return a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

fn put_u32(attr: &mut [u8; ATTR_LEN], off: usize, v: u32) {
    attr[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}
fn put_u64(attr: &mut [u8; ATTR_LEN], off: usize, v: u64) {
    attr[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}

/// The attached drop program; detached when dropped.
#[derive(Debug)]
pub struct KernelDrop {
    _link: OwnedFd,
    _prog: OwnedFd,
    addresses: Vec<Ipv4Addr>,
}

impl KernelDrop {
    /// Loads the program and attaches it to tc ingress of `ifindex`. Needs
    /// CAP_BPF + CAP_NET_ADMIN and Linux >= 6.6 (TCX).
    pub fn attach(interface: &str, ifindex: u32, addrs: &[Ipv4Addr]) -> Result<Self, DeviceError> {
        let err = |op: &'static str, source: io::Error| DeviceError::Io {
            op,
            interface: interface.to_string(),
            source,
        };
        if addrs.is_empty() || addrs.len() > MAX_ADDRESSES {
            return Err(DeviceError::Config(format!(
                "kernel drop needs 1..={MAX_ADDRESSES} addresses, got {}",
                addrs.len()
            )));
        }
        let insns = program(addrs);
        let license = b"GPL\0";
        let mut log = vec![0u8; 4096];
        let mut attr = [0u8; ATTR_LEN];
        put_u32(&mut attr, 0, BPF_PROG_TYPE_SCHED_CLS);
        put_u32(&mut attr, 4, insns.len() as u32);
        put_u64(&mut attr, 8, insns.as_ptr() as u64);
        put_u64(&mut attr, 16, license.as_ptr() as u64);
        put_u32(&mut attr, 24, 1); // log_level: explain a rejection
        put_u32(&mut attr, 28, log.len() as u32);
        put_u64(&mut attr, 32, log.as_mut_ptr() as u64);
        attr[48..48 + 10].copy_from_slice(b"capy_kdrop");
        put_u32(&mut attr, 68, BPF_TCX_INGRESS);
        let prog = bpf(BPF_PROG_LOAD, &mut attr).map_err(|e| {
            let msg =
                String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(0)])
                    .trim()
                    .to_string();
            if msg.is_empty() {
                err("bpf(BPF_PROG_LOAD) of the kernel-drop program", e)
            } else {
                err(
                    "bpf(BPF_PROG_LOAD) of the kernel-drop program",
                    io::Error::new(e.kind(), format!("{e}: {msg}")),
                )
            }
        })?;
        let mut attr = [0u8; ATTR_LEN];
        put_u32(&mut attr, 0, prog.as_raw_fd() as u32);
        put_u32(&mut attr, 4, ifindex);
        put_u32(&mut attr, 8, BPF_TCX_INGRESS);
        let link = bpf(BPF_LINK_CREATE, &mut attr)
            .map_err(|e| err("bpf(BPF_LINK_CREATE) tcx ingress", e))?;
        Ok(KernelDrop {
            _link: link,
            _prog: prog,
            addresses: addrs.to_vec(),
        })
    }

    /// The destinations whose frames the kernel skips.
    pub fn addresses(&self) -> &[Ipv4Addr] {
        &self.addresses
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jumps_land_on_drop_and_pass() {
        for n in 1..4 {
            let addrs: Vec<Ipv4Addr> = (0..n).map(|i| Ipv4Addr::new(10, 0, 0, i)).collect();
            let p = program(&addrs);
            let len = p.len() as i16;
            let (drop, pass) = (len - 4, len - 2);
            assert_eq!(p[drop as usize].imm, TCX_DROP);
            assert_eq!(p[pass as usize].imm, TCX_NEXT);
            // Every conditional jump lands on "pass", "drop" or the next check.
            assert_eq!(4 + 1 + p[4].off, pass, "short frame -> pass");
            assert_eq!(6 + 1 + p[6].off, pass, "not IPv4 -> pass");
            for i in 0..n as usize {
                let at = 8 + i;
                assert_eq!(at as i16 + 1 + p[at].off, drop, "match {i} -> drop");
            }
            let ja = 8 + n as usize;
            assert_eq!(ja as i16 + 1 + p[ja].off, pass, "no match -> pass");
        }
    }
}
