//! The switchd daemon. Not implemented yet: the library (data plane,
//! control plane) is ready; the daemon loop (TOML config with `--check`,
//! XDP attach on the lab's interfaces, control channel on UDP 7692,
//! LOAD-NOTIFICATIONs on 7691, clean detach on SIGTERM/SIGINT) is next.

fn main() {
    eprintln!("switchd: daemon not implemented yet (see switchd/src/control.rs and src/bpf.rs)");
    std::process::exit(2);
}
