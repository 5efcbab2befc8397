//! Attaches the lab's pass-through XDP program (`bpf/pass.bpf.c`) to the
//! `eth0` of client and server nodes, so that frames the switch's XDP program
//! redirects into those veths are accepted without enabling GRO. Attached
//! through netlink, so it outlives this process and goes with the namespace.

use super::{bpf_err, ifindex, in_namespace, LabError};
use libbpf_rs::{ObjectBuilder, Xdp, XdpFlags};
use std::os::fd::AsFd;

static PASS_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pass.bpf.o"));

/// Attaches (or replaces) the pass program on `iface` in namespace `ns`.
pub fn attach_pass(ns: &str, iface: &str) -> Result<(), LabError> {
    in_namespace(ns, || {
        let idx = ifindex(iface, ns)?;
        let open = ObjectBuilder::default()
            .open_memory(PASS_OBJ)
            .map_err(bpf_err("cannot open the lab XDP object"))?;
        let obj = open
            .load()
            .map_err(bpf_err("cannot load the lab XDP program"))?;
        let prog = obj
            .progs()
            .find(|p| p.name() == "capy_lab_pass")
            .ok_or_else(|| LabError::Invalid("lab XDP object has no program".into()))?;
        Xdp::new(prog.as_fd())
            .attach(idx, XdpFlags::DRV_MODE)
            .map_err(bpf_err("cannot attach the lab XDP program"))
    })
}
