//! The eBPF C header `include/capybara_proto.h` is hand-written; this test is
//! what keeps it equal to the Rust definitions. It compiles a small C
//! program against the header with the system C compiler (`$CC`, else `cc`),
//! runs it, and compares every printed sizeof/offsetof/constant with the
//! Rust side. A missing compiler fails the test loudly rather than skipping:
//! a silently untested header is how Katran's structs drifted.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use capybara_proto::{control, load, ports, tcpmig, MAC_LEN};

/// (name printed by the C program, C expression).
fn c_items() -> Vec<(&'static str, &'static str)> {
    let mut v = vec![
        ("port_tcpmig", "CAPYBARA_PORT_TCPMIG"),
        ("port_load", "CAPYBARA_PORT_LOAD"),
        ("port_control", "CAPYBARA_PORT_CONTROL"),
        ("tcpmig_magic", "TCPMIG_MAGIC"),
        ("tcpmig_version", "TCPMIG_VERSION"),
        ("tcpmig_hdr_len", "TCPMIG_HDR_LEN"),
        ("tcpmig_mac_len", "TCPMIG_MAC_LEN"),
        ("tcpmig_min_len", "TCPMIG_MIN_LEN"),
        ("sizeof_tcpmig_hdr", "sizeof(struct tcpmig_hdr)"),
        ("load_magic", "LOAD_MAGIC"),
        ("load_version", "LOAD_VERSION"),
        ("load_len", "LOAD_LEN"),
        ("load_version_weighted", "LOAD_VERSION_WEIGHTED"),
        ("load_len_weighted", "LOAD_LEN_WEIGHTED"),
        ("load_off_own_weight", "LOAD_OFF_OWN_WEIGHT"),
        ("load_off_pool_weight", "LOAD_OFF_POOL_WEIGHT"),
        (
            "sizeof_load_notification",
            "sizeof(struct load_notification)",
        ),
        ("control_magic", "CONTROL_MAGIC"),
        ("control_version", "CONTROL_VERSION"),
        ("control_hdr_len", "CONTROL_HDR_LEN"),
        ("control_mac_len", "CONTROL_MAC_LEN"),
        ("sizeof_control_hdr", "sizeof(struct control_hdr)"),
    ];
    v.extend(KINDS.iter().map(|(n, c, _)| (*n, *c)));
    v.extend(REASONS.iter().map(|(n, c, _)| (*n, *c)));
    v.extend(CONTROL_KINDS.iter().map(|(n, c, _)| (*n, *c)));
    v
}

const KINDS: &[(&str, &str, tcpmig::Kind)] = &[
    ("kind_prepare", "TCPMIG_KIND_PREPARE", tcpmig::Kind::Prepare),
    (
        "kind_prepare_ack",
        "TCPMIG_KIND_PREPARE_ACK",
        tcpmig::Kind::PrepareAck,
    ),
    (
        "kind_conn_state",
        "TCPMIG_KIND_CONN_STATE",
        tcpmig::Kind::ConnState,
    ),
    (
        "kind_conn_state_ack",
        "TCPMIG_KIND_CONN_STATE_ACK",
        tcpmig::Kind::ConnStateAck,
    ),
    ("kind_reject", "TCPMIG_KIND_REJECT", tcpmig::Kind::Reject),
    ("kind_abort", "TCPMIG_KIND_ABORT", tcpmig::Kind::Abort),
];

