//! `switchd --check` with a deployment key file group or others may read
//! (0644): still valid (existing deployments keep running), but one line
//! on stderr names the file, its mode and `chmod 600`. A 0600 key says
//! nothing.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

#[test]
fn check_warns_of_a_key_file_others_may_read() {
    let dir = std::env::temp_dir().join(format!("capybara-switchd-keymode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("deployment.key");
    std::fs::write(&key, "00112233445566778899aabbccddeeff\n").unwrap();
    let cfg = dir.join("switchd.toml");
    std::fs::write(
        &cfg,
        format!(
            "control_listen = \"198.18.1.1:7692\"\nkey_file = {:?}\n\
             [[interfaces]]\nname = \"cl1\"\nrole = \"client\"\n\
             [[interfaces]]\nname = \"sv1\"\nrole = \"server\"\n\
             [[services]]\nname = \"web\"\nvip = \"198.18.100.1:80\"\npool = [{{ server = 1 }}]\n",
            key.display().to_string()
        ),
    )
    .unwrap();
    let check = |mode: u32| {
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_switchd"))
            .arg("--config")
            .arg(&cfg)
            .arg("--check")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "mode {mode:o}: {err}");
        err
    };
    let err = check(0o644);
    let line = format!(
        "switchd: warning: deployment key file {} is readable by group/others (mode 0644)",
        key.display()
    );
    assert!(err.contains(&line), "{err}");
    assert!(
        err.contains(&format!("chmod 600 {}", key.display())),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(check(0o600), "");
    std::fs::remove_dir_all(&dir).unwrap();
}
