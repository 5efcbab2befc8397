//! `capybara --check CONFIG` on configs an operator gets wrong: status 2
//! and one line on stderr naming the line of the file (errors in
//! `[switchd]` too, which named only their field) and, for a known slip,
//! the fix. No network namespaces: the check reads files only.

use std::process::Command;

/// Runs `capybara --check FILE` on `text`: (status, stderr, the file).
fn check(name: &str, text: &str) -> (i32, String, String) {
    let dir = std::env::temp_dir().join(format!("capybara-check-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("capybara.toml");
    std::fs::write(&cfg, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_capybara"))
        .arg("--check")
        .arg(&cfg)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        cfg.display().to_string(),
    )
}

const SWITCHD: &str = "[switchd]\ncontrol_listen = \"198.18.1.1:7692\"\n\
                       key_file = \"/nonexistent/deployment.key\"\n\
                       [[switchd.interfaces]]\nname = \"cl1\"\nrole = \"client\"\n\
                       [[switchd.interfaces]]\nname = \"sv1\"\nrole = \"server\"\n\
                       [[switchd.services]]\nname = \"web\"\nvip = \"198.18.100.1:80\"\npool = []\n";

#[test]
fn switchd_section_errors_name_their_line() {
    let (code, err, file) = check(
        "vip",
        &SWITCHD.replace("vip = \"198.18.100.1:80\"", "vip = 80"),
    );
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        err,
        format!(
            "capybara: config {file}: in [switchd]: `switchd.services[0].vip`: \
             invalid type: integer `80`, expected a string (line 12: vip = 80)\n"
        )
    );
}

#[test]
fn a_table_written_for_a_list_names_the_fix() {
    let (code, err, file) = check(
        "services",
        &SWITCHD.replace("[[switchd.services]]", "[switchd.services]"),
    );
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        err,
        format!(
            "capybara: config {file}: in [switchd]: `switchd.services`: invalid type: table, \
             expected an array (line 10: [switchd.services]); `switchd.services` is a list: \
             write each entry as a [[switchd.services]] table, not one [switchd.services]\n"
        )
    );
}
