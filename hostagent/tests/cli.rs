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
