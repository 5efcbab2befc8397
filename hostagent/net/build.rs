//! Compiles the DPDK C shim when the `dpdk` feature is on. Flags come from
//! `pkg-config libdpdk` (Debian's libdpdk-dev, 22.11).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/dpdk_shim.c");
    #[cfg(feature = "dpdk")]
    dpdk::build();
}

#[cfg(feature = "dpdk")]
mod dpdk {
    use std::process::Command;

    fn pkg_config(arg: &str) -> Vec<String> {
        let out = Command::new("pkg-config")
            .args([arg, "libdpdk"])
            .output()
            .expect("pkg-config not found: install pkg-config and libdpdk-dev");
        assert!(
            out.status.success(),
            "pkg-config {arg} libdpdk failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    pub fn build() {
        let mut cc = cc::Build::new();
        cc.file("csrc/dpdk_shim.c").warnings(false);
        let cflags = pkg_config("--cflags");
        let mut it = cflags.iter();
        while let Some(f) = it.next() {
            if let Some(dir) = f.strip_prefix("-I") {
                cc.include(dir);
            } else if f == "-include" {
                if let Some(h) = it.next() {
                    cc.flag("-include").flag(h);
                }
            } else {
                cc.flag(f);
            }
        }
        cc.compile("capybara_dpdk_shim");
        for f in pkg_config("--libs") {
            if let Some(lib) = f.strip_prefix("-l") {
                println!("cargo:rustc-link-lib=dylib={lib}");
            } else if let Some(dir) = f.strip_prefix("-L") {
                println!("cargo:rustc-link-search=native={dir}");
            }
        }
    }
}
