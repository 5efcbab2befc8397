//! The lab's fault injector: attaches `bpf/fault.bpf.c` (a tc program) to one
//! interface of one lab namespace, so that a given fraction of packets is
//! dropped, duplicated or delayed. The machines have no `sch_netem`.
//!
//! The program stays attached after the command exits (tc holds it); its maps
//! are pinned under the lab's bpffs directory so that `--stats` can read them
//! and `--clear` or `lab down` remove them. Deleting the namespace removes the
//! program with the interface.

use super::{bpf_err, ifindex, in_namespace, LabError};
use libbpf_rs::{MapCore, MapFlags, ObjectBuilder, TcHookBuilder, TC_EGRESS, TC_INGRESS};
use std::os::fd::AsFd;

static FAULT_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fault.bpf.o"));

/// Which way the faulty packets travel, seen from the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Egress,
    Ingress,
}

/// What to do to packets, each as a fraction in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultSpec {
    pub drop: f64,
    pub duplicate: f64,
    pub delay_fraction: f64,
    pub delay_us: u32,
    pub direction: Direction,
}

/// Counters the program keeps, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    pub seen: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub delayed: u64,
}

#[repr(C)]
#[derive(Default)]
struct FaultCfg {
    drop_threshold: u32,
    dup_threshold: u32,
    delay_threshold: u32,
    delay_us: u32,
}

/// Parses a fraction given as `0.1` or `10%`.
pub fn parse_fraction(what: &str, s: &str) -> Result<f64, String> {
    let (num, scale) = match s.strip_suffix('%') {
        Some(n) => (n, 100.0),
        None => (s, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=scale).contains(&v) => Ok(v / scale),
        _ => Err(format!(
            "invalid {what} {s:?}: expected a fraction between 0 and 1 (e.g. 0.05) or a percentage (e.g. 5%)"
        )),
    }
}

fn threshold(fraction: f64) -> u32 {
    (fraction.clamp(0.0, 1.0) * f64::from(u32::MAX)) as u32
}

fn pin_path(pin_dir: &str, ns: &str, iface: &str) -> String {
    format!("{pin_dir}/fault-{ns}-{iface}-stats")
}

/// Attaches (or replaces) the fault injector on `iface` in namespace `ns`.
pub fn apply(pin_dir: &str, ns: &str, iface: &str, spec: FaultSpec) -> Result<(), LabError> {
    if spec.delay_us > 0 && spec.delay_fraction > 0.0 {
        // Earliest-departure-time delays need fq; say so instead of silently
        // not delaying.
        super::run(&["tc", "-n", ns, "qdisc", "replace", "dev", iface, "root", "fq"]).map_err(
            |e| {
                LabError::Invalid(format!(
                    "delay needs the fq qdisc (sch_fq), which this kernel does not provide ({e}); drop and duplicate work without it"
                ))
            },
        )?;
    }
    std::fs::create_dir_all(pin_dir)
        .map_err(|e| LabError::Invalid(format!("cannot create {pin_dir}: {e}")))?;
    let pin = pin_path(pin_dir, ns, iface);
    let _ = std::fs::remove_file(&pin);
    in_namespace(ns, || {
        let idx = ifindex(iface, ns)?;
        let open = ObjectBuilder::default()
            .open_memory(FAULT_OBJ)
            .map_err(bpf_err("cannot open the fault injector object"))?;
        let mut obj = open
            .load()
            .map_err(bpf_err("cannot load the fault injector"))?;
        let cfg = FaultCfg {
            drop_threshold: threshold(spec.drop),
            dup_threshold: threshold(spec.duplicate),
            delay_threshold: threshold(spec.delay_fraction),
            delay_us: spec.delay_us,
        };
        // SAFETY: FaultCfg is repr(C) plain data matching struct fault_cfg.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&cfg as *const FaultCfg).cast::<u8>(),
                std::mem::size_of::<FaultCfg>(),
            )
        };
        let mut found = false;
        for mut map in obj.maps_mut() {
            match map.name().to_str() {
                Some("fault_cfg") => {
                    map.update(&0u32.to_ne_bytes(), bytes, MapFlags::ANY)
                        .map_err(bpf_err("cannot configure the fault injector"))?;
                    found = true;
                }
                Some("fault_stats") => {
                    map.pin(&pin)
                        .map_err(bpf_err("cannot pin the fault statistics"))?;
                }
                _ => {}
            }
        }
        if !found {
            return Err(LabError::Invalid(
                "fault injector object has no fault_cfg map".into(),
            ));
        }
        let prog = obj
            .progs()
            .find(|p| p.name() == "capy_fault")
            .ok_or_else(|| LabError::Invalid("fault injector object has no program".into()))?;
        let point = match spec.direction {
            Direction::Egress => TC_EGRESS,
            Direction::Ingress => TC_INGRESS,
        };
        let mut hook = TcHookBuilder::new(prog.as_fd())
            .ifindex(idx)
            .replace(true)
            .handle(0xca9b)
            .priority(1)
            .hook(point);
        hook.create()
            .map_err(bpf_err("cannot create the clsact qdisc"))?;
        hook.attach()
            .map_err(bpf_err("cannot attach the fault injector"))?;
        Ok(())
    })
}

/// Detaches the fault injector from `iface` and removes its pinned maps.
pub fn clear(pin_dir: &str, ns: &str, iface: &str) -> Result<(), LabError> {
    // Deleting the clsact qdisc removes every filter on it.
    let _ = super::run(&["tc", "-n", ns, "qdisc", "del", "dev", iface, "clsact"]);
    let _ = super::run(&["tc", "-n", ns, "qdisc", "del", "dev", iface, "root"]);
    let pin = pin_path(pin_dir, ns, iface);
    match std::fs::remove_file(&pin) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(LabError::Invalid(format!("cannot remove {pin}: {e}"))),
    }
}

/// Reads the injector's counters on `iface`.
pub fn stats(pin_dir: &str, ns: &str, iface: &str) -> Result<FaultStats, LabError> {
    let pin = pin_path(pin_dir, ns, iface);
    let map = libbpf_rs::MapHandle::from_pinned_path(&pin).map_err(|e| {
        LabError::Invalid(format!("no fault injector on {ns}/{iface} ({pin}: {e})"))
    })?;
    let per_cpu = map
        .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
        .map_err(bpf_err("cannot read fault statistics"))?
        .unwrap_or_default();
    let mut s = FaultStats::default();
    for v in per_cpu {
        let f = |i: usize| {
            v.get(i * 8..i * 8 + 8)
                .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
                .unwrap_or(0)
        };
        s.seen += f(0);
        s.dropped += f(1);
        s.duplicated += f(2);
        s.delayed += f(3);
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_parse_and_reject() {
        assert_eq!(parse_fraction("drop", "0.1"), Ok(0.1));
        assert_eq!(parse_fraction("drop", "5%"), Ok(0.05));
        assert!(parse_fraction("drop", "1.5").is_err());
        assert!(parse_fraction("drop", "-1").is_err());
        assert!(parse_fraction("drop", "abc")
            .unwrap_err()
            .contains("\"abc\""));
        assert!(parse_fraction("drop", "NaN").is_err());
    }
}
