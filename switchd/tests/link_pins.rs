//! Pinned XDP links and their locks, on real programs and interfaces
//! (root; a throw-away network namespace, pins in a directory unique to
//! the test under /sys/fs/bpf, removed on every exit path):
//!
//! - a pinned link outlives the data plane that made it (the program stays
//!   attached), a second data plane replaces its program in place
//!   (`Attached::Replaced`), and `detach_all` leaves no program and no pin;
//! - a pin whose device is gone is stale: removed, and a new link made;
//! - the owner lock is exclusive (a second `LinkPins` of the same
//!   directory cannot take it until the first lets go, as a standby cannot
//!   while the active lives), the standby mark is seen by the owner, and
//!   `remove_if_unused` removes the directories once nobody uses them.

use capybara_switchd::bpf::{on_bpffs, Attached, BpfDataPlane, BpfOptions, LinkPins};
use capybara_switchd::netns::TestNetns;
use std::path::PathBuf;

/// Removes the test's pin root, also when the test panics.
struct PinRoot(PathBuf);

impl PinRoot {
    fn new(tag: &str) -> PinRoot {
        PinRoot(PathBuf::from(format!(
            "/sys/fs/bpf/capy-test-{tag}-{}",
            std::process::id()
        )))
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn runnable() -> bool {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root");
        return false;
    }
    assert!(
        on_bpffs(std::path::Path::new("/sys/fs/bpf")),
        "/sys/fs/bpf is not bpffs"
    );
    true
}

#[test]
fn a_pinned_link_outlives_its_data_plane_and_is_replaced_in_place() {
    if !runnable() {
        return;
    }
    let root = PinRoot::new("replace");
    let ns = TestNetns::enter(&["pt0"]).expect("netns");
    let idx = ns.ifindex("pt0").unwrap();
    let mut pins = LinkPins::open(&root.0, "test").expect("pin dir");
    assert!(pins.try_own().unwrap());
    let pin = pins.link_path(idx);

    let mut first = BpfDataPlane::load(BpfOptions::small()).unwrap();
    assert_eq!(
        first.attach_pinned(idx, &pin).unwrap(),
        Attached::New { pinned: true }
    );
    let id1 = first.attached_prog_id(idx).unwrap();
    assert_ne!(id1, 0);
    // The process "dies": the links are let go, the pin keeps the program.
    assert_eq!(first.release_links(), 1);
    drop(first);
    let second = BpfDataPlane::load(BpfOptions::small()).unwrap();
    assert_eq!(
        second.attached_prog_id(idx).unwrap(),
        id1,
        "the pinned program stays attached after its data plane is gone"
    );
    let mut second = second;
    match second.attach_pinned(idx, &pin).unwrap() {
        Attached::Replaced { old_prog } => assert_eq!(old_prog, id1),
        other => panic!("expected the pinned link replaced in place, got {other:?}"),
    }
    let id2 = second.attached_prog_id(idx).unwrap();
    assert!(
        id2 != 0 && id2 != id1,
        "now runs the second program ({id1} -> {id2})"
    );
    assert!(pin.exists());

    // A clean stop: nothing attached, nothing pinned.
    second.detach_all();
    assert_eq!(second.attached_prog_id(idx).unwrap(), 0);
    assert!(!pin.exists());
    pins.disown();
    pins.remove_if_unused();
    assert!(!root.0.exists(), "directories left: {}", root.0.display());
    drop(ns);
}

#[test]
fn a_pin_whose_device_is_gone_is_replaced_by_a_new_link() {
    if !runnable() {
        return;
    }
    let root = PinRoot::new("stale");
    let ns = TestNetns::enter(&["ps0", "ps1"]).expect("netns");
    let (gone, live) = (ns.ifindex("ps0").unwrap(), ns.ifindex("ps1").unwrap());
    let mut pins = LinkPins::open(&root.0, "test").expect("pin dir");
    assert!(pins.try_own().unwrap());
    let mut dp = BpfDataPlane::load(BpfOptions::small()).unwrap();
    dp.attach_pinned(gone, &pins.link_path(gone)).unwrap();
    dp.release_links();
    let out = std::process::Command::new("ip")
        .args(["-n", &ns.name, "link", "del", "ps0"])
        .output()
        .unwrap();
    assert!(out.status.success());
    // The stale pin is now at the live interface's path, as after an
    // interface was re-created with another index.
    std::fs::rename(pins.link_path(gone), pins.link_path(live)).unwrap();
    assert_eq!(
        dp.attach_pinned(live, &pins.link_path(live)).unwrap(),
        Attached::New { pinned: true }
    );
    assert_ne!(dp.attached_prog_id(live).unwrap(), 0);
    dp.detach_all();
    assert_eq!(dp.attached_prog_id(live).unwrap(), 0);
    drop(ns);
}

#[test]
fn the_owner_lock_fences_and_the_standby_mark_is_seen() {
    if !runnable() {
        return;
    }
    let root = PinRoot::new("locks");
    let mut active = LinkPins::open(&root.0, "e1").expect("pin dir");
    let mut standby = LinkPins::open(&root.0, "e1").expect("pin dir");
    let mut other = LinkPins::open(&root.0, "e2").expect("another election");
    assert_eq!(active.dir(), standby.dir());
    assert_ne!(active.dir(), other.dir());
    assert!(active.try_own().unwrap());
    assert!(
        !standby.try_own().unwrap(),
        "a live owner is never displaced"
    );
    assert!(
        !standby
            .own_within(std::time::Duration::from_millis(30), || false)
            .unwrap(),
        "nor after waiting"
    );
    assert!(other.try_own().unwrap(), "elections are independent");
    assert!(!active.standby_waiting());
    standby.stand_by().unwrap();
    assert!(active.standby_waiting(), "the owner sees the standby");
    active.remove_if_unused();
    assert!(active.dir().exists(), "kept while a standby waits");
    // The owner goes (its process dies: the kernel drops the lock). Polled,
    // as a standby does: a child that another test thread forks holds a
    // copy of the lock's descriptor until it execs.
    active.disown();
    assert!(
        standby
            .own_within(std::time::Duration::from_secs(10), || false)
            .unwrap(),
        "the standby gets the lock"
    );
    standby.end_standby();
    standby.disown();
    standby.remove_if_unused();
    assert!(!standby.dir().exists());
    other.disown();
    other.remove_if_unused();
    assert!(!root.0.exists(), "directories left: {}", root.0.display());
}
