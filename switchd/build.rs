//! Compiles the XDP data plane (bpf/switch.bpf.c) and its table counter
//! (bpf/count.bpf.c) with clang into $OUT_DIR/switch.bpf.o and
//! $OUT_DIR/count.bpf.o, which src/bpf.rs embeds with include_bytes!.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let proto_include = manifest.join("../proto/include");
    for dep in [
        "bpf/switch.bpf.c",
        "bpf/count.bpf.c",
        "bpf/capybara_maps.h",
        "../proto/include/capybara_proto.h",
    ] {
        println!("cargo:rerun-if-changed={}", manifest.join(dep).display());
    }
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    // Debian keeps asm/ under the multiarch directory; the BPF target does
    // not know it, so name it explicitly.
    let multiarch = Command::new("gcc")
        .arg("-print-multiarch")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "x86_64-linux-gnu".to_string());
    for name in ["switch", "count"] {
        let src = manifest.join(format!("bpf/{name}.bpf.c"));
        let out = out_dir.join(format!("{name}.bpf.o"));
        let status = Command::new(&clang)
            .args([
                "-O2", "-g", "-target", "bpf", "-mcpu=v3", "-Wall", "-Werror",
            ])
            .arg(format!("-I{}", proto_include.display()))
            .arg(format!("-I{}", manifest.join("bpf").display()))
            .arg(format!("-I/usr/include/{multiarch}"))
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {clang} (install clang): {e}"));
        if !status.success() {
            panic!("clang failed to compile {}", src.display());
        }
    }
}
