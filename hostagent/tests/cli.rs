//! `hostagent`'s command line: `--help` explains every flag; a flag given
//! without its value is a usage error (status 2) naming the flag, not
//! silently ignored (`--metrics` last used to run without metrics).

use std::process::Command;

fn hostagent(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hostagent"))
        .args(args)
        .output()
        .expect("run hostagent");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn help_explains_every_flag() {
    let (code, out, _) = hostagent(&["--help"]);
    assert_eq!(code, 0);
    for flag in [
        "--config FILE",
        "--check",
        "--metrics ADDR:PORT",
        "exit status",
    ] {
        assert!(out.contains(flag), "{flag}: {out}");
    }
}

#[test]
fn a_flag_without_its_value_is_refused() {
    let dir = std::env::temp_dir().join(format!("capybara-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("hostagent.toml");
    std::fs::write(
        &cfg,
        "name = \"s1\"\n[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.11\"\n\
         gateway = \"198.18.1.1\"\n[[service]]\nlisten = \"198.18.100.1:80\"\napp = \"http\"\n",
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let (code, out, err) = hostagent(&["--config", cfg, "--check"]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = hostagent(&["--config", cfg, "--check", "--metrics"]);
    assert_eq!(
        (code, err.as_str()),
        (2, "hostagent: --metrics needs ADDR:PORT (try --help)\n")
    );
    let (code, _, err) = hostagent(&["--config", "--check"]);
    assert_eq!(
        (code, err.as_str()),
        (2, "hostagent: --config needs FILE (try --help)\n")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--check` with a deployment key file group or others may read (0644):
/// still valid, but one stderr line names the file, its mode and `chmod
/// 600` (the daemon logs the same at start). A 0600 key says nothing.
#[test]
fn check_warns_of_a_key_file_others_may_read() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("capybara-cli-keymode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("deployment.key");
    std::fs::write(&key, "00112233445566778899aabbccddeeff\n").unwrap();
    let cfg = dir.join("hostagent.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"s1\"\n[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.11\"\n\
             gateway = \"198.18.1.1\"\n[[service]]\nlisten = \"198.18.100.1:80\"\napp = \"http\"\n\
             [migration]\nswitch = \"198.18.1.1\"\nkey_file = {:?}\n",
            key.display().to_string()
        ),
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let set = |m| std::fs::set_permissions(&key, std::fs::Permissions::from_mode(m)).unwrap();
    set(0o644);
    let (code, out, err) = hostagent(&["--config", cfg, "--check"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        err,
        format!(
            "hostagent: warning: deployment key file {k} is readable by group/others (mode 0644): \
             anyone who reads it can forge migrations; run chmod 600 {k}\n",
            k = key.display()
        )
    );
    set(0o600);
    let (code, out, err) = hostagent(&["--config", cfg, "--check"]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--check` on a config an operator gets wrong: status 2 and one line
/// naming the line of the file and the fix, in the words of the key's
/// validation (`control.server_id`: 1 to 4294967295, 0 is reserved).
#[test]
fn check_names_the_fix_and_the_valid_range() {
    let dir = std::env::temp_dir().join(format!("capybara-cli-msgs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("hostagent.toml");
    let cfg_s = cfg.to_str().unwrap().to_string();
    let run = |text: &str| {
        std::fs::write(&cfg, text).unwrap();
        let (code, _, err) = hostagent(&["--config", &cfg_s, "--check"]);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    };
    const HEAD: &str = "name = \"s1\"\n[interface]\nname = \"eth0\"\n[stack]\n\
                        address = \"198.18.2.11\"\ngateway = \"198.18.1.1\"\n";
    let err = run(&format!(
        "{HEAD}[service]\nlisten = \"198.18.100.1:80\"\napp = \"http\"\n"
    ));
    assert!(
        err.ends_with(
            ": invalid type: table, expected an array (line 7: [service]); \
             `service` is a list: write each entry as a [[service]] table, not one [service]\n"
        ),
        "{err}"
    );
    let control = |id: &str| {
        format!(
            "{HEAD}[[service]]\nlisten = \"198.18.100.1:80\"\napp = \"http\"\n\
             [migration]\nswitch = \"198.18.1.1\"\nkey = \"00112233445566778899aabbccddeeff\"\n\
             [control]\nswitch = \"198.18.1.1:7692\"\nmanagement = \"198.18.1.11\"\nserver_id = {id}\n"
        )
    };
    let err = run(&control("\"1\""));
    assert!(
        err.ends_with(
            ": invalid type: string \"1\", expected an integer from 1 to 4294967295 \
             (line 16: server_id = \"1\")\n"
        ),
        "{err}"
    );
    let err = run(&control("0"));
    assert!(
        err.ends_with(
            ": control.server_id = 0: must be 1 to 4294967295 (0 is reserved; switchd refuses it)\n"
        ),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
