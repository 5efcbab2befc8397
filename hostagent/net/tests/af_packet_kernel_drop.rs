//! Real network: with `kernel_drop`, the AF_PACKET stack still receives and
//! answers every frame to its data address, while the server namespace's
//! kernel no longer runs its IPv4 input path for them (its `Ip: InReceives`
//! counter stays put). Without it, the kernel counts each one.
//! Needs root (network namespaces, CAP_BPF); skipped with a message otherwise.

mod common;

use capybara_net::device::af_packet::{AfPacket, AfPacketConfig};
use capybara_net::driver::{self, Clock, DriverConfig};
use capybara_net::{Interface, InterfaceConfig, NoTransport};
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `Ip: InReceives` of namespace `ns` (/proc/net/snmp).
fn ip_in_receives(ns: &str) -> u64 {
    let snmp = must(&["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"]);
    let mut ip = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (ip.next().unwrap(), ip.next().unwrap());
    let i = names
        .split_whitespace()
        .position(|n| n == "InReceives")
        .expect("InReceives column");
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

fn ping(ns: &str, count: u32) -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "ping", "-c"])
        .arg(count.to_string())
        .args(["-i", "0.01", "-W", "2", "-n", "-q"])
        .arg(DATA_IP.to_string())
        .output()
        .expect("ping");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs the stack with or without the drop program while the switch pings
/// it 50 times; returns (ping summary, kernel InReceives delta, attached).
fn run(lab: &Lab, kernel_drop: bool) -> (String, u64, bool) {
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicBool::new(false));
    let server_ns = lab.server.clone();
    let (stop2, ready2) = (stop.clone(), ready.clone());
    let stack = std::thread::spawn(move || {
        enter_netns(&server_ns).expect("setns");
        let mut cfg = AfPacketConfig::new("eth0");
        if kernel_drop {
            cfg.kernel_drop = vec![DATA_IP];
        }
        let mut dev = AfPacket::open(&cfg).expect("open AF_PACKET");
        let attached = dev.kernel_drop().is_some();
        if let Some(e) = dev.kernel_drop_error() {
            eprintln!("kernel drop not attached: {e}");
        }
        let mac = capybara_net::Device::mac(&dev).expect("mac");
        let mut iface =
            Interface::new(InterfaceConfig::new(mac, DATA_IP, SWITCH_IP)).expect("iface");
        ready2.store(true, Ordering::Release);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        driver::run(
            &DriverConfig::default(),
            &Clock::new(),
            &mut iface,
            &mut dev,
            &mut NoTransport,
            |_, _| stop2.load(Ordering::Acquire) || std::time::Instant::now() > deadline,
        )
        .expect("driver");
        attached
    });
    while !ready.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Resolve ARP first so that only the echo requests are counted.
    ping(&lab.switch, 1);
    let before = ip_in_receives(&lab.server);
    let out = ping(&lab.switch, 50);
    let delta = ip_in_receives(&lab.server) - before;
    stop.store(true, Ordering::Release);
    let attached = stack.join().expect("stack thread");
    (out, delta, attached)
}

#[test]
fn kernel_skips_the_stack_frames_after_the_tap() {
    if let Some(why) = lab_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let lab = Lab::new("kdr");
    let (out, delta, attached) = run(&lab, false);
    assert!(out.contains("50 packets transmitted, 50 received"), "{out}");
    assert!(!attached);
    assert!(
        delta >= 50,
        "without the drop the kernel sees each echo: {delta}"
    );

    let (out, delta, attached) = run(&lab, true);
    assert!(
        attached,
        "the drop program attaches (Linux >= 6.6, CAP_BPF)"
    );
    assert!(out.contains("50 packets transmitted, 50 received"), "{out}");
    assert!(delta < 5, "with the drop the kernel skips them: {delta}");

    // Detached with the device: the kernel sees them again.
    let (out, delta, _) = run(&lab, false);
    assert!(out.contains("50 packets transmitted, 50 received"), "{out}");
    assert!(delta >= 50, "program gone with the device: {delta}");
}