const REASONS: &[(&str, &str, tcpmig::Reason)] = &[
    ("reason_none", "TCPMIG_REASON_NONE", tcpmig::Reason::None),
    (
        "reason_no_capacity",
        "TCPMIG_REASON_NO_CAPACITY",
        tcpmig::Reason::NoCapacity,
    ),
    (
        "reason_draining",
        "TCPMIG_REASON_DRAINING",
        tcpmig::Reason::Draining,
    ),
    (
        "reason_policy",
        "TCPMIG_REASON_POLICY",
        tcpmig::Reason::Policy,
    ),
    (
        "reason_timeout",
        "TCPMIG_REASON_TIMEOUT",
        tcpmig::Reason::Timeout,
    ),
    (
        "reason_unknown_migration",
        "TCPMIG_REASON_UNKNOWN_MIGRATION",
        tcpmig::Reason::UnknownMigration,
    ),
    (
        "reason_import_failed",
        "TCPMIG_REASON_IMPORT_FAILED",
        tcpmig::Reason::ImportFailed,
    ),
    (
        "reason_duplicate_flow",
        "TCPMIG_REASON_DUPLICATE_FLOW",
        tcpmig::Reason::DuplicateFlow,
    ),
    (
        "reason_cancelled",
        "TCPMIG_REASON_CANCELLED",
        tcpmig::Reason::Cancelled,
    ),
    (
        "reason_snapshot_too_large",
        "TCPMIG_REASON_SNAPSHOT_TOO_LARGE",
        tcpmig::Reason::SnapshotTooLarge,
    ),
    (
        "reason_unspecified",
        "TCPMIG_REASON_UNSPECIFIED",
        tcpmig::Reason::Unspecified,
    ),
];

const CONTROL_KINDS: &[(&str, &str, control::ControlKind)] = &[
    (
        "ckind_register",
        "CONTROL_KIND_REGISTER",
        control::ControlKind::Register,
    ),
    (
        "ckind_register_ack",
        "CONTROL_KIND_REGISTER_ACK",
        control::ControlKind::RegisterAck,
    ),
    (
        "ckind_heartbeat",
        "CONTROL_KIND_HEARTBEAT",
        control::ControlKind::Heartbeat,
    ),
    (
        "ckind_drain",
        "CONTROL_KIND_DRAIN",
        control::ControlKind::Drain,
    ),
    (
        "ckind_migrate",
        "CONTROL_KIND_MIGRATE",
        control::ControlKind::Migrate,
    ),
    (
        "ckind_error",
        "CONTROL_KIND_ERROR",
        control::ControlKind::Error,
    ),
    (
        "ckind_set_owner",
        "CONTROL_KIND_SET_OWNER",
        control::ControlKind::SetOwner,
    ),
    (
        "ckind_policy",
        "CONTROL_KIND_POLICY",
        control::ControlKind::Policy,
    ),
    (
        "ckind_migration_report",
        "CONTROL_KIND_MIGRATION_REPORT",
        control::ControlKind::MigrationReport,
    ),
];

