//! A restarted hostagent's migrations go to the targets the switch offers
//! now (lab, root; release binaries, or `CAPYBARA_BIN_DIR`): three servers
//! serve the echo service through the appliance; every connection on s1 is
//! migrated with no target named (`POST /v1/connections/{id}/migrate`, the
//! switch picks: s2 and s3 in turn); then s2 gets weight 0 (no new
//! connection, no migration target), s1's hostagent restarts, and every
//! connection on s1 is migrated again: all go to s3, none to s2.
//!
//! Found by an operator walkthrough of the demo: each hostagent process
//! numbered its migrations from 1, and switchd's PREPARE steering memory
//! (migration id -> target, so that retransmissions of one migration reach
//! one target) sent the restarted process's migrations to the targets the
//! previous process's migrations with the same ids went to, a weight-0
//! server included (a drain moved 46 connections onto weight-0 servers),
//! and a target that still remembered an id as finished answered from
//! memory (here, with the old hostagent, 6 of 11 migrations after the
//! restart never completed). The migration counter now starts from the
//! wall clock (`first_migration_seq_now`).
//!
//! The clock alone is not enough after a fast drain (a process that
//! averaged over 1,000 migrations a second is ahead of the clock when the
//! next one starts): the new process's counter now starts above the last
//! id switchd saw from its data address, told in REGISTER_ACK
//! (`a_restarted_hostagent_numbers_its_migrations_above_the_switchs_last_id`).

use capybara_systests::{
    appliance_lab, log_of, start_appliance, stop_appliance, switchd_status_server,
    wait_appliance_ready, EchoHolder, Lab,
};
use std::time::Duration;

const SERVERS: u32 = 3;
const API: &str = "http://127.0.0.1:18121";
/// Connections the client holds in each phase.
const N: usize = 24;

