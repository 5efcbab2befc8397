//! `capybara ctl COMMAND --help`: every command prints its own usage
//! (arguments, flags, an example) and exits 0, without an API; a usage
//! error of a command points at that command's help.

use std::process::Command;

/// Runs `capybara-ctl` against an API nobody answers (help never calls it).
fn ctl(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_capybara-ctl"))
        .args(args)
        .env("CAPYBARA_API", "http://127.0.0.1:9")
        .env_remove("CAPYBARA_TOKEN")
        .output()
        .expect("run capybara-ctl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// (command words, what its help must name besides the usage line).
const COMMANDS: &[(&str, &[&str])] = &[
    ("servers", &[]),
    (
        "drain",
        &[
            "SERVER",
            "--deadline DURATION",
            "--force",
            "--wait",
            "exit status 3",
        ],
    ),
    ("undrain", &["SERVER"]),
    ("weight", &["SERVER", "WEIGHT", "0 to 65535"]),
    (
        "connections",
        &["--server SERVER", "--service NAME", "--limit N"],
    ),
    ("migrate", &["CONN", "--target SERVER"]),
    ("policy", &["policy get", "policy set"]),
    ("policy get", &[]),
    ("policy set", &["KEY=VALUE"]),
    ("migrations", &["--limit N", "--follow", "--for DURATION"]),
    ("audit", &["--limit N", "newest"]),
    ("services", &["retiring"]),
    ("service", &["service add", "service set", "service delete"]),
    ("service add", &["NAME", "VIP:PORT", "--pool"]),
    ("service set", &["NAME", "VIP:PORT", "--pool"]),
    ("service delete", &["NAME"]),
    ("ready", &[]),
];

#[test]
fn every_command_prints_its_own_help() {
    for (cmd, names) in COMMANDS {
        for flag in ["--help", "-h"] {
            let mut args: Vec<&str> = cmd.split(' ').collect();
            args.push(flag);
            let (code, out, err) = ctl(&args);
            assert_eq!(code, 0, "{args:?}: {err}");
            assert_eq!(err, "", "{args:?}");
            assert!(
                out.starts_with(&format!("usage: capybara ctl {cmd}")),
                "{args:?}: {out}"
            );
            // Not the global usage: no list of every command.
            assert!(!out.contains("commands:"), "{args:?}: {out}");
            assert!(
                out.contains(&format!("example:\n  capybara ctl {cmd}"))
                    || out.contains(&format!(
                        "examples:\n  capybara ctl {}",
                        cmd.split(' ').next().unwrap()
                    )),
                "{args:?}: no example: {out}"
            );
            assert!(
                out.contains("--api URL") && out.contains("--token TOKEN"),
                "{args:?}: {out}"
            );
            for n in *names {
                assert!(out.contains(n), "{args:?}: {n} missing: {out}");
            }
        }
    }
}

#[test]
fn help_wins_over_arguments_and_help_command_works() {
    // With the command's arguments (even incomplete or wrong ones) and
    // global flags around it, --help still prints the command's help.
    for args in [
        vec!["drain", "3", "--help"],
        vec!["--api", "http://x:1", "drain", "--help"],
        vec!["drain", "--forse", "-h"],
        vec!["help", "drain"],
    ] {
        let (code, out, err) = ctl(&args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(
            out.starts_with("usage: capybara ctl drain SERVER"),
            "{args:?}: {out}"
        );
    }
    let (code, out, _) = ctl(&["service", "add", "api", "198.18.100.2:80", "--help"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("usage: capybara ctl service add NAME VIP:PORT"),
        "{out}"
    );
    // The global usage stays where it was, and names the per-command help.
    for args in [vec!["--help"], vec!["-h"], vec!["help"]] {
        let (code, out, _) = ctl(&args);
        assert_eq!(code, 0, "{args:?}");
        assert!(
            out.starts_with("usage: capybara ctl [--api URL]")
                && out.contains("commands:")
                && out.contains("capybara ctl COMMAND --help"),
            "{args:?}: {out}"
        );
    }
    // An unknown command is a usage error, help or not.
    for args in [vec!["frob", "--help"], vec!["frob"]] {
        let (code, _, err) = ctl(&args);
        assert_eq!(code, 2, "{args:?}");
        assert!(err.contains("unknown command \"frob\""), "{args:?}: {err}");
    }
}

#[test]
fn usage_errors_point_at_the_command_help() {
    for (args, want, cmd) in [
        (
            vec!["drain", "1", "--forse"],
            "unknown flag --forse for `drain` (it takes --deadline, --force, --wait)",
            "drain",
        ),
        (
            vec!["servers", "--wait"],
            "unknown flag --wait for `servers`",
            "servers",
        ),
        (
            vec!["weight", "1"],
            "`weight` takes SERVER and WEIGHT (or SERVER --clear), got 1 argument: 1\n",
            "weight",
        ),
        (
            vec!["drain", "1", "s2"],
            "`drain` takes one SERVER, got 2 arguments: 1 s2\n",
            "drain",
        ),
        (
            vec!["service", "add", "api", "nowhere"],
            "VIP:PORT must be an IPv4 address",
            "service add",
        ),
        (
            vec!["servers", "extra"],
            "`servers` takes no arguments, got 1 argument: extra\n",
            "servers",
        ),
        (
            vec!["migrations", "--for", "5s"],
            "--for goes with --follow",
            "migrations",
        ),
        // A flag's value left out at the end of the line: named, with the
        // command's usage (it listed every command before).
        (
            vec!["drain", "1", "--deadline"],
            "error: --deadline needs a value\n",
            "drain",
        ),
        (
            vec!["connections", "--limit"],
            "error: --limit needs a value\n",
            "connections",
        ),
        (
            vec!["servers", "--limit"],
            "unknown flag --limit for `servers` (it takes no flags)",
            "servers",
        ),
        // A flag given twice: the last one was taken, silently.
        (
            vec!["drain", "1", "--deadline", "5", "--deadline", "6"],
            "error: --deadline given twice (5, then 6): give it once\n",
            "drain",
        ),
        (
            vec!["drain", "1", "--force", "--wait", "--force"],
            "error: --force given twice: give it once\n",
            "drain",
        ),
        (
            vec!["connections", "--limit=5", "--server", "1", "--limit", "6"],
            "error: --limit given twice (5, then 6): give it once\n",
            "connections",
        ),
        (
            vec![
                "service",
                "add",
                "api",
                "198.18.100.2:80",
                "--pool",
                "1",
                "--pool=2",
            ],
            "error: --pool given twice (1, then 2): give it once\n",
            "service add",
        ),
        (
            vec!["--token", "a", "servers", "--token", "b"],
            "error: --token given twice (a, then b): give it once\n",
            "servers",
        ),
    ] {
        let (code, out, err) = ctl(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(out, "", "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(
            err.contains(&format!("\nusage: capybara ctl {cmd}"))
                && err.contains(&format!("`capybara ctl {cmd} --help`")),
            "{args:?}: {err}"
        );
        // The command's usage line, not the list of every command.
        assert!(!err.contains("commands:"), "{args:?}: {err}");
    }
}
