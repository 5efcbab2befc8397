//! A server the switch declared dead comes back by itself (root; release
//! binaries, or `CAPYBARA_BIN_DIR`): switchd and one hostagent in the lab;
//! the hostagent is frozen (SIGSTOP) past the switch's `dead_after_ms`, the
//! switch declares it dead and answers its next heartbeat "register
//! first"; on waking the hostagent registers again instead of
//! heartbeating into the void, and takes new connections. (Before, a
//! server starved of CPU for a second stayed out of the pool until it was
//! restarted.)

use capybara_systests::{
    bin, deployment_key, disable_policies, hostagent_migrating_config, output_dir, switchd_config,
    EchoHolder, Lab,
};
use std::time::Duration;

#[test]
fn a_server_declared_dead_registers_again_when_it_wakes() {
    let dir = output_dir("server_liveness");
    let mut lab = Lab::up("sl", 1);
    let key = deployment_key(&dir);
    let sw = switchd_config(&dir, 1, &key);
    let swlog = dir.join("switchd.log");
    lab.spawn_logged(
        "sw",
        bin("switchd"),
        &["--config", sw.to_str().unwrap()],
        &swlog,
    );
    let cfg = hostagent_migrating_config(&dir, 1, &key, None);
    disable_policies(&cfg);
    let pid = lab.spawn_logged(
        "s1",
        bin("hostagent"),
        &["--config", cfg.to_str().unwrap()],
        &dir.join("hostagent-s1.log"),
    );
    let log = || std::fs::read_to_string(&swlog).unwrap_or_default();
    let registrations = || log().matches("switchd: registered s1").count();
    lab.wait_for("s1 to register", Duration::from_secs(30), || {
        registrations() >= 1
    });
    let mut before = EchoHolder::start(&lab, 2);
    assert_eq!(before.round_trip(), "ok");

    // SAFETY: signalling the hostagent this test started (`ip netns exec`
    // execs it, so the pid is the hostagent's).
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lab.wait_for(
            "the switch to declare s1 dead",
            Duration::from_secs(15),
            || log().contains("missed heartbeats"),
        )
    }));
    // SAFETY: as above.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    if let Err(e) = waited {
        std::panic::resume_unwind(e);
    }
    lab.wait_for("s1 to register again", Duration::from_secs(15), || {
        registrations() >= 2
    });
    let ha = std::fs::read_to_string(dir.join("hostagent-s1.log")).unwrap_or_default();
    assert!(ha.contains("registering again"), "{ha}");
    // New connections reach it again.
    let mut after = EchoHolder::start(&lab, 2);
    assert_eq!(after.round_trip(), "ok");
    drop(before);
}
