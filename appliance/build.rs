//! Compiles the lab's eBPF programs with clang; the object is embedded in the
//! `capybara` binary so that the lab needs no files at run time.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    for name in ["fault", "pass"] {
        compile(&out, name);
    }
}

fn compile(out: &std::path::Path, name: &str) {
    let src = format!("bpf/{name}.bpf.c");
    println!("cargo:rerun-if-changed={src}");
    // Debian keeps <asm/types.h> under the multiarch include directory.
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|_| "x86_64".into());
    let multiarch = format!("-I/usr/include/{arch}-linux-gnu");
    let status = Command::new("clang")
        .args([
            "-O2", "-g", "-target", "bpf", "-Wall", "-Werror", &multiarch, "-c", &src, "-o",
        ])
        .arg(out.join(format!("{name}.bpf.o")))
        .status()
        .expect("clang is needed to build the lab's eBPF programs (make setup installs it)");
    assert!(status.success(), "clang failed to compile {src}");
}
