//! A native application on the hostagent stack that migrates its own
//! per-connection state through the connection-manager API (seed 000 §6),
//! without the sidecar.
//!
//! Protocol: the client sends decimal numbers, one per line; for each line
//! the server answers the running sum of everything this connection has
//! sent so far. The running sum, and a line received only in part, are
//! application state outside the TCP queues: the manager exports them and
//! the target's importer restores them, so a connection migrated at any
//! byte (even in the middle of a number) keeps counting from where it was.
//!
//! Run it like the hostagent: `native_sum --config FILE` with a hostagent
//! configuration (AF_PACKET backend; every `[[service]]` is served with this
//! protocol whatever its `app`; `[migration]` with `churn_every_ms` migrates
//! every connection periodically, `[control]` registers with switchd). The
//! lab test `tests/tests/sidecar_lab.rs::native_application_migrates_its_own_state`
//! runs it on two servers and checks every sum.

use capybara_hostagent::config::Config;
use capybara_hostagent::migration::Migrator;
use capybara_hostagent::socket::{ConnectionManager, Readiness, StateImporter};
use capybara_hostagent::stack::Transports;
use capybara_hostagent::{control, Stack, TcpListener, TcpStream};
use capybara_net::device::af_packet::{AfPacket, AfPacketConfig};
use capybara_net::device::PollMode;
use capybara_net::iface::{Interface, InterfaceConfig};
use capybara_proto::FlowKey;
use capybara_tcp::{Endpoint, TcpConfig};
use capybara_tcpmig::{Engine, EngineConfig};
use std::any::Any;
use std::cell::RefCell;
use std::future::poll_fn;
use std::rc::Rc;

/// Longest line accepted (a u64 in decimal, with room for a CR).
const MAX_LINE: usize = 24;
/// Most reply bytes one input byte can cause ("0\n" -> 20 digits + '\n').
const REPLY_PER_BYTE: usize = 11;

/// The per-connection state that must migrate.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct SumState {
    sum: u64,
    partial: Vec<u8>,
}

impl SumState {
    /// Wire format: u64 sum (big-endian), u8 length, that many bytes of a
    /// partial line.
    fn export(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.sum.to_be_bytes());
        out.push(self.partial.len() as u8);
        out.extend_from_slice(&self.partial);
    }

    fn import(b: &[u8]) -> Result<SumState, String> {
        if b.len() < 9 {
            return Err(format!("sum state truncated ({} bytes)", b.len()));
        }
        let sum = u64::from_be_bytes(b[..8].try_into().expect("8 bytes"));
        let n = usize::from(b[8]);
        if n > MAX_LINE || b.len() != 9 + n {
            return Err("sum state: bad partial line length".into());
        }
        Ok(SumState {
            sum,
            partial: b[9..].to_vec(),
        })
    }

    /// Consumes input bytes, appending one reply per complete line.
    fn feed(&mut self, input: &[u8], replies: &mut Vec<u8>) -> Result<(), String> {
        for &b in input {
            match b {
                b'\n' => {
                    let line = std::str::from_utf8(&self.partial)
                        .map_err(|_| "not a number".to_string())?
                        .trim();
                    let n: u64 = line
                        .parse()
                        .map_err(|_| format!("not a number: {line:?}"))?;
                    self.sum = self.sum.wrapping_add(n);
                    replies.extend_from_slice(format!("{}\n", self.sum).as_bytes());
                    self.partial.clear();
                }
                _ if self.partial.len() >= MAX_LINE => return Err("line too long".into()),
                _ => self.partial.push(b),
            }
        }
        Ok(())
    }
}

/// The manager: the state is consistent between any two steps of the
/// connection's task (each step reads, updates and writes the replies into
/// the send queue without awaiting), so every instant is a safe point.
struct Manager(Rc<RefCell<SumState>>);

impl ConnectionManager for Manager {
    fn prepare(&mut self) -> Readiness {
        Readiness::Ready
    }
    fn export_state(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        self.0.borrow().export(out);
        Ok(())
    }
    fn resume(&mut self) {}
}

struct Importer;

impl StateImporter for Importer {
    fn import_state(&self, _flow: FlowKey, state: &[u8]) -> Result<Box<dyn Any>, String> {
        if state.is_empty() {
            return Ok(Box::new(SumState::default()));
        }
        Ok(Box::new(SumState::import(state)?))
    }
}

async fn serve(listener: TcpListener) {
    listener.set_importer(Rc::new(Importer));
    loop {
        let Ok((mut stream, peer)) = listener.accept().await else {
            continue;
        };
        let state = stream
            .take_imported_state()
            .and_then(|b| b.downcast::<SumState>().ok())
            .map(|b| *b)
            .unwrap_or_default();
        let state = Rc::new(RefCell::new(state));
        stream.set_manager(Box::new(Manager(state.clone())));
        tokio::task::spawn_local(async move {
            match connection(&stream, &state).await {
                Ok(()) => println!("native_sum peer={peer} closed sum={}", state.borrow().sum),
                Err(e) => match capybara_hostagent::socket::moved_to(&e) {
                    Some(t) => println!("native_sum peer={peer} migrated to {t}"),
                    None => println!("native_sum peer={peer} error={e}"),
                },
            }
        });
    }
}

