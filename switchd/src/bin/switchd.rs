//! The switchd daemon (see `capybara_switchd::daemon`).
//!
//! ```text
//! switchd --config FILE            run (as root, in the switch's namespace)
//! switchd --config FILE --check    validate the config and the key file, then exit
//! switchd --config FILE --dump [PATH]   print /status (or PATH) of the running instance
//! ```

use std::path::PathBuf;

use capybara_switchd::config::Config;

const USAGE: &str = "usage: switchd --config FILE [--check | --dump [PATH]]";

fn usage() -> ! {
    eprintln!("{USAGE}");
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut config: Option<PathBuf> = None;
    let mut check = false;
    let mut dump: Option<String> = None;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--config" | "-c" => {
                i += 1;
                config = Some(args.get(i).map(PathBuf::from).unwrap_or_else(|| usage()));
            }
            "--check" => check = true,
            "--dump" => {
                let path = args.get(i + 1).filter(|a| a.starts_with('/')).cloned();
                if path.is_some() {
                    i += 1;
                }
                dump = Some(path.unwrap_or_else(|| "/status".into()));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => {
                eprintln!("switchd: unknown argument {other:?}");
                usage()
            }
        }
        i += 1;
    }
    let Some(path) = config else { usage() };
    let cfg = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            // A bad configuration exits 2, like `capybara --check` and
            // `hostagent --check` (1 is for a daemon that fails).
            eprintln!("switchd: {e}");
            std::process::exit(2);
        }
    };
    if check {
        if let Err(e) = cfg.load_key().and_then(|_| cfg.check_files()) {
            eprintln!("switchd: {e}");
            std::process::exit(2);
        }
        if let Some(w) = cfg.key_file_warning() {
            eprintln!("switchd: {w}");
        }
        println!("switchd: config {} OK: {}", path.display(), cfg.summary());
        return;
    }
    if let Some(p) = dump {
        match capybara_switchd::daemon::fetch(cfg.metrics_listen, &p) {
            Ok(body) => print!("{body}"),
            Err(e) => {
                eprintln!("switchd: {e:#}");
                std::process::exit(1);
            }
        }
        return;
    }
    if let Err(e) = capybara_switchd::daemon::run(cfg) {
        eprintln!("switchd: {e:#}");
        std::process::exit(1);
    }
}
