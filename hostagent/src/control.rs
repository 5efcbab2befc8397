//! The hostagent's side of the control channel: it registers with switchd
//! (data address, data-interface MAC, weight, services), sends heartbeats
//! with a counters summary, and carries out the switch's DRAIN and MIGRATE
//! requests. Runs on a kernel UDP socket bound to the management address;
//! every message is MAC'd with the deployment secret.

use crate::config::ControlConfig;
use crate::stack::Stack;
use capybara_proto::control::{
    ControlBody, ControlRepr, Heartbeat, Register, ServiceList, HEARTBEAT_DRAINING,
};
use capybara_proto::{MigrationKey, ServerId};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

/// Runs forever: registration (retried every second until acknowledged),
/// then heartbeats at the interval the switch asked for.
pub async fn run(
    cfg: ControlConfig,
    key: MigrationKey,
    stack: Stack,
    data_addr: Ipv4Addr,
    data_mac: [u8; 6],
    services: Vec<SocketAddrV4>,
) {
    let sock = match tokio::net::UdpSocket::bind(SocketAddrV4::new(cfg.management, 0)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "hostagent: control channel: cannot bind {}: {e}",
                cfg.management
            );
            return;
        }
    };
    let id = ServerId(cfg.server_id);
    let mut seq = 0u64;
    let mut buf = vec![0u8; 2048];
    let mut rx = vec![0u8; 2048];
    let mut registered = false;
    let mut draining = false;
    let send = |body: ControlBody<'_>, buf: &mut [u8], seq: &mut u64| -> Option<usize> {
        *seq += 1;
        ControlRepr {
            server_id: id,
            seq: *seq,
            body,
        }
        .emit_with_mac(buf, &key)
        .ok()
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let body = if !registered {
                    ControlBody::Register(Register {
                        mgmt_addr: cfg.management,
                        data_addr,
                        data_mac,
                        weight: cfg.weight,
                        services: ServiceList::Slice(&services),
                    })
                } else {
                    let (connections, in_flight, backlog) = stack.with(|i| {
                        let tcp = &i.transports.tcp;
                        let backlog: u64 = tcp.infos().map(|(_, c)| c.recv_queue as u64).sum();
                        let mig = i.transports.mig.as_ref().map_or((0, 0), |m| m.engine.in_progress());
                        (tcp.connection_count() as u32, (mig.0 + mig.1) as u32, backlog)
                    });
                    ControlBody::Heartbeat(Heartbeat {
                        connections,
                        migrations_in_flight: in_flight,
                        load_pps: 0,
                        rx_backlog_bytes: backlog,
                        flags: if draining { HEARTBEAT_DRAINING } else { 0 },
                    })
                };
                if let Some(n) = send(body, &mut buf, &mut seq) {
                    let _ = sock.send_to(&buf[..n], cfg.switch).await;
                }
            }
            r = sock.recv_from(&mut rx) => {
                let Ok((n, from)) = r else { continue };
                if from != std::net::SocketAddr::V4(cfg.switch) {
                    continue;
                }
                let Ok(msg) = ControlRepr::parse_verified(&rx[..n], &key) else { continue };
                match msg.body {
                    ControlBody::RegisterAck(ack) => {
                        if !registered {
                            eprintln!("hostagent: registered with switch {} as {id}", cfg.switch);
                        }
                        registered = true;
                        tick = tokio::time::interval(Duration::from_millis(u64::from(ack.heartbeat_interval_ms.max(10))));
                    }
                    ControlBody::Drain(d) => {
                        draining = d.flags & capybara_proto::control::DRAIN_CANCEL == 0;
                        let started = stack.with(|i| drain(i, draining));
                        eprintln!("hostagent: drain {} ({started} migrations started)", if draining { "started" } else { "cancelled" });
                    }
                    ControlBody::Migrate(m) => {
                        let r = stack.with(|i| {
                            let now = i.clock.now();
                            i.transports.mig.as_mut().map(|mg| mg.migrate(now, m.flow, m.target))
                        });
                        if let Some(Err(e)) = r {
                            eprintln!("hostagent: migrate {}: {e}", m.flow);
                        }
                        stack.with(|i| i.kick());
                    }
                    ControlBody::Error(e) => eprintln!("hostagent: switch error: {}", e.text),
                    _ => {}
                }
            }
        }
    }
}

/// Starts migrating every connection away and refuses new migrations in
/// (or cancels that). Returns how many migrations were started.
fn drain(i: &mut crate::stack::Inner, on: bool) -> usize {
    let now = i.clock.now();
    let Some(m) = i.transports.mig.as_mut() else {
        return 0;
    };
    m.engine.set_draining(on);
    if !on {
        return 0;
    }
    let flows: Vec<_> = m.flows().map(|(f, _)| *f).collect();
    let started = flows
        .iter()
        .filter(|f| m.migrate(now, **f, None).is_ok())
        .count();
    i.kick();
    started
}
