//! Real network: the Interface on the AF_PACKET backend answers Linux's ping
//! and ARP for a data address the kernel does not own.
//! Needs root (network namespaces); skipped with a message otherwise.

mod common;

use capybara_net::device::af_packet::{AfPacket, AfPacketConfig};
use capybara_net::driver::{self, Clock, DriverConfig};
use capybara_net::{Device, Interface, InterfaceConfig, NoTransport};
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn linux_ping_gets_answers_from_af_packet_stack() {
    if let Some(why) = lab_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let lab = Lab::new("afp");
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicBool::new(false));
    let server_ns = lab.server.clone();
    let (stop2, ready2) = (stop.clone(), ready.clone());
    let stack = std::thread::spawn(move || {
        enter_netns(&server_ns).expect("setns");
        let mut dev = AfPacket::open(&AfPacketConfig::new("eth0")).expect("open AF_PACKET");
        let mac = dev.mac().expect("mac");
        let mut iface =
            Interface::new(InterfaceConfig::new(mac, DATA_IP, SWITCH_IP)).expect("iface");
        let clock = Clock::new();
        ready2.store(true, Ordering::Release);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        driver::run(
            &DriverConfig::default(),
            &clock,
            &mut iface,
            &mut dev,
            &mut NoTransport,
            |_, _| stop2.load(Ordering::Acquire) || std::time::Instant::now() > deadline,
        )
        .expect("driver");
        (
            iface.counters().clone(),
            iface.neighbor(SWITCH_IP),
            mac,
            dev.stats(),
        )
    });
    for _ in 0..200 {
        if ready.load(Ordering::Acquire) {
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
        ])
        .arg(DATA_IP.to_string())
        .output()
        .expect("ping");
    let ping_out = format!(
        "{}{}",
        String::from_utf8_lossy(&ping.stdout),
        String::from_utf8_lossy(&ping.stderr)
    );
    // The switch learned our MAC from our own request for the gateway; make
    // it resolve us from scratch so the ARP reply path runs on a real kernel.
    must(&["ip", "-n", &lab.switch, "neigh", "flush", "dev", "eth0"]);
    let ping2 = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.switch,
            "ping",
            "-c",
            "3",
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
    let ping2_out = String::from_utf8_lossy(&ping2.stdout).into_owned();
    let neigh = must(&[
        "ip",
        "-n",
        &lab.switch,
        "neigh",
        "show",
        &DATA_IP.to_string(),
    ]);
    stop.store(true, Ordering::Release);
    let (counters, gw_mac, mac, stats) = stack.join().expect("stack thread");
    eprintln!("{ping_out}\nneigh: {neigh}\ncounters: {counters:?}\nring: {stats:?}");

    assert!(
        ping_out.contains("20 packets transmitted, 20 received"),
        "ping: {ping_out}"
    );
    assert!(
        neigh.contains(&mac.to_string()),
        "switch learned our MAC: {neigh}"
    );
    assert!(
        ping2_out.contains("3 packets transmitted, 3 received"),
        "ping after flush: {ping2_out}"
    );
    assert!(
        counters.arp_requests_rx >= 1 && counters.arp_replies_tx >= 1,
        "{counters:?}"
    );
    assert_eq!(counters.icmp_echo_replies_tx, 23);
    assert_eq!(counters.total_drops(), 0, "{counters:?}");
    assert_eq!(
        gw_mac.map(|m| m.to_string()),
        Some(lab.mac_of(&lab.switch)),
        "gateway resolved"
    );
    assert_eq!(
        counters.tx_frames,
        counters.icmp_echo_replies_tx + counters.arp_replies_tx + counters.arp_requests_tx
    );
}
