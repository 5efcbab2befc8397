//! Export/import cost of a TLS session snapshot (the TLS part of a
//! migration's CPU time, seed 000 §8.2.3 / Table 2).
//!
//! `cargo run --release -p capybara-tls --example snapshot_bench`
//!
//! Measures, for an idle AES-128-GCM session with KeyUpdate secrets and for
//! one holding a partial 16 KiB record, the mean time of `export` (into a
//! reused buffer) and of `import`, over a bounded number of iterations, in
//! thread CPU time (the machine is shared; wall time would count waiting).
//! Also the record layer's throughput (seal and open of 16 KiB records,
//! AES-128-GCM). Last line: `RESULT key=value ...`.

use std::io::Write;
use std::sync::Arc;

use capybara_tls::{TlsConfig, TlsServer};
use rustls::crypto::ring as provider;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, RootCertStore};

const ITERS: u32 = 100_000;

fn main() {
    let cert = capybara_tls_testcerts::test_cert();
    let cfg = TlsConfig::from_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes()).unwrap();
    let mut roots = RootCertStore::empty();
    roots.add(cert.cert_der).unwrap();
    let mut p = provider::default_provider();
    p.cipher_suites = vec![provider::cipher_suite::TLS13_AES_128_GCM_SHA256];
    let ccfg = ClientConfig::builder_with_provider(Arc::new(p))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut client =
        ClientConnection::new(Arc::new(ccfg), ServerName::try_from("localhost").unwrap()).unwrap();
    let mut server = TlsServer::new(&cfg).unwrap();
    for _ in 0..10 {
        let mut ct = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut ct).unwrap();
        }
        server.feed_ciphertext(&ct).unwrap();
        let mut out = Vec::new();
        server.take_ciphertext_to_send(&mut out);
        let mut rd = &out[..];
        while !rd.is_empty() {
            client.read_tls(&mut rd).unwrap();
        }
        client.process_new_packets().unwrap();
    }
    assert!(server.can_export() && !client.is_handshaking());

    let idle = measure(&server);
    let (seal, open) = record_throughput(&server);
    // A partial record of a 16 KiB write.
    client.writer().write_all(&[7u8; 16_384]).unwrap();
    let mut ct = Vec::new();
    while client.wants_write() {
        client.write_tls(&mut ct).unwrap();
    }
    server.feed_ciphertext(&ct[..ct.len() - 1]).unwrap();
    let partial = measure(&server);
    println!(
        "idle: {} bytes, export {:.0} ns, import {:.0} ns",
        idle.0, idle.1, idle.2
    );
    println!(
        "partial 16 KiB record: {} bytes, export {:.0} ns, import {:.0} ns",
        partial.0, partial.1, partial.2
    );
    println!("records of 16 KiB: seal {seal:.0} MB/s, open {open:.0} MB/s");
    println!(
        "RESULT tls_seal_mbps={seal:.0} tls_open_mbps={open:.0} tls_snapshot_bytes={} tls_export_ns={:.0} tls_import_ns={:.0} tls_partial_snapshot_bytes={} tls_partial_export_ns={:.0} tls_partial_import_ns={:.0}",
        idle.0, idle.1, idle.2, partial.0, partial.1, partial.2
    );
}

/// CPU time of this thread: on a machine shared with other work the
/// wall clock also counts time spent descheduled.
fn thread_cpu_ns() -> u128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
}

/// (snapshot bytes, mean export ns, mean import ns), thread CPU time.
fn measure(server: &TlsServer) -> (usize, f64, f64) {
    let mut buf = Vec::with_capacity(server.snapshot_len());
    let t = thread_cpu_ns();
    for _ in 0..ITERS {
        buf.clear();
        server.export(&mut buf).unwrap();
        std::hint::black_box(&buf);
    }
    let export = (thread_cpu_ns() - t) as f64 / f64::from(ITERS);
    let t = thread_cpu_ns();
    for _ in 0..ITERS {
        let s = TlsServer::import(std::hint::black_box(&buf)).unwrap();
        std::hint::black_box(&s);
    }
    let import = (thread_cpu_ns() - t) as f64 / f64::from(ITERS);
    (buf.len(), export, import)
}

/// MB/s (10^6 bytes of plaintext per CPU second) sealing and opening 16 KiB
/// records, 2000 of each (32 MB).
fn record_throughput(server: &TlsServer) -> (f64, f64) {
    const RECORDS: usize = 2000;
    let plain = vec![0x5au8; 16_384];
    let mut snap = Vec::new();
    server.export(&mut snap).unwrap();
    // Seal: a session writing records, ciphertext taken after each.
    let mut tx = TlsServer::import(&snap).unwrap();
    let mut out = Vec::with_capacity(20_000);
    let t = thread_cpu_ns();
    for _ in 0..RECORDS {
        out.clear();
        tx.write_plaintext(&plain).unwrap();
        tx.take_ciphertext_to_send(&mut out);
        std::hint::black_box(&out);
    }
    let seal_ns = thread_cpu_ns() - t;
    // Open: records sealed with the client's keys, fed one at a time.
    let mut rx = TlsServer::import(&snap).unwrap();
    let mut client = rx.testing_mirror().unwrap();
    let mut records = Vec::with_capacity(RECORDS);
    for _ in 0..RECORDS {
        client.write_plaintext(&plain).unwrap();
        let mut r = Vec::new();
        client.take_ciphertext_to_send(&mut r);
        records.push(r);
    }
    let mut buf = vec![0u8; 16_384];
    let t = thread_cpu_ns();
    for r in &records {
        rx.feed_ciphertext(r).unwrap();
        while rx.read_plaintext(&mut buf) > 0 {}
    }
    let open_ns = thread_cpu_ns() - t;
    let bytes = (RECORDS * plain.len()) as f64;
    (bytes * 1e3 / seal_ns as f64, bytes * 1e3 / open_ns as f64)
}