async fn connection(stream: &TcpStream, state: &RefCell<SumState>) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut replies = Vec::with_capacity(buf.len() * REPLY_PER_BYTE);
    loop {
        // Read only what the replies can be sure to fit in the send queue,
        // so that input, state and output change in one step.
        let cap = poll_fn(|cx| stream.poll_send_capacity(cx)).await?;
        let want = (cap / REPLY_PER_BYTE).clamp(1, buf.len());
        if cap < REPLY_PER_BYTE {
            tokio::task::yield_now().await;
            continue;
        }
        let n = poll_fn(|cx| stream.poll_read_some(cx, &mut buf[..want])).await?;
        if n == 0 {
            stream.shutdown_write()?;
            return Ok(());
        }
        replies.clear();
        if let Err(e) = state.borrow_mut().feed(&buf[..n], &mut replies) {
            let _ = stream.try_write(format!("error: {e}\n").as_bytes());
            stream.shutdown_write()?;
            return Ok(());
        }
        let w = stream.try_write(&replies)?;
        debug_assert_eq!(w, replies.len());
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = match args.iter().position(|a| a == "--config") {
        Some(i) if i + 1 < args.len() => args[i + 1].clone(),
        _ => {
            eprintln!("usage: native_sum --config HOSTAGENT_CONFIG");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&path) {
        eprintln!("native_sum: {e}");
        std::process::exit(1);
    }
}

fn run(path: &str) -> Result<(), String> {
    let cfg = Config::load(path).map_err(|e| e.to_string())?;
    let device =
        AfPacket::open(&AfPacketConfig::new(&cfg.interface.name)).map_err(|e| e.to_string())?;
    let mac = capybara_net::device::Device::mac(&device).ok_or("interface has no MAC address")?;
    let mut icfg = InterfaceConfig::new(mac, cfg.stack.address, cfg.stack.gateway);
    for s in &cfg.services {
        if *s.listen.ip() != cfg.stack.address && !icfg.extra_addresses.contains(s.listen.ip()) {
            icfg.extra_addresses.push(*s.listen.ip());
        }
    }
    let iface = Interface::new(icfg).map_err(|e| e.to_string())?;
    let tcp = Endpoint::new(TcpConfig {
        mss: cfg.stack.mss,
        rx_buffer: cfg.stack.recv_buffer,
        tx_buffer: cfg.stack.send_buffer,
        isn_key: rand::random(),
        keepalive: cfg.tcp.keepalive(),
        ..TcpConfig::default()
    });
    let mut transports = Transports::new(tcp, cfg.stack.address);
    for s in &cfg.services {
        transports.vips.insert(s.listen.port(), *s.listen.ip());
    }
    let mig = cfg
        .migration
        .clone()
        .ok_or("this example needs a [migration] section")?;
    let key = mig.load_key(path).map_err(|e| e.to_string())?;
    let mut ec = EngineConfig::new(cfg.stack.address, mig.switch);
    ec.first_migration_seq = capybara_hostagent::migration::first_migration_seq_now();
    ec.max_snapshot_bytes = cfg.stack.send_buffer + cfg.stack.recv_buffer + 4096;
    ec.max_buffer_bytes = cfg.stack.recv_buffer;
    let engine = Engine::new(ec, key.clone()).map_err(|e| e.to_string())?;
    transports.mig = Some(Migrator::new(engine, cfg.stack.address));
    let stack = Stack::new(iface, transports, Box::new(device), PollMode::Sleep);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        for s in &cfg.services {
            let l = TcpListener::bind(&stack, s.listen)
                .map_err(|e| format!("listen {}: {e}", s.listen))?;
            tokio::task::spawn_local(serve(l));
        }
        if let Some(c) = cfg.control.clone() {
            let services = cfg.services.iter().map(|s| s.listen).collect();
            // Nothing here starts a graceful stop: the channel runs until
            // the process ends.
            let stop = Rc::new(capybara_hostagent::drain::StopSignal::default());
            tokio::task::spawn_local(control::run_with_stop(
                c,
                key,
                stack.clone(),
                cfg.stack.address,
                mac.0,
                services,
                // No sidecar services: nothing to health-check.
                Rc::new(capybara_hostagent::health::Board::new(&cfg.health, &[])),
                stop,
            ));
        }
        if mig.churn_every_ms > 0 {
            tokio::task::spawn_local(churn(stack.clone(), mig.churn_every_ms, mig.churn_to));
        }
        eprintln!(
            "native_sum: {} on {}",
            cfg.stack.address, cfg.interface.name
        );
        stack.drive().await
    })
}

/// Migrates every connection served here to `to` every `every_ms`.
async fn churn(stack: Stack, every_ms: u64, to: Option<std::net::Ipv4Addr>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(every_ms));
    let mut flows = Vec::new();
    loop {
        tick.tick().await;
        stack.with(|i| {
            let now = i.clock.now();
            if let Some(m) = i.transports.mig.as_mut() {
                flows.clear();
                flows.extend(m.flows().map(|(f, _)| *f));
                for f in &flows {
                    let _ = m.migrate(now, *f, to);
                }
            }
            i.kick();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_at_every_byte() {
        let input = b"5\n17\n3000\n1\n";
        let mut whole = SumState::default();
        let mut want = Vec::new();
        whole.feed(input, &mut want).unwrap();
        for cut in 0..=input.len() {
            let mut a = SumState::default();
            let mut got = Vec::new();
            a.feed(&input[..cut], &mut got).unwrap();
            let mut bytes = Vec::new();
            a.export(&mut bytes);
            let mut b = SumState::import(&bytes).unwrap();
            b.feed(&input[cut..], &mut got).unwrap();
            assert_eq!(got, want, "cut {cut}");
            assert_eq!(b, whole);
        }
        assert!(SumState::import(&[0; 8]).is_err());
        assert!(SumState::import(&[0, 0, 0, 0, 0, 0, 0, 0, 3, b'1']).is_err());
    }
}
