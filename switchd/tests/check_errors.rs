//! `switchd --check` on configs an operator gets wrong: status 2 and one
//! line on stderr naming the line of the file and the fix.

use std::process::Command;

/// Runs `switchd --config FILE --check` on `text`: (status, stderr).
fn check(name: &str, text: &str) -> (i32, String) {
    let dir = std::env::temp_dir().join(format!(
        "capybara-switchd-check-{name}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("switchd.toml");
    std::fs::write(&cfg, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_switchd"))
        .arg("--config")
        .arg(&cfg)
        .arg("--check")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const HEAD: &str = "control_listen = \"198.18.1.1:7692\"\nkey_file = \"/nonexistent/k\"\n\
                    [[interfaces]]\nname = \"cl1\"\nrole = \"client\"\n\
                    [[interfaces]]\nname = \"sv1\"\nrole = \"server\"\n";

/// `[services]` where `[[services]]` is meant.
#[test]
fn a_table_written_for_a_list_names_the_fix() {
    let (code, err) = check(
        "services",
        &format!("{HEAD}[services]\nname = \"web\"\nvip = \"198.18.100.1:80\"\n"),
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.starts_with("switchd: config ")
            && err.ends_with(
                ": invalid type: table, expected an array (line 9: [services]); \
                 `services` is a list: write each entry as a [[services]] table, not one [services]\n"
            ),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// A pool member's server id of the wrong type names the range that
/// validation holds it to (0 is refused: ids start at 1).
#[test]
fn a_server_id_type_error_names_the_valid_range() {
    let service = |pool: &str| {
        format!("{HEAD}[[services]]\nname = \"web\"\nvip = \"198.18.100.1:80\"\npool = {pool}\n")
    };
    let (code, err) = check("type", &service("[{ server = \"1\" }]"));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("invalid type: string \"1\", expected an integer from 1 to 4294967295 (line 12: pool = [{ server = \"1\" }])"),
        "{err}"
    );
    let (code, err) = check("zero", &service("[{ server = 0 }]"));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("`services[0].pool[0].server` = 0: must be 1..=4294967295"),
        "{err}"
    );
}
