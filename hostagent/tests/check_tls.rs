//! `hostagent --check` reads a sidecar's `tls_cert` and `tls_key` as a start
//! does: a file that cannot be loaded fails the check (status 2) with one
//! line naming the field, the file and the reason. Before, the check said
//! "configuration valid" and only the start failed.

use std::process::Command;

fn check(dir: &std::path::Path, cert: &str, key: &str) -> (i32, String) {
    let cfg = dir.join("hostagent.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"s1\"\n[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.11\"\n\
             gateway = \"198.18.1.1\"\n[[service]]\nlisten = \"198.18.100.1:80\"\napp = \"http\"\n\
             [[service]]\nlisten = \"198.18.100.1:443\"\napp = \"sidecar\"\n\
             backend = \"127.0.0.1:8081\"\nprotocol = \"http1\"\ntls_cert = {cert:?}\ntls_key = {key:?}\n"
        ),
    )
    .expect("write config");
    let out = Command::new(env!("CARGO_BIN_EXE_hostagent"))
        .args(["--config", cfg.to_str().unwrap(), "--check"])
        .output()
        .expect("run hostagent --check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn check_refuses_tls_files_that_cannot_be_loaded() {
    let dir = std::env::temp_dir().join(format!("capybara-check-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not a pem\n").unwrap();
    let junk = junk.to_str().unwrap().to_string();
    let missing = dir.join("missing.pem").to_str().unwrap().to_string();

    let (code, text) = check(&dir, &junk, &missing);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains(&format!("service[1].tls_key = {missing:?}"))
            && text.contains("No such file"),
        "{text}"
    );
    assert_eq!(text.lines().count(), 1, "one line: {text}");

    let (code, text) = check(&dir, &junk, &junk);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("service[1].tls_cert = ") && text.contains("no CERTIFICATE block"),
        "{text}"
    );

    // A directory where the key should be.
    let (code, text) = check(&dir, &junk, dir.to_str().unwrap());
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("service[1].tls_"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
