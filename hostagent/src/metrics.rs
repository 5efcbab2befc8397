//! The management endpoint: Prometheus text with the counters a network
//! engineer asks for first (packets in/out, drops by reason, retransmits,
//! RTT estimates, connections by state), served over kernel TCP on the
//! server's management address.

use crate::stack::Stack;
use std::fmt::Write;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Renders all counters in Prometheus text format.
pub fn render(stack: &Stack, name: &str) -> String {
    stack.with(|i| {
        let mut s = String::with_capacity(4096);
        let l = format!("server=\"{name}\"");
        let ic = i.iface.counters();
        let _ = writeln!(s, "# TYPE capybara_frames_received_total counter");
        let _ = writeln!(s, "capybara_frames_received_total{{{l}}} {}", ic.rx_frames);
        let _ = writeln!(s, "# TYPE capybara_frames_sent_total counter");
        let _ = writeln!(s, "capybara_frames_sent_total{{{l}}} {}", ic.tx_frames);
        let _ = writeln!(s, "# TYPE capybara_frame_drops_total counter");
        for (reason, n) in ic.drop_counts() {
            let _ = writeln!(
                s,
                "capybara_frame_drops_total{{{l},reason=\"{}\"}} {n}",
                reason.as_str()
            );
        }
        let tc = i.transports.tcp.counters();
        for (metric, v) in [
            ("capybara_tcp_segments_received_total", tc.segments_in),
            ("capybara_tcp_segments_sent_total", tc.segments_out),
            ("capybara_tcp_resets_sent_total", tc.resets_sent),
            ("capybara_tcp_resets_received_total", tc.resets_received),
            (
                "capybara_tcp_zero_window_probes_total",
                tc.zero_window_probes,
            ),
            ("capybara_tcp_keepalive_probes_total", tc.keepalive_probes),
            (
                "capybara_tcp_connections_passive_total",
                tc.connections_passive,
            ),
            (
                "capybara_tcp_connections_active_total",
                tc.connections_active,
            ),
            (
                "capybara_tcp_connections_timed_out_total",
                tc.connections_timed_out,
            ),
        ] {
            let _ = writeln!(s, "# TYPE {metric} counter\n{metric}{{{l}}} {v}");
        }
        let _ = writeln!(s, "# TYPE capybara_tcp_retransmits_total counter");
        let _ = writeln!(
            s,
            "capybara_tcp_retransmits_total{{{l},kind=\"timeout\"}} {}",
            tc.retransmits_timeout
        );
        let _ = writeln!(
            s,
            "capybara_tcp_retransmits_total{{{l},kind=\"fast\"}} {}",
            tc.retransmits_fast
        );
        let _ = writeln!(s, "# TYPE capybara_tcp_segment_drops_total counter");
        let d = &tc.drops;
        for (reason, n) in [
            ("bad_checksum", d.bad_checksum),
            ("malformed", d.malformed),
            ("no_listener", d.no_listener),
            ("out_of_window", d.out_of_window),
            ("paws", d.paws),
            ("backlog_full", d.backlog_full),
            ("bad_ack", d.bad_ack),
            ("reassembly_full", d.reassembly_full),
            ("unexpected", d.unexpected),
            ("rst_queue_full", d.rst_queue_full),
            ("recently_closed", d.recently_closed),
            ("reset_held", d.reset_held),
        ] {
            let _ = writeln!(
                s,
                "capybara_tcp_segment_drops_total{{{l},reason=\"{reason}\"}} {n}"
            );
        }
        let _ = writeln!(s, "# TYPE capybara_tcp_connections gauge");
        for (state, n) in i.transports.tcp.connections_by_state() {
            let _ = writeln!(s, "capybara_tcp_connections{{{l},state=\"{state:?}\"}} {n}");
        }
        if let Some(m) = i.transports.mig.as_ref() {
            let c = m.engine.counters();
            let _ = writeln!(s, "# TYPE capybara_tcpmig_events_total counter");
            for (what, v) in [
                ("migrated_out", c.migrated_out),
                ("migrated_in", c.migrated_in),
                ("resumed", c.resumed),
                ("lost", c.lost),
                ("retransmissions", c.retransmissions),
                ("duplicates", c.duplicates),
                ("unexpected", c.unexpected),
                ("malformed", c.malformed),
                ("bad_mac", c.bad_mac),
                ("bad_version", c.bad_version),
                ("epoch_table_full", c.epoch_table_full),
                ("rejects_sent", c.rejects_sent),
                ("rejects_received", c.rejects_received),
                ("aborts_sent", c.aborts_sent),
                ("aborts_received", c.aborts_received),
                ("segments_buffered", c.segments_buffered),
                ("segments_dropped", c.segments_dropped),
                ("tx_queue_full", c.tx_queue_full),
            ] {
                let _ = writeln!(
                    s,
                    "capybara_tcpmig_events_total{{{l},event=\"{what}\"}} {v}"
                );
            }
            // MIGRATION_REPORTs to the switch: queued, dropped (queue full).
            let _ = writeln!(
                s,
                "# TYPE capybara_migration_reports_pending gauge\ncapybara_migration_reports_pending{{{l}}} {}\n# TYPE capybara_migration_reports_dropped_total counter\ncapybara_migration_reports_dropped_total{{{l}}} {}",
                m.reports_pending(),
                m.reports_dropped
            );
            // Late segments at the origin (docs/MIGRATION.md): forwarded to
            // the migration's target, or dropped (TTL: no loops; other:
            // queue full, no route; frozen/gone: target not known).
            let f = i.transports.forwarder.borrow();
            let _ = writeln!(s, "# TYPE capybara_late_segments_total counter");
            for (what, v) in [
                ("forwarded", f.forwarded),
                ("ttl_dropped", f.ttl_drops),
                ("forward_dropped", f.other_drops),
                ("dropped_frozen", m.dropped_frozen),
                ("dropped_gone", m.dropped_gone),
            ] {
                let _ = writeln!(
                    s,
                    "capybara_late_segments_total{{{l},outcome=\"{what}\"}} {v}"
                );
            }
            // Failure handling (docs/TCPMIG.md §1.7 rule 8, MIGRATION.md):
            // clients reset when their migration was lost; migrations
            // refused as too large before anything was frozen.
            let _ = writeln!(
                s,
                "# TYPE capybara_migration_lost_resets_total counter\ncapybara_migration_lost_resets_total{{{l}}} {}\n# TYPE capybara_migration_too_large_before_export_total counter\ncapybara_migration_too_large_before_export_total{{{l}}} {}",
                m.lost_resets,
                m.too_large_before_export
            );
            // Connections the switch still routed here after they migrated
            // out, whose owner this host told it (SET_OWNER).
            let _ = writeln!(
                s,
                "# TYPE capybara_migration_owner_repairs_total counter\ncapybara_migration_owner_repairs_total{{{l}}} {}",
                m.owner_repairs_total
            );
        }
        crate::policy::render_metrics(i, &l, &mut s);
        crate::sidecar::render_metrics(&l, &mut s);
        if let Some(h) = &i.transports.health {
            h.render_metrics(&l, &mut s);
            if !h.checks.is_empty() {
                // The migration of down services' connections (the run
                // under way, or the last one).
                let p = i.transports.health_drain.progress();
                for (name, v) in [
                    ("active", u64::from(p.active)),
                    ("migrated", p.migrated as u64),
                    ("remaining", p.remaining as u64),
                ] {
                    let _ = writeln!(
                        s,
                        "# TYPE capybara_health_drain_{name} gauge\ncapybara_health_drain_{name}{{{l}}} {v}"
                    );
                }
            }
        }
        i.wake
            .render(&mut s, &l, i.device.rx_delay(), i.device.tx_kick());
        s
    })
}

/// Serves `GET /metrics` on a kernel TCP listener.
pub async fn serve(listener: tokio::net::TcpListener, stack: Stack, name: std::rc::Rc<str>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let body = render(&stack, &name);
        tokio::task::spawn_local(async move {
            let mut req = [0u8; 1024];
            let _ =
                tokio::time::timeout(std::time::Duration::from_secs(2), sock.read(&mut req)).await;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}
