//! `capybara-echo-client ADDR BYTES [--seed N] [--chunk N] [--timeout-s N] [--pace-ms N]`:
//! streams BYTES of seeded pseudo-random data to an echo service while
//! reading the echo back concurrently, and checks that what came back is
//! byte-for-byte what was sent (SHA-256 of both streams, plus a position of
//! the first difference). Prints one line `sent=.. received=.. sha256=..
//! ok=true|false` and exits 1 on any mismatch, reset or timeout.
//! `--pace-ms N` waits N ms after each chunk, so that a stream stays in use
//! for a known time (many connections then overlap even while a parent
//! with `--connections` is still starting them).

use rand::{rngs::SmallRng, RngCore, SeedableRng};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

fn fail(msg: String) -> ! {
    eprintln!("capybara-echo-client: {msg}");
    std::process::exit(1)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `--connections N` runs N concurrent streams (each BYTES long, seeds
    // seed..seed+N) and fails if any of them fails.
    if let Some(pos) = args.iter().position(|a| a == "--connections") {
        let n: u64 = args
            .get(pos + 1)
            .and_then(|v| v.parse().ok())
            .filter(|n| (1..=10_000).contains(n))
            .unwrap_or_else(|| fail("invalid --connections value: expected 1 to 10000".into()));
        let mut rest = args.clone();
        rest.drain(pos..pos + 2);
        let exe = std::env::current_exe().unwrap_or_else(|e| fail(format!("current_exe: {e}")));
        let base_seed: u64 = rest
            .iter()
            .position(|a| a == "--seed")
            .and_then(|i| rest.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        rest.retain(|_| true);
        let mut children = Vec::new();
        for i in 0..n {
            let mut a = rest.clone();
            if let Some(k) = a.iter().position(|x| x == "--seed") {
                a.drain(k..k + 2);
            }
            a.extend(["--seed".into(), (base_seed + i).to_string()]);
            let c = std::process::Command::new(&exe)
                .args(&a)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| fail(format!("spawn: {e}")));
            children.push(c);
        }
        let mut failed = 0;
        for c in children {
            let out = c
                .wait_with_output()
                .unwrap_or_else(|e| fail(format!("wait: {e}")));
            if !out.status.success() {
                failed += 1;
                eprint!("{}", String::from_utf8_lossy(&out.stderr));
            }
        }
        println!("connections={n} failed={failed} ok={}", failed == 0);
        std::process::exit(if failed == 0 { 0 } else { 1 });
    }
    let usage = || -> ! {
        fail("usage: capybara-echo-client ADDR BYTES [--seed N] [--chunk N] [--timeout-s N] [--pace-ms N]".into())
    };
    if args.len() < 2 {
        usage();
    }
    let addr = args[0].clone();
    let total: u64 = args[1]
        .parse()
        .unwrap_or_else(|_| fail(format!("invalid BYTES {:?}", args[1])));
    let mut seed = 1u64;
    let mut chunk = 64 * 1024usize;
    let mut timeout = 600u64;
    let mut pace_ms = 0u64;
    let mut it = args[2..].iter();
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| usage());
        let n: u64 = v
            .parse()
            .unwrap_or_else(|_| fail(format!("invalid {flag} value {v:?}")));
        match flag.as_str() {
            "--seed" => seed = n,
            "--chunk" => chunk = n.clamp(1, 1 << 24) as usize,
            "--timeout-s" => timeout = n,
            "--pace-ms" => pace_ms = n.min(60_000),
            _ => usage(),
        }
    }
    let stream = TcpStream::connect(&addr).unwrap_or_else(|e| fail(format!("connect {addr}: {e}")));
    stream
        .set_read_timeout(Some(Duration::from_secs(timeout)))
        .ok();
    stream
        .set_write_timeout(Some(Duration::from_secs(timeout)))
        .ok();
    let mut reader = stream.try_clone().unwrap();
    let mut writer = stream;

    let sender = std::thread::spawn(move || {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut buf = vec![0u8; chunk];
        let mut hash = Sha256::new();
        let mut sent = 0u64;
        while sent < total {
            let n = chunk.min((total - sent) as usize);
            rng.fill_bytes(&mut buf[..n]);
            hash.update(&buf[..n]);
            if let Err(e) = writer.write_all(&buf[..n]) {
                return Err(format!("write after {sent} bytes: {e}"));
            }
            sent += n as u64;
            if pace_ms > 0 && sent < total {
                std::thread::sleep(Duration::from_millis(pace_ms));
            }
        }
        writer
            .shutdown(Shutdown::Write)
            .map_err(|e| format!("shutdown: {e}"))?;
        Ok::<_, String>((sent, hash.finalize()))
    });

    // The receiver regenerates the expected stream to find the first
    // difference without buffering a gigabyte.
    let mut expect_rng = SmallRng::seed_from_u64(seed);
    let mut expect = vec![0u8; chunk];
    let mut expect_filled = 0usize;
    let mut expect_pos = 0usize;
    let mut buf = vec![0u8; 256 * 1024];
    let mut hash = Sha256::new();
    let mut received = 0u64;
    let mut first_diff: Option<u64> = None;
    let mut remaining_in_chunk_budget = total;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => fail(format!("read after {received} bytes: {e}")),
        };
        hash.update(&buf[..n]);
        for &b in &buf[..n] {
            if expect_pos == expect_filled {
                let m = chunk.min(remaining_in_chunk_budget as usize);
                expect_rng.fill_bytes(&mut expect[..m]);
                remaining_in_chunk_budget -= m as u64;
                expect_filled = m;
                expect_pos = 0;
            }
            if first_diff.is_none() && (expect_filled == 0 || expect[expect_pos] != b) {
                first_diff = Some(received);
            }
            expect_pos += 1;
            received += 1;
        }
    }
    let (sent, sent_hash) = sender
        .join()
        .unwrap_or_else(|_| fail("sender panicked".into()))
        .unwrap_or_else(|e| fail(e));
    let recv_hash = hash.finalize();
    let ok = sent == received && sent_hash == recv_hash && first_diff.is_none();
    let hex: String = recv_hash.iter().map(|b| format!("{b:02x}")).collect();
    println!("sent={sent} received={received} sha256={hex} ok={ok}");
    if !ok {
        fail(format!(
            "stream mismatch: sent {sent} bytes, received {received}, first difference at {first_diff:?}"
        ));
    }
}