/// The held connections (`ports` of client c1) per server, from `GET
/// /v1/connections`: (server, connection id).
fn held(lab: &Lab, api: &str, token: &str, ports: &[u16]) -> Vec<(u64, String)> {
    let (code, body) = lab.api_call(api, token, "GET", "/v1/connections?limit=10000", None);
    assert_eq!(code, 200, "GET /v1/connections: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("connections JSON");
    v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| {
            c["port"] == 7 && ports.contains(&(c["client_port"].as_u64().unwrap_or(0) as u16))
        })
        .map(|c| {
            (
                c["server"].as_u64().unwrap_or(0),
                c["id"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// Opens [`N`] connections, waits until the API lists them all, migrates
/// every one on s1 with no target named, waits until none is on s1, checks
/// that they all still echo, and returns how many ended on each server.
fn migrate_off_s1(lab: &Lab, api: &str, token: &str) -> [usize; 3] {
    let mut h = EchoHolder::start(lab, N);
    let ports = h.ports.clone();
    lab.wait_for(
        "the connections in the API",
        Duration::from_secs(10),
        || held(lab, api, token, &ports).len() == N,
    );
    let on_s1: Vec<String> = held(lab, api, token, &ports)
        .into_iter()
        .filter(|(s, _)| *s == 1)
        .map(|(_, id)| id)
        .collect();
    assert!(
        on_s1.len() >= 2,
        "connections placed on s1: {}",
        on_s1.len()
    );
    for id in &on_s1 {
        let (code, body) = lab.api_call(
            api,
            token,
            "POST",
            &format!("/v1/connections/{id}/migrate"),
            Some("{}"),
        );
        assert_eq!(code, 202, "migrate {id}: {body}");
    }
    let until = std::time::Instant::now() + Duration::from_secs(15);
    while std::time::Instant::now() < until
        && held(lab, api, token, &ports).iter().any(|(s, _)| *s == 1)
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(h.round_trip(), "ok", "the connections echo after the moves");
    let mut per = [0; 3];
    for (s, id) in held(lab, api, token, &ports) {
        if on_s1.contains(&id) {
            per[s as usize - 1] += 1;
        }
    }
    assert_eq!(h.close(), "closed");
    eprintln!("the connections that were on s1, per server 15 s after their migrations were requested (s1, s2, s3): {per:?}");
    per
}

#[test]
fn a_restarted_hostagent_migrates_only_to_the_targets_offered_now() {
    let (mut lab, dir, key, config) =
        appliance_lab("restart-ids-lab", "rid", SERVERS, "127.0.0.1:18121");
    let log = dir.join("capybara.log");
    let mut app = start_appliance(&lab, &config, &log);
    let mut agents = lab.start_hostagents(&dir, &key, SERVERS);
    let token = wait_appliance_ready(&lab, &log, SERVERS, API, &dir);

    // The switch picks s2 and s3 in turn.
    let per = migrate_off_s1(&lab, API, &token);
    assert!(
        per[0] == 0 && per[1] > 0 && per[2] > 0,
        "targets picked: {per:?}"
    );

    // s2 takes nothing new: no connection, no migration.
    lab.set_weight(API, &token, 2, 0);
    lab.wait_for("switchd to apply weight 0", Duration::from_secs(2), || {
        switchd_status_server(&lab, 2).is_some_and(|s| s["weight"] == 0)
    });
    lab.kill_and_wait(agents[0].pid);
    agents[0].pid = lab.spawn_hostagent(1, &agents[0].config, &dir.join("hostagent-s1-2.log"));
    lab.wait_for("s1 to register again", Duration::from_secs(30), || {
        log_of(&log).matches("registered s1").count() >= 2
            && switchd_status_server(&lab, 1).is_some_and(|s| s["state"] == "live")
    });
    let per = migrate_off_s1(&lab, API, &token);
    assert_eq!(
        per[1], 0,
        "migrated to s2 at weight 0 after s1's hostagent restarted: {per:?}"
    );
    assert_eq!(
        per[0], 0,
        "migrations of the restarted s1 that never completed: {per:?}"
    );
    lab.assert_no_resets(2..=SERVERS);
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
}

/// The counter of the first migration `log` (a hostagent's) says it
/// numbers from ("migrations numbered from counter N"), if any.
fn numbered_from(log: &std::path::Path) -> Option<u32> {
    let text = log_of(log);
    let rest = text.split("migrations numbered from counter ").nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Restarts s1's hostagent (its `n`th process) with its migration counter
/// seeded at `seed` and waits until switchd has it live again.
fn restart_s1_seeded(
    lab: &mut Lab,
    agent: &mut capybara_systests::Hostagent,
    dir: &std::path::Path,
    log: &std::path::Path,
    n: usize,
    seed: u32,
) -> std::path::PathBuf {
    lab.kill_and_wait(agent.pid);
    let alog = dir.join(format!("hostagent-s1-{n}.log"));
    let seed = seed.to_string();
    agent.pid = lab.spawn_hostagent_env(
        1,
        &agent.config,
        &alog,
        &[("CAPYBARA_TEST_FIRST_MIGRATION_SEQ", &seed)],
    );
    lab.wait_for("s1 to register again", Duration::from_secs(30), || {
        log_of(log).matches("registered s1").count() >= n
            && switchd_status_server(lab, 1).is_some_and(|s| s["state"] == "live")
    });
    assert!(
        log_of(&alog).contains(&format!("migration counter seeded at {seed}")),
        "the hostagent did not take CAPYBARA_TEST_FIRST_MIGRATION_SEQ: {}",
        log_of(&alog)
    );
    alog
}

/// A hostagent process whose migration counter ran ahead of the clock (it
/// averaged over 1,000 migrations a second, e.g. a drain of 10,000
/// connections in 3 s) is restarted; the clock seed of the new process
/// lands on ids the previous one used. Modelled exactly with the test knob
/// `CAPYBARA_TEST_FIRST_MIGRATION_SEQ` (both processes seeded at the
/// clock plus 10^7 ms): s1's switch-picked migrations go to s2 and s3; s2
/// gets weight 0; s1's hostagent restarts with the same seed; every connection
/// on s1 is migrated again: all must go to s3, and complete. With a
/// hostagent that numbers from its seed (the clock), the switch's PREPARE
/// steering memory sent the reused ids to the targets of the previous
/// process's migrations, s2 at weight 0 included, and a target that still
/// remembered an id as finished answered from memory. Now switchd tells a
/// registering hostagent the last migration id it saw from its data
/// address (REGISTER_ACK) and the counter starts above it.
#[test]
fn a_restarted_hostagent_numbers_its_migrations_above_the_switchs_last_id() {
    let api = "http://127.0.0.1:18123";
    let (mut lab, dir, key, config) =
        appliance_lab("restart-seed-lab", "rsd", SERVERS, "127.0.0.1:18123");
    let log = dir.join("capybara.log");
    let mut app = start_appliance(&lab, &config, &log);
    let mut agents = lab.start_hostagents(&dir, &key, SERVERS);
    let token = wait_appliance_ready(&lab, &log, SERVERS, api, &dir);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let seed = (now_ms + 10_000_000) as u32;
    restart_s1_seeded(&mut lab, &mut agents[0], &dir, &log, 2, seed);

    // The switch picks s2 and s3 in turn.
    let per = migrate_off_s1(&lab, api, &token);
    assert!(
        per[0] == 0 && per[1] > 0 && per[2] > 0,
        "targets picked: {per:?}"
    );

    lab.set_weight(api, &token, 2, 0);
    lab.wait_for("switchd to apply weight 0", Duration::from_secs(2), || {
        switchd_status_server(&lab, 2).is_some_and(|s| s["weight"] == 0)
    });
    let alog = restart_s1_seeded(&mut lab, &mut agents[0], &dir, &log, 3, seed);
    let per = migrate_off_s1(&lab, api, &token);
    assert_eq!(
        per[1], 0,
        "migrated to s2 at weight 0 after s1's hostagent restarted at the seed of the previous process: {per:?}"
    );
    assert_eq!(
        per[0], 0,
        "migrations of the restarted s1 that never completed: {per:?}"
    );
    let from =
        numbered_from(&alog).expect("the hostagent logs where its migrations are numbered from");
    assert!(
        (from.wrapping_sub(seed) as i32) > 0,
        "the restarted process numbers from {from}, not above the previous one's ids (from {seed})"
    );
    lab.assert_no_resets(2..=SERVERS);
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
}

/// `docs/OPERATIONS.md` "Removing a server", then putting it back: drain
/// s3, stop its hostagent, `DELETE /v1/servers/3`, start its hostagent
/// again. It registers as a server put back: switchd places new
/// connections on it, as the API (`active`) says. It used to keep the
/// drain the deleted server had (out of placement, `/status` `draining`)
/// until an undrain.
#[test]
fn a_deleted_server_started_again_is_placed_again() {
    let (mut lab, dir, key, config) =
        appliance_lab("restart-deleted-lab", "rdl", SERVERS, "127.0.0.1:18122");
    let api = "http://127.0.0.1:18122";
    let log = dir.join("capybara.log");
    let mut app = start_appliance(&lab, &config, &log);
    let mut agents = lab.start_hostagents(&dir, &key, SERVERS);
    let token = wait_appliance_ready(&lab, &log, SERVERS, api, &dir);

    lab.start_drain(api, &token, 3, 30);
    lab.wait_for(
        "the drain of s3 to complete",
        Duration::from_secs(20),
        || {
            let (_, body) = lab.api_call(api, &token, "GET", "/v1/servers/3/drain", None);
            body.contains("\"completed\"")
        },
    );
    lab.kill_and_wait(agents[2].pid);
    lab.wait_for("s3 dead", Duration::from_secs(10), || {
        switchd_status_server(&lab, 3).is_some_and(|s| s["state"] == "dead")
    });
    let (code, body) = lab.api_call(api, &token, "DELETE", "/v1/servers/3", None);
    assert_eq!(code, 204, "DELETE /v1/servers/3: {body}");
    // switchd reads the store every 250 ms.
    std::thread::sleep(Duration::from_secs(1));
    agents[2].pid = lab.spawn_hostagent(3, &agents[2].config, &dir.join("hostagent-s3-2.log"));
    lab.wait_for("s3 to register again", Duration::from_secs(30), || {
        log_of(&log).matches("registered s3").count() >= 2
    });
    std::thread::sleep(Duration::from_secs(1));
    let (state, _) = lab.api_server(api, &token, 3);
    assert_eq!(state, "active", "the API");
    let st = switchd_status_server(&lab, 3).unwrap();
    assert_eq!(st["state"], "live", "switchd: {st}");
    let c = capybara_systests::place_echo_connections(&lab, api, &token, N, SERVERS);
    assert!(c[2] > 0, "new connections on s3: {c:?}");
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
}
