//! Real network on the DPDK backend: DPDK's net_af_packet vdev on the
//! server's eth0 (no hugepages, no PCI), Linux pings the data address.
//! Built only with `--features dpdk`; needs root.
#![cfg(feature = "dpdk")]

mod common;

use capybara_net::device::dpdk::{Dpdk, DpdkConfig};
use capybara_net::driver::{self, Clock, DriverConfig};
use capybara_net::{Device, Interface, InterfaceConfig, NoTransport, PollMode};
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn linux_ping_gets_answers_from_dpdk_stack() {
    if let Some(why) = lab_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let lab = Lab::new("dpdk");
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicBool::new(false));
    let server_ns = lab.server.clone();
    let (stop2, ready2) = (stop.clone(), ready.clone());
    let stack = std::thread::spawn(move || {
        enter_netns(&server_ns).expect("setns");
        let mut dev = Dpdk::open(&DpdkConfig::lab("eth0")).expect("open DPDK port");
        let mac = dev.mac().expect("mac");
        let mut iface =
            Interface::new(InterfaceConfig::new(mac, DATA_IP, SWITCH_IP)).expect("iface");
        let clock = Clock::new();
        ready2.store(true, Ordering::Release);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let cfg = DriverConfig {
            mode: PollMode::BusyPoll,
            ..Default::default()
        };
        driver::run(
            &cfg,
            &clock,
            &mut iface,
            &mut dev,
            &mut NoTransport,
            |_, _| stop2.load(Ordering::Acquire) || std::time::Instant::now() > deadline,
        )
        .expect("driver");
        (iface.counters().clone(), mac)
    });
    for _ in 0..500 {
        if ready.load(Ordering::Acquire) || stack.is_finished() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let ping = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.switch,
            "ping",
            "-c",
            "20",
            "-i",
            "0.01",
            "-W",
            "2",
            "-n",
            "-q",
        ])
        .arg(DATA_IP.to_string())
        .output()
        .expect("ping");
    let ping_out = String::from_utf8_lossy(&ping.stdout).into_owned();
    let neigh = must(&[
        "ip",
        "-n",
        &lab.switch,
        "neigh",
        "show",
        &DATA_IP.to_string(),
    ]);
    stop.store(true, Ordering::Release);
    let (counters, mac) = stack.join().expect("stack thread");
    eprintln!("{ping_out}\nneigh: {neigh}\ncounters: {counters:?}");
    assert!(
        ping_out.contains("20 packets transmitted, 20 received"),
        "ping: {ping_out}"
    );
    assert!(
        neigh.contains(&mac.to_string()),
        "switch learned our MAC: {neigh}"
    );
    assert_eq!(counters.icmp_echo_replies_tx, 20);
}