/// (C struct, C field, OFF macro, Rust byte range of the field).
fn fields() -> Vec<(
    &'static str,
    &'static str,
    &'static str,
    std::ops::Range<usize>,
)> {
    use tcpmig::field as t;
    let one = |i: usize| i..i + 1;
    let mut v = vec![
        ("tcpmig_hdr", "magic", "TCPMIG_OFF_MAGIC", t::MAGIC),
        (
            "tcpmig_hdr",
            "version",
            "TCPMIG_OFF_VERSION",
            one(t::VERSION),
        ),
        ("tcpmig_hdr", "kind", "TCPMIG_OFF_KIND", one(t::KIND)),
        (
            "tcpmig_hdr",
            "migration_id",
            "TCPMIG_OFF_MIGRATION_ID",
            t::MIGRATION_ID,
        ),
        (
            "tcpmig_hdr",
            "client_ip",
            "TCPMIG_OFF_CLIENT_IP",
            t::CLIENT_IP,
        ),
        (
            "tcpmig_hdr",
            "client_port",
            "TCPMIG_OFF_CLIENT_PORT",
            t::CLIENT_PORT,
        ),
        (
            "tcpmig_hdr",
            "service_port",
            "TCPMIG_OFF_SERVICE_PORT",
            t::SERVICE_PORT,
        ),
        (
            "tcpmig_hdr",
            "service_ip",
            "TCPMIG_OFF_SERVICE_IP",
            t::SERVICE_IP,
        ),
        ("tcpmig_hdr", "origin", "TCPMIG_OFF_ORIGIN", t::ORIGIN),
        ("tcpmig_hdr", "target", "TCPMIG_OFF_TARGET", t::TARGET),
        ("tcpmig_hdr", "seq", "TCPMIG_OFF_SEQ", t::SEQ),
        (
            "tcpmig_hdr",
            "frag_index",
            "TCPMIG_OFF_FRAG_INDEX",
            t::FRAG_INDEX,
        ),
        (
            "tcpmig_hdr",
            "frag_count",
            "TCPMIG_OFF_FRAG_COUNT",
            t::FRAG_COUNT,
        ),
        (
            "tcpmig_hdr",
            "payload_len",
            "TCPMIG_OFF_PAYLOAD_LEN",
            t::PAYLOAD_LEN,
        ),
        ("tcpmig_hdr", "reason", "TCPMIG_OFF_REASON", t::REASON),
        ("tcpmig_hdr", "epoch", "TCPMIG_OFF_EPOCH", t::EPOCH),
    ];
    use load::field as l;
    v.extend([
        ("load_notification", "magic", "LOAD_OFF_MAGIC", l::MAGIC),
        (
            "load_notification",
            "version",
            "LOAD_OFF_VERSION",
            one(l::VERSION),
        ),
        (
            "load_notification",
            "flags",
            "LOAD_OFF_FLAGS",
            one(l::FLAGS),
        ),
        ("load_notification", "epoch", "LOAD_OFF_EPOCH", l::EPOCH),
        (
            "load_notification",
            "sequence",
            "LOAD_OFF_SEQUENCE",
            l::SEQUENCE,
        ),
        (
            "load_notification",
            "interval_us",
            "LOAD_OFF_INTERVAL_US",
            l::INTERVAL_US,
        ),
        (
            "load_notification",
            "server_id",
            "LOAD_OFF_SERVER_ID",
            l::SERVER_ID,
        ),
        (
            "load_notification",
            "own_load",
            "LOAD_OFF_OWN_LOAD",
            l::OWN_LOAD,
        ),
        (
            "load_notification",
            "pool_load",
            "LOAD_OFF_POOL_LOAD",
            l::POOL_LOAD,
        ),
        (
            "load_notification",
            "live_servers",
            "LOAD_OFF_LIVE_SERVERS",
            l::LIVE_SERVERS,
        ),
        (
            "load_notification",
            "least_loaded",
            "LOAD_OFF_LEAST_LOADED",
            l::LEAST_LOADED,
        ),
    ]);
    use control::field as c;
    v.extend([
        ("control_hdr", "magic", "CONTROL_OFF_MAGIC", c::MAGIC),
        (
            "control_hdr",
            "version",
            "CONTROL_OFF_VERSION",
            one(c::VERSION),
        ),
        ("control_hdr", "kind", "CONTROL_OFF_KIND", one(c::KIND)),
        (
            "control_hdr",
            "server_id",
            "CONTROL_OFF_SERVER_ID",
            c::SERVER_ID,
        ),
        ("control_hdr", "seq", "CONTROL_OFF_SEQ", c::SEQ),
        (
            "control_hdr",
            "body_len",
            "CONTROL_OFF_BODY_LEN",
            c::BODY_LEN,
        ),
        ("control_hdr", "flags", "CONTROL_OFF_FLAGS", c::FLAGS),
    ]);
    v
}

fn c_program() -> String {
    let mut s = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"capybara_proto.h\"\nint main(void) {\n",
    );
    for (name, expr) in c_items() {
        s += &format!("  printf(\"{name} %llu\\n\", (unsigned long long)({expr}));\n");
    }
    for (st, f, off, _) in fields() {
        s += &format!(
            "  printf(\"{st}.{f}.offset %llu\\n\", (unsigned long long)offsetof(struct {st}, {f}));\n\
             \x20 printf(\"{st}.{f}.size %llu\\n\", (unsigned long long)sizeof(((struct {st} *)0)->{f}));\n\
             \x20 printf(\"{st}.{f}.macro %llu\\n\", (unsigned long long)({off}));\n"
        );
    }
    // Offsets that have no struct field.
    s += "  printf(\"tcpmig_off_payload %llu\\n\", (unsigned long long)TCPMIG_OFF_PAYLOAD);\n";
    s += "  printf(\"control_off_body %llu\\n\", (unsigned long long)CONTROL_OFF_BODY);\n";
    s += "  return 0;\n}\n";
    s
}

fn run_c() -> HashMap<String, u64> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("c_header");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&src, c_program()).unwrap();
    let include = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg("-I")
        .arg(&include)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run C compiler {cc:?}: {e}"));
    assert!(
        out.status.success(),
        "C header does not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run layout program");
    assert!(run.status.success());
    String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

#[test]
fn c_header_matches_rust_definitions() {
    let c = run_c();
    let get = |k: &str| {
        *c.get(k)
            .unwrap_or_else(|| panic!("C program did not print {k}"))
    };
    let mut mismatches = Vec::new();
    let mut expect = |k: &str, rust: u64| {
        if get(k) != rust {
            mismatches.push(format!("{k}: C {} != Rust {rust}", get(k)));
        }
    };

    expect("port_tcpmig", ports::TCPMIG.into());
    expect("port_load", ports::LOAD.into());
    expect("port_control", ports::CONTROL.into());
    expect("tcpmig_magic", tcpmig::MAGIC.into());
    expect("tcpmig_version", tcpmig::VERSION.into());
    expect("tcpmig_hdr_len", tcpmig::HEADER_LEN as u64);
    expect("sizeof_tcpmig_hdr", tcpmig::HEADER_LEN as u64);
    expect("tcpmig_mac_len", MAC_LEN as u64);
    expect("tcpmig_min_len", tcpmig::MIN_LEN as u64);
    expect("tcpmig_off_payload", tcpmig::field::PAYLOAD as u64);
    expect("load_magic", load::MAGIC.into());
    expect("load_version", load::VERSION.into());
    expect("load_len", load::LEN as u64);
    expect("load_version_weighted", load::VERSION_WEIGHTED.into());
    expect("load_len_weighted", load::LEN_WEIGHTED as u64);
    expect("load_off_own_weight", load::field::OWN_WEIGHT.start as u64);
    expect(
        "load_off_pool_weight",
        load::field::POOL_WEIGHT.start as u64,
    );
    expect("sizeof_load_notification", load::LEN as u64);
    expect("control_magic", control::MAGIC.into());
    expect("control_version", control::VERSION.into());
    expect("control_hdr_len", control::HEADER_LEN as u64);
    expect("sizeof_control_hdr", control::HEADER_LEN as u64);
    expect("control_mac_len", MAC_LEN as u64);
    expect("control_off_body", control::field::BODY as u64);
    for (n, _, k) in KINDS {
        expect(n, k.to_u8().into());
    }
    for (n, _, r) in REASONS {
        expect(n, r.to_u16().into());
    }
    for (n, _, k) in CONTROL_KINDS {
        expect(n, k.to_u8().into());
    }
    for (st, f, _, range) in fields() {
        expect(&format!("{st}.{f}.offset"), range.start as u64);
        expect(&format!("{st}.{f}.macro"), range.start as u64);
        expect(&format!("{st}.{f}.size"), range.len() as u64);
    }
    assert!(
        mismatches.is_empty(),
        "C header drifted from Rust:\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn every_tcpmig_kind_is_mirrored() {
    // A new Rust kind without a C constant must fail here.
    assert_eq!(KINDS.len(), tcpmig::Kind::ALL.len());
    for k in tcpmig::Kind::ALL {
        assert!(
            KINDS.iter().any(|(_, _, x)| *x == k),
            "{k} missing from C header test"
        );
    }
}
