//! One conformance suite, run unchanged against both backends: a real
//! SQLite file and a real etcd started by the harness. Every case is a
//! function of `&Fixture`; the `conformance!` macro instantiates each for
//! both backends (`sqlite::case` and `etcd::case`).

mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use capybara_proto::flow::{FlowKey, ServerId};
use capybara_store::*;
use support::*;

const WAIT: Duration = Duration::from_secs(5);

fn server(id: u32) -> Server {
    Server::new(
        ServerId(id),
        format!("server-{id}"),
        format!("10.0.0.{}:7000", id % 250).parse().unwrap(),
        Ipv4Addr::new(10, 1, 0, (id % 250) as u8),
    )
}

fn flow(i: u32) -> FlowKey {
    FlowKey {
        client_ip: Ipv4Addr::from(0x0a64_0000 + (i >> 14)),
        client_port: 1024 + (i & 0x3fff) as u16,
        service_ip: Ipv4Addr::new(192, 168, 0, 1),
        service_port: 443,
    }
}

fn service(name: &str, pool: &[u32]) -> Service {
    Service {
        name: name.into(),
        vip: Ipv4Addr::new(192, 168, 0, 1),
        port: 443,
        pool: pool.iter().map(|&i| ServerId(i)).collect(),
    }
}

fn drain(id: u32) -> Drain {
    Drain {
        server: ServerId(id),
        targets: vec![ServerId(1), ServerId(2)],
        started_unix_ms: 1_000,
        deadline_unix_ms: 61_000,
        state: DrainState::Running,
        progress: DrainProgress {
            flows_total: 10,
            flows_remaining: 10,
            ..Default::default()
        },
    }
}

fn audit(action: &str) -> AuditRecord {
    AuditRecord {
        actor: "tester".into(),
        action: action.into(),
        target: "s1".into(),
        detail: serde_json::json!({"k": 1}),
    }
}

mod cases {
    use super::*;

    pub async fn servers_crud(f: &Fixture) {
        let s = &f.store;
        assert_eq!(s.get_server(ServerId(1)).await.unwrap(), None);
        assert!(s.list_servers().await.unwrap().is_empty());
        for id in [3, 1, 20, 2] {
            s.put_server(&server(id)).await.unwrap();
        }
        let ids: Vec<u32> = s
            .list_servers()
            .await
            .unwrap()
            .iter()
            .map(|s| s.id.0)
            .collect();
        assert_eq!(ids, vec![1, 2, 3, 20], "ordered by id");
        let mut want = server(3);
        let got = s.get_server(ServerId(3)).await.unwrap().unwrap();
        want.registered_unix_ms = got.registered_unix_ms;
        want.updated_unix_ms = got.updated_unix_ms;
        assert_eq!(got, want);
        // Replace.
        let mut s3 = server(3);
        s3.name = "renamed".into();
        s.put_server(&s3).await.unwrap();
        assert_eq!(
            f.second
                .get_server(ServerId(3))
                .await
                .unwrap()
                .unwrap()
                .name,
            "renamed"
        );
        assert!(s.delete_server(ServerId(3)).await.unwrap());
        assert!(!s.delete_server(ServerId(3)).await.unwrap());
        assert_eq!(s.get_server(ServerId(3)).await.unwrap(), None);
    }

    /// A server record's instance id and REGISTER seq (what a standby that
    /// takes over tells a restarted hostagent by) round-trip exactly, the
    /// full 64 bits, through both handles, and survive the state and weight
    /// read-modify-writes; a record without them reads back without them.
    pub async fn server_instance_roundtrip(f: &Fixture) {
        let s = &f.store;
        let mut rec = server(4);
        rec.data_mac = Some("02:00:00:00:00:04".into());
        rec.instance = Some(0xfedc_ba98_7654_3211);
        rec.register_seq = Some(1_763_800_000_123_456);
        s.put_server(&rec).await.unwrap();
        s.put_server(&server(5)).await.unwrap();
        let got = f.second.get_server(ServerId(4)).await.unwrap().unwrap();
        assert_eq!(
            (got.instance, got.register_seq),
            (rec.instance, rec.register_seq)
        );
        s.set_server_state(ServerId(4), ServerState::Dead)
            .await
            .unwrap();
        s.set_server_weight(ServerId(4), 3).await.unwrap();
        let listed = f.second.list_servers().await.unwrap();
        let got = listed.iter().find(|r| r.id == ServerId(4)).unwrap();
        assert_eq!(
            (got.state, got.weight, got.instance, got.register_seq),
            (ServerState::Dead, 3, rec.instance, rec.register_seq)
        );
        let plain = listed.iter().find(|r| r.id == ServerId(5)).unwrap();
        assert_eq!((plain.instance, plain.register_seq), (None, None));
        // Replaced by a REGISTER from a hostagent without an instance id.
        s.put_server(&server(4)).await.unwrap();
        let got = s.get_server(ServerId(4)).await.unwrap().unwrap();
        assert_eq!((got.instance, got.register_seq), (None, None));
    }

    pub async fn seq_floors_raise_per_instance(f: &Fixture) {
        let s = &f.store;
        let floor = |id: u32, instance: u64, seq: u64| SeqFloor {
            server: ServerId(id),
            instance,
            seq,
        };
        // Servers watchers must not see floor writes as server changes.
        let mut w = f.second.watch(&[WatchKind::Servers]).await.unwrap();
        assert_eq!(s.seq_floors().await.unwrap(), vec![]);
        s.raise_seq_floors(&[floor(2, 7, 100), floor(1, 9, 50)])
            .await
            .unwrap();
        assert_eq!(
            f.second.seq_floors().await.unwrap(),
            vec![floor(1, 9, 50), floor(2, 7, 100)]
        );
        // Same instance: never lowered; raised.
        s.raise_seq_floors(&[floor(2, 7, 90), floor(1, 9, 60)])
            .await
            .unwrap();
        assert_eq!(
            s.seq_floors().await.unwrap(),
            vec![floor(1, 9, 60), floor(2, 7, 100)]
        );
        // Another instance (the server restarted): replaced, even if lower.
        f.second.raise_seq_floors(&[floor(2, 8, 10)]).await.unwrap();
        assert_eq!(
            s.seq_floors().await.unwrap(),
            vec![floor(1, 9, 60), floor(2, 8, 10)]
        );
        // Instance ids are random u64s: the upper half is kept too (SQLite
        // once refused ids above i64::MAX, so most hostagents' floors were
        // never stored).
        s.raise_seq_floors(&[floor(3, u64::MAX, 5), floor(4, 1 << 63, 6)])
            .await
            .unwrap();
        assert_eq!(
            f.second.seq_floors().await.unwrap()[2..],
            [floor(3, u64::MAX, 5), floor(4, 1 << 63, 6)]
        );
        // Out of the store's range: a clear error, nothing written.
        let e = s
            .raise_seq_floors(&[floor(1, 9, u64::MAX)])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("seq"), "{e}");
        assert_eq!(s.seq_floors().await.unwrap()[0], floor(1, 9, 60));
        no_event(&mut w, Duration::from_millis(300)).await;
        // Deleting the server deletes its floor.
        s.put_server(&server(2)).await.unwrap();
        assert!(s.delete_server(ServerId(2)).await.unwrap());
        assert_eq!(
            s.seq_floors().await.unwrap(),
            vec![floor(1, 9, 60), floor(3, u64::MAX, 5), floor(4, 1 << 63, 6)]
        );
    }

    pub async fn server_state_and_weight(f: &Fixture) {
        let s = &f.store;
        s.put_server(&server(7)).await.unwrap();
        for st in [
            ServerState::Draining,
            ServerState::Drained,
            ServerState::Dead,
            ServerState::Active,
        ] {
            let got = s.set_server_state(ServerId(7), st).await.unwrap();
            assert_eq!(got.state, st);
            assert_eq!(
                f.second
                    .get_server(ServerId(7))
                    .await
                    .unwrap()
                    .unwrap()
                    .state,
                st
            );
        }
        assert!(
            !s.get_server(ServerId(7)).await.unwrap().unwrap().weight_set,
            "a put record's weight is not the operator's"
        );
        let got = s.set_server_weight(ServerId(7), 42).await.unwrap();
        assert_eq!(got.weight, 42);
        assert!(got.weight_set, "set_server_weight marks the operator's");
        assert_eq!(got.state, ServerState::Active, "weight change keeps state");
        let stored = s.get_server(ServerId(7)).await.unwrap().unwrap();
        assert_eq!((stored.weight, stored.weight_set), (42, true));
        let got = s.set_server_weight(ServerId(7), 0).await.unwrap();
        assert_eq!((got.weight, got.weight_set), (0, true), "0 is a weight");
        let e = s
            .set_server_state(ServerId(99), ServerState::Dead)
            .await
            .unwrap_err();
        assert!(
            matches!(e, StoreError::NotFound { kind: "server", .. }),
            "{e}"
        );
        let e = s.set_server_weight(ServerId(99), 1).await.unwrap_err();
        assert!(e.to_string().contains("s99"), "{e}");
    }

    pub async fn services_crud(f: &Fixture) {
        let s = &f.store;
        s.put_service(&service("web", &[1, 2])).await.unwrap();
        s.put_service(&service("api", &[3])).await.unwrap();
        let names: Vec<String> = s
            .list_services()
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(names, vec!["api", "web"]);
        assert_eq!(
            f.second.get_service("web").await.unwrap(),
            Some(service("web", &[1, 2]))
        );
        s.put_service(&service("web", &[1, 2, 4])).await.unwrap();
        assert_eq!(s.get_service("web").await.unwrap().unwrap().pool.len(), 3);
        assert!(s.delete_service("web").await.unwrap());
        assert!(!s.delete_service("web").await.unwrap());
        assert_eq!(s.get_service("web").await.unwrap(), None);
        let e = s.put_service(&service("bad/name", &[])).await.unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Invalid {
                    what: "service name",
                    ..
                }
            ),
            "{e}"
        );
        assert!(s.get_service("").await.is_err());
    }

    /// The seeded marks of configured services (what keeps a service
    /// deleted through the API from being seeded again): idempotent,
    /// shared by every handle, kept when the service is deleted, never
    /// seen by watchers, names checked like service names.
    pub async fn seeded_marks(f: &Fixture) {
        let s = &f.store;
        let names = |v: &[&str]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let mut w = f.second.watch(&[WatchKind::Services]).await.unwrap();
        assert_eq!(s.seeded_services().await.unwrap(), Vec::<String>::new());
        s.mark_seeded(&[]).await.unwrap();
        s.mark_seeded(&names(&["web", "echo"])).await.unwrap();
        f.second
            .mark_seeded(&names(&["web", "cache", "web"]))
            .await
            .unwrap();
        assert_eq!(
            f.second.seeded_services().await.unwrap(),
            names(&["cache", "echo", "web"])
        );
        no_event(&mut w, Duration::from_millis(300)).await;
        // A mark is no service, and deleting the service keeps the mark.
        assert!(s.list_services().await.unwrap().is_empty());
        s.put_service(&service("web", &[1])).await.unwrap();
        assert!(s.delete_service("web").await.unwrap());
        assert_eq!(
            s.seeded_services().await.unwrap(),
            names(&["cache", "echo", "web"])
        );
        // A bad name: refused, nothing of the batch written.
        let e = s
            .mark_seeded(&names(&["api", "bad/name"]))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Invalid {
                    what: "service name",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(
            s.seeded_services().await.unwrap(),
            names(&["cache", "echo", "web"])
        );
        // Many at once (more than one etcd transaction's worth).
        let many: Vec<String> = (0..1200).map(|i| format!("svc-{i:04}")).collect();
        s.mark_seeded(&many).await.unwrap();
        let got = f.second.seeded_services().await.unwrap();
        assert_eq!(got.len(), 1203);
        assert!(got.windows(2).all(|p| p[0] < p[1]), "sorted");
    }

    /// A deleted service is recorded as retiring in the delete's
    /// transaction (what lets a restarted or standby switchd keep its open
    /// connections): the record is the service as it was, seen by every
    /// handle, not watched; a later delete of the name replaces it; a
    /// forget removes only the exact record.
    pub async fn retiring_records(f: &Fixture) {
        let s = &f.store;
        let mut w = f.second.watch(&[WatchKind::Services]).await.unwrap();
        assert!(s.list_retiring_services().await.unwrap().is_empty());
        assert!(!s.delete_service("web").await.unwrap());
        assert!(s.list_retiring_services().await.unwrap().is_empty());
        s.put_service(&service("web", &[1, 2])).await.unwrap();
        s.put_service(&service("api", &[3])).await.unwrap();
        for _ in 0..2 {
            assert!(matches!(
                next_event(&mut w, WAIT).await.change,
                Change::ServicePut(_)
            ));
        }
        let before = unix_ms_now();
        assert!(s.delete_service("web").await.unwrap());
        let after = unix_ms_now();
        // The delete is watched; its retiring record is not.
        assert_eq!(
            next_event(&mut w, WAIT).await.change,
            Change::ServiceDeleted("web".into())
        );
        no_event(&mut w, Duration::from_millis(300)).await;
        let got = f.second.list_retiring_services().await.unwrap();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].service, service("web", &[1, 2]));
        let first = got[0].deleted_unix_ms;
        assert!(
            (before..=after).contains(&first),
            "{first} not in [{before}, {after}]"
        );
        assert_eq!(s.get_service("web").await.unwrap(), None);
        assert!(!s.delete_service("web").await.unwrap(), "deleted twice");
        assert_eq!(s.list_retiring_services().await.unwrap(), got);

        // Created again (the record stays: switchd forgets it), deleted
        // again at the same address: the newer record replaces the older
        // one.
        tokio::time::sleep(Duration::from_millis(5)).await;
        s.put_service(&service("web", &[4])).await.unwrap();
        assert_eq!(s.list_retiring_services().await.unwrap(), got);
        assert!(s.delete_service("web").await.unwrap());
        assert!(f.second.delete_service("api").await.unwrap());
        let got = s.list_retiring_services().await.unwrap();
        let names: Vec<&str> = got.iter().map(|r| r.service.name.as_str()).collect();
        assert_eq!(names, ["api", "web"], "ordered by name");
        assert_eq!(got[0].service, service("api", &[3]));
        assert_eq!(got[1].service, service("web", &[4]));
        let second = got[1].deleted_unix_ms;
        assert!(second > first, "{second} after {first}");

        // Forget: only the exact record.
        let at = got[1].addr();
        assert!(!s.forget_retiring_service("web", at, first).await.unwrap());
        assert_eq!(s.list_retiring_services().await.unwrap().len(), 2);
        let elsewhere = std::net::SocketAddrV4::new(*at.ip(), 444);
        assert!(!s
            .forget_retiring_service("web", elsewhere, second)
            .await
            .unwrap());
        assert!(f
            .second
            .forget_retiring_service("web", at, second)
            .await
            .unwrap());
        assert!(!s.forget_retiring_service("web", at, second).await.unwrap());
        assert!(!s.forget_retiring_service("nope", at, 1).await.unwrap());
        assert!(!s
            .forget_retiring_service("api", at, u64::MAX)
            .await
            .unwrap());
        let left = s.list_retiring_services().await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].service.name, "api");
        let e = s
            .forget_retiring_service("bad/name", at, 1)
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Invalid {
                    what: "service name",
                    ..
                }
            ),
            "{e}"
        );
    }

    /// A service moved to another VIP:port retires its old address: the
    /// update records it as retiring in its own transaction, one record per
    /// name and address, so two moves then a delete keep all three
    /// addresses (one record per name overwrote them); an update that
    /// keeps the address records nothing; a forget removes exactly the one
    /// record.
    pub async fn retiring_records_per_address(f: &Fixture) {
        let s = &f.store;
        let at = |port: u16| Service {
            port,
            ..service("web", &[1, 2])
        };
        let addrs = |rs: &[RetiringService]| -> Vec<(String, u16)> {
            rs.iter()
                .map(|r| (r.service.name.clone(), r.service.port))
                .collect()
        };
        s.put_service(&at(80)).await.unwrap();
        // Same address, another pool: nothing retires.
        s.put_service(&Service {
            pool: vec![ServerId(3)],
            ..at(80)
        })
        .await
        .unwrap();
        s.put_service(&at(80)).await.unwrap();
        assert!(s.list_retiring_services().await.unwrap().is_empty());
        let mut w = f.second.watch(&[WatchKind::Services]).await.unwrap();

        let before = unix_ms_now();
        s.put_service(&at(81)).await.unwrap();
        let after = unix_ms_now();
        // The update is watched; its retiring record is not, and is there
        // as soon as the update returned, seen by another handle.
        assert_eq!(
            next_event(&mut w, WAIT).await.change,
            Change::ServicePut(at(81))
        );
        no_event(&mut w, Duration::from_millis(300)).await;
        let got = f.second.list_retiring_services().await.unwrap();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].service, at(80), "the service as it was");
        assert_eq!(got[0].addr().port(), 80);
        let t80 = got[0].deleted_unix_ms;
        assert!((before..=after).contains(&t80), "{t80}");
        assert_eq!(s.get_service("web").await.unwrap(), Some(at(81)));

        // Moved again, another VIP this time, then deleted: every retired
        // address is kept.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let other_vip = Service {
            vip: Ipv4Addr::new(192, 168, 0, 2),
            ..at(81)
        };
        f.second.put_service(&other_vip).await.unwrap();
        s.put_service(&service("api", &[3])).await.unwrap();
        assert!(s.delete_service("web").await.unwrap());
        let got = s.list_retiring_services().await.unwrap();
        assert_eq!(
            addrs(&got),
            [
                ("web".to_string(), 80),
                ("web".to_string(), 81),
                ("web".to_string(), 81)
            ],
            "ordered by name, then address: {got:?}"
        );
        assert_eq!(got[0].service, at(80));
        assert_eq!(got[1].service, at(81));
        assert_eq!(got[2].service, other_vip);
        assert!(got[0].deleted_unix_ms <= got[1].deleted_unix_ms);
        assert!(got[1].deleted_unix_ms <= got[2].deleted_unix_ms);
        assert_eq!(f.second.list_retiring_services().await.unwrap(), got);

        // Created again at the first address and moved away again: that
        // address's record is replaced by the newer one, the others stay.
        tokio::time::sleep(Duration::from_millis(5)).await;
        s.put_service(&at(80)).await.unwrap();
        s.put_service(&at(82)).await.unwrap();
        let again = s.list_retiring_services().await.unwrap();
        assert_eq!(again.len(), 3, "{again:?}");
        assert_eq!(again[0].addr(), got[0].addr());
        assert!(again[0].deleted_unix_ms > got[0].deleted_unix_ms);
        assert_eq!(&again[1..], &got[1..]);

        // Forget: exactly the record named by name, address and time.
        let r = &again[1];
        assert!(!s
            .forget_retiring_service("web", again[0].addr(), r.deleted_unix_ms)
            .await
            .unwrap());
        assert!(f
            .second
            .forget_retiring_service("web", r.addr(), r.deleted_unix_ms)
            .await
            .unwrap());
        assert!(!s
            .forget_retiring_service("web", r.addr(), r.deleted_unix_ms)
            .await
            .unwrap());
        let left = s.list_retiring_services().await.unwrap();
        assert_eq!(left, vec![again[0].clone(), again[2].clone()]);
        // The live service and the other name are untouched.
        assert_eq!(s.get_service("web").await.unwrap(), Some(at(82)));
        assert_eq!(
            s.get_service("api").await.unwrap(),
            Some(service("api", &[3]))
        );
    }

    /// switchd writes a REGISTER's server record while an operator sets
    /// weights through another handle (the API): the record keeps every
    /// operator weight the moment it was set (the merge happens inside the
    /// store's read-modify-write; a read then a write lost the ones set in
    /// between), and keeps the REGISTER's weight to go back to when the
    /// operator's is cleared.
    pub async fn registered_server_keeps_concurrent_operator_weights(f: &Fixture) {
        let id = ServerId(9);
        let mut reg = server(9);
        reg.weight = 3;
        let first = f.second.put_registered_server(&reg).await.unwrap();
        assert_eq!(
            (first.weight, first.weight_set, first.register_weight),
            (3, false, None)
        );
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (store, stop) = (f.second.clone(), stop.clone());
            let reg = reg.clone();
            tokio::spawn(async move {
                let mut n = 0u32;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) && n < 100_000 {
                    let got = store.put_registered_server(&reg).await.unwrap();
                    assert_eq!(got.register_weight.unwrap_or(got.weight), 3);
                    n += 1;
                }
                n
            })
        };
        let mut lost = Vec::new();
        for w in 10..130u32 {
            f.store.set_server_weight(id, w).await.unwrap();
            // Give the REGISTER writer a chance to write over it.
            tokio::task::yield_now().await;
            let got = f.store.get_server(id).await.unwrap().unwrap();
            if (got.weight, got.weight_set) != (w, true) {
                lost.push((w, got.weight, got.weight_set));
            }
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let writes = writer.await.unwrap();
        assert!(writes > 0, "the REGISTER writer ran");
        assert!(
            lost.is_empty(),
            "operator weights lost to {writes} REGISTER writes: (set, read, weight_set) {lost:?}"
        );
        let got = f.store.get_server(id).await.unwrap().unwrap();
        assert_eq!(
            (got.weight, got.weight_set, got.register_weight),
            (129, true, Some(3))
        );

        // Cleared: back to the REGISTER's weight; a REGISTER then writes
        // its own, no longer the operator's.
        let cleared = f.store.clear_server_weight(id).await.unwrap();
        assert_eq!(
            (cleared.weight, cleared.weight_set, cleared.register_weight),
            (3, false, None)
        );
        assert_eq!(f.second.get_server(id).await.unwrap().unwrap(), cleared);
        reg.weight = 5;
        let got = f.second.put_registered_server(&reg).await.unwrap();
        assert_eq!((got.weight, got.weight_set), (5, false));
        // A record the caller marks as the operator's replaces the stored
        // weight (`POST /v1/servers` with a weight goes through put_server).
        let mut own = reg.clone();
        own.weight = 7;
        own.weight_set = true;
        let got = f.second.put_registered_server(&own).await.unwrap();
        assert_eq!((got.weight, got.weight_set), (7, true));
        // Clearing with no REGISTER weight known keeps the number.
        let got = f.store.clear_server_weight(id).await.unwrap();
        assert_eq!((got.weight, got.weight_set), (7, false));
        let e = f.store.clear_server_weight(ServerId(99)).await.unwrap_err();
        assert!(
            matches!(e, StoreError::NotFound { kind: "server", .. }),
            "{e}"
        );
    }

    pub async fn policy_default_roundtrip_and_validation(f: &Fixture) {
        let s = &f.store;
        assert_eq!(s.get_policy().await.unwrap(), Policy::default());
        let p = Policy {
            proactive_threshold_pct: 25.0,
            reactive_enabled: false,
            target_selection: TargetSelection::LeastLoaded,
            placement: Placement::Lwrr,
            buffer_mode: BufferMode::Drop,
            load_notification_interval_us: 500,
            ..Policy::default()
        };
        s.put_policy(&p).await.unwrap();
        assert_eq!(f.second.get_policy().await.unwrap(), p);
        let bad = Policy {
            dead_after_ms: 10,
            ..Policy::default()
        };
        match s.put_policy(&bad).await {
            Err(StoreError::InvalidPolicy(PolicyError { field, .. })) => {
                assert_eq!(field, "dead_after_ms")
            }
            other => panic!("expected InvalidPolicy, got {other:?}"),
        }
        assert_eq!(
            s.get_policy().await.unwrap(),
            p,
            "rejected policy not stored"
        );
    }

    /// switchd's seed: written only into a store that holds no policy,
    /// seen by watchers like any policy write; a stored policy is kept.
    pub async fn policy_put_if_absent(f: &Fixture) {
        let mut w = f.store.watch(&[WatchKind::Policy]).await.unwrap();
        let seed = Policy {
            heartbeat_interval_ms: 20,
            dead_after_ms: 150,
            ..Policy::default()
        };
        let bad = Policy {
            dead_after_ms: 10,
            ..Policy::default()
        };
        match f.second.put_policy_if_absent(&bad).await {
            Err(StoreError::InvalidPolicy(PolicyError { field, .. })) => {
                assert_eq!(field, "dead_after_ms")
            }
            other => panic!("expected InvalidPolicy, got {other:?}"),
        }
        assert!(
            f.second.put_policy_if_absent(&seed).await.unwrap(),
            "absent: written"
        );
        assert_eq!(f.store.get_policy().await.unwrap(), seed);
        assert_eq!(
            next_event(&mut w, WAIT).await.change,
            Change::PolicyPut(seed.clone())
        );
        // Present (another switchd's seed, or the operator's): kept.
        let other = Policy {
            heartbeat_interval_ms: 100,
            dead_after_ms: 500,
            ..Policy::default()
        };
        assert!(!f.store.put_policy_if_absent(&other).await.unwrap());
        assert_eq!(f.second.get_policy().await.unwrap(), seed);
        let op = Policy {
            migration_deadline_ms: 80,
            ..seed.clone()
        };
        f.store.put_policy(&op).await.unwrap();
        assert!(!f.second.put_policy_if_absent(&other).await.unwrap());
        assert_eq!(f.store.get_policy().await.unwrap(), op);
        assert_eq!(next_event(&mut w, WAIT).await.change, Change::PolicyPut(op));
        no_event(&mut w, Duration::from_millis(300)).await;
    }

    pub async fn flows_batch_semantics(f: &Fixture) {
        let s = &f.store;
        let ops = vec![
            FlowOp::Put {
                key: flow(1),
                server: ServerId(1),
            },
            FlowOp::Put {
                key: flow(2),
                server: ServerId(1),
            },
            FlowOp::Put {
                key: flow(3),
                server: ServerId(2),
            },
            // Last op per flow wins within a batch.
            FlowOp::Put {
                key: flow(2),
                server: ServerId(2),
            },
            FlowOp::Delete { key: flow(3) },
            FlowOp::Put {
                key: flow(3),
                server: ServerId(3),
            },
            FlowOp::Put {
                key: flow(4),
                server: ServerId(1),
            },
            FlowOp::Delete { key: flow(4) },
            FlowOp::Delete { key: flow(999) },
        ];
        s.apply_flows(&ops).await.unwrap();
        s.apply_flows(&[]).await.unwrap();
        assert_eq!(s.get_flow(&flow(1)).await.unwrap(), Some(ServerId(1)));
        assert_eq!(s.get_flow(&flow(2)).await.unwrap(), Some(ServerId(2)));
        assert_eq!(s.get_flow(&flow(3)).await.unwrap(), Some(ServerId(3)));
        assert_eq!(s.get_flow(&flow(4)).await.unwrap(), None);
        assert_eq!(s.count_flows().await.unwrap(), 3);
        assert_eq!(
            f.second.list_flows_by_server(ServerId(1)).await.unwrap(),
            vec![flow(1)]
        );
        assert_eq!(
            s.list_flows_by_server(ServerId(2)).await.unwrap(),
            vec![flow(2)]
        );
        assert!(s
            .list_flows_by_server(ServerId(9))
            .await
            .unwrap()
            .is_empty());
        let scan = s.scan_flows().await.unwrap();
        assert_eq!(
            scan,
            vec![
                FlowMapping {
                    key: flow(1),
                    server: ServerId(1)
                },
                FlowMapping {
                    key: flow(2),
                    server: ServerId(2)
                },
                FlowMapping {
                    key: flow(3),
                    server: ServerId(3)
                },
            ]
        );
        // A later batch moves and ends flows.
        s.apply_flows(&[
            FlowOp::Put {
                key: flow(1),
                server: ServerId(5),
            },
            FlowOp::Delete { key: flow(2) },
        ])
        .await
        .unwrap();
        assert_eq!(s.get_flow(&flow(1)).await.unwrap(), Some(ServerId(5)));
        assert_eq!(s.count_flows().await.unwrap(), 2);
    }

    pub async fn flows_large_batch_and_scan(f: &Fixture) {
        let s = &f.store;
        let n = 25_000u32;
        let ops: Vec<FlowOp> = (0..n)
            .map(|i| FlowOp::Put {
                key: flow(i),
                server: ServerId(i % 4),
            })
            .collect();
        s.apply_flows(&ops).await.unwrap();
        assert_eq!(s.count_flows().await.unwrap(), u64::from(n));
        let scan = f.second.scan_flows().await.unwrap();
        assert_eq!(scan.len(), n as usize);
        assert!(
            scan.windows(2).all(|w| w[0].key < w[1].key),
            "scan ordered by key"
        );
        assert!(scan
            .iter()
            .all(|m| m.server == ServerId(flow_index(&m.key) % 4)));
        let on2 = s.list_flows_by_server(ServerId(2)).await.unwrap();
        assert_eq!(on2.len(), (n / 4) as usize);
        let dels: Vec<FlowOp> = (0..n)
            .step_by(2)
            .map(|i| FlowOp::Delete { key: flow(i) })
            .collect();
        s.apply_flows(&dels).await.unwrap();
        assert_eq!(s.count_flows().await.unwrap(), u64::from(n / 2));
    }

    fn flow_index(k: &FlowKey) -> u32 {
        ((u32::from(k.client_ip) - 0x0a64_0000) << 14) + u32::from(k.client_port - 1024)
    }

    pub async fn drains_crud_and_progress(f: &Fixture) {
        let s = &f.store;
        assert_eq!(s.get_drain(ServerId(4)).await.unwrap(), None);
        s.put_drain(&drain(4)).await.unwrap();
        s.put_drain(&drain(2)).await.unwrap();
        let ids: Vec<u32> = s
            .list_drains()
            .await
            .unwrap()
            .iter()
            .map(|d| d.server.0)
            .collect();
        assert_eq!(ids, vec![2, 4]);
        let p = DrainProgress {
            flows_total: 10,
            flows_migrated: 7,
            flows_closed: 1,
            flows_remaining: 2,
        };
        let d = s
            .update_drain(ServerId(4), p, DrainState::Running)
            .await
            .unwrap();
        assert_eq!(d.progress, p);
        assert_eq!(d.deadline_unix_ms, 61_000, "update keeps deadline");
        let d = f.second.get_drain(ServerId(4)).await.unwrap().unwrap();
        assert_eq!(d.progress, p);
        let done = DrainProgress {
            flows_migrated: 9,
            flows_remaining: 0,
            ..p
        };
        assert_eq!(
            s.update_drain(ServerId(4), done, DrainState::Completed)
                .await
                .unwrap()
                .state,
            DrainState::Completed
        );
        let e = s
            .update_drain(ServerId(77), p, DrainState::Running)
            .await
            .unwrap_err();
        assert!(
            matches!(e, StoreError::NotFound { kind: "drain", .. }),
            "{e}"
        );
        assert!(s.delete_drain(ServerId(4)).await.unwrap());
        assert!(!s.delete_drain(ServerId(4)).await.unwrap());
        assert_eq!(s.list_drains().await.unwrap().len(), 1);
    }

    /// A store a previous version wrote, drains in the server records
    /// (`draining` / `drained`, with or without a `Drain` record), reads
    /// as drained before and after `upgrade_legacy_drain_states`, which
    /// moves them into `Drain` records and leaves liveness in the records;
    /// a REGISTER then cannot undo them. Idempotent.
    pub async fn legacy_drain_states_move_to_drain_records(f: &Fixture) {
        let s = &f.store;
        use DrainState::*;
        use ServerState::*;
        // (id, record state, stored drain)
        let old = [
            (1, Active, None),
            (2, Drained, None),
            (3, Draining, Some(Running)),
            (4, Draining, None),
            (5, Drained, Some(Cancelled)),
            (6, Dead, None),
            (7, Drained, Some(Completed)),
        ];
        for (id, st, d) in old {
            s.put_server(&server(id)).await.unwrap();
            s.set_server_state(ServerId(id), st).await.unwrap();
            if let Some(d) = d {
                s.put_drain(&Drain {
                    state: d,
                    ..drain(id)
                })
                .await
                .unwrap();
            }
        }
        let shown = || async {
            let mut out = Vec::new();
            for id in 1..=7 {
                let rec = f.second.get_server(ServerId(id)).await.unwrap().unwrap();
                let d = f.second.get_drain(ServerId(id)).await.unwrap();
                out.push(shown_state(&rec, d.map(|d| d.state)));
            }
            out
        };
        let want = vec![Active, Drained, Draining, Draining, Drained, Dead, Drained];
        assert_eq!(shown().await, want, "read before the upgrade");
        let moved = upgrade_legacy_drain_states(s.as_ref()).await.unwrap();
        assert_eq!(moved, [2, 3, 4, 5, 7].map(ServerId).to_vec());
        assert_eq!(shown().await, want, "read after the upgrade");
        for id in 1..=7 {
            let rec = s.get_server(ServerId(id)).await.unwrap().unwrap();
            let want = if id == 6 { Dead } else { Active };
            assert_eq!(rec.state, want, "server {id}: liveness only");
        }
        let d = |id| async move { s.get_drain(ServerId(id)).await.unwrap().unwrap() };
        assert_eq!(d(3).await, drain(3), "a running drain is kept as it is");
        assert_eq!(d(7).await.started_unix_ms, 1_000, "kept");
        assert_eq!((d(2).await.state, d(4).await.state), (Completed, TimedOut));
        assert_eq!((d(5).await.state, d(5).await.targets), (Completed, vec![]));
        assert!(s.get_drain(ServerId(1)).await.unwrap().is_none());
        assert!(upgrade_legacy_drain_states(s.as_ref())
            .await
            .unwrap()
            .is_empty());
        // A REGISTER writes liveness; the drain stays.
        s.put_registered_server(&server(2)).await.unwrap();
        assert_eq!(shown().await, want, "after a REGISTER");
    }

    pub async fn audit_append_and_page(f: &Fixture) {
        let s = &f.store;
        assert!(s.list_audit(0, 10).await.unwrap().is_empty());
        let mut seqs = Vec::new();
        for i in 0..25 {
            let st = if i % 2 == 0 { &f.store } else { &f.second };
            let e = st
                .append_audit(&audit(&format!("action-{i}")))
                .await
                .unwrap();
            assert_eq!(e.record.action, format!("action-{i}"));
            seqs.push(e.seq);
        }
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "strictly increasing: {seqs:?}"
        );
        let all = s.list_audit(0, 1000).await.unwrap();
        assert_eq!(all.len(), 25);
        assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), seqs);
        let page = s.list_audit(seqs[9], 5).await.unwrap();
        assert_eq!(
            page.iter().map(|e| e.seq).collect::<Vec<_>>(),
            seqs[10..15].to_vec()
        );
        assert_eq!(page[0].record, audit("action-10"));
        assert!(s.list_audit(seqs[24], 10).await.unwrap().is_empty());
        assert!(s.list_audit(0, 0).await.unwrap().is_empty());
        // Newest first: the newest `limit` after `after`, in one read.
        let newest = s.list_audit_newest(0, 3).await.unwrap();
        assert_eq!(
            newest.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![seqs[24], seqs[23], seqs[22]]
        );
        assert_eq!(newest[0].record, audit("action-24"));
        let tail = s.list_audit_newest(seqs[21], 10).await.unwrap();
        assert_eq!(
            tail.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![seqs[24], seqs[23], seqs[22]]
        );
        assert_eq!(s.list_audit_newest(0, 1000).await.unwrap().len(), 25);
        assert!(s.list_audit_newest(seqs[24], 10).await.unwrap().is_empty());
        assert!(s.list_audit_newest(0, 0).await.unwrap().is_empty());
    }

    pub async fn concurrent_writers(f: &Fixture) {
        f.store.put_server(&server(1)).await.unwrap();
        let mut tasks = Vec::new();
        for w in 0..4u32 {
            let st: Arc<dyn Store> = if w % 2 == 0 {
                f.store.clone()
            } else {
                f.second.clone()
            };
            tasks.push(tokio::spawn(async move {
                let mut seqs = Vec::new();
                for b in 0..10u32 {
                    let ops: Vec<FlowOp> = (0..100u32)
                        .map(|i| FlowOp::Put {
                            key: flow(w * 10_000 + b * 100 + i),
                            server: ServerId(w),
                        })
                        .collect();
                    st.apply_flows(&ops).await.unwrap();
                    seqs.push(
                        st.append_audit(&audit(&format!("w{w}-b{b}")))
                            .await
                            .unwrap()
                            .seq,
                    );
                    // Contended read-modify-write of one record.
                    st.set_server_weight(ServerId(1), w * 100 + b)
                        .await
                        .unwrap();
                }
                seqs
            }));
        }
        let mut all_seqs = Vec::new();
        for t in tasks {
            all_seqs.extend(t.await.unwrap());
        }
        all_seqs.sort();
        all_seqs.dedup();
        assert_eq!(all_seqs.len(), 40, "audit seqs unique under concurrency");
        assert_eq!(f.store.count_flows().await.unwrap(), 4000);
        for w in 0..4 {
            assert_eq!(
                f.second
                    .list_flows_by_server(ServerId(w))
                    .await
                    .unwrap()
                    .len(),
                1000
            );
        }
        assert_eq!(f.store.list_audit(0, 100).await.unwrap().len(), 40);
        let weight = f
            .store
            .get_server(ServerId(1))
            .await
            .unwrap()
            .unwrap()
            .weight;
        assert!(
            weight % 100 == 9,
            "last write of some writer wins, got {weight}"
        );
    }

    pub async fn watch_delivers_changes_from_other_handle(f: &Fixture) {
        // Changes before the watch are not replayed.
        f.second.put_server(&server(1)).await.unwrap();
        let mut w = f.store.watch(&WatchKind::ALL).await.unwrap();
        f.second.put_server(&server(2)).await.unwrap();
        f.second
            .set_server_state(ServerId(2), ServerState::Draining)
            .await
            .unwrap();
        f.second.put_service(&service("web", &[2])).await.unwrap();
        let p = Policy {
            hysteresis_pct: 3.0,
            ..Policy::default()
        };
        f.second.put_policy(&p).await.unwrap();
        f.second.put_drain(&drain(2)).await.unwrap();
        let entry = f.second.append_audit(&audit("server.drain")).await.unwrap();
        f.second.delete_drain(ServerId(2)).await.unwrap();
        f.second.delete_service("web").await.unwrap();
        f.second.delete_server(ServerId(2)).await.unwrap();
        // Flow writes are not watched.
        f.second
            .apply_flows(&[FlowOp::Put {
                key: flow(1),
                server: ServerId(2),
            }])
            .await
            .unwrap();
        f.second.put_policy(&Policy::default()).await.unwrap();

        let mut got = Vec::new();
        let mut last_rev = 0;
        for _ in 0..10 {
            let ev = next_event(&mut w, WAIT).await;
            assert!(ev.revision > last_rev, "revisions increase");
            last_rev = ev.revision;
            got.push(ev.change);
        }
        match &got[0] {
            Change::ServerPut(s) => assert_eq!(s.id, ServerId(2)),
            other => panic!("expected ServerPut(2), got {other:?}"),
        }
        match &got[1] {
            Change::ServerPut(s) => assert_eq!(s.state, ServerState::Draining),
            other => panic!("expected ServerPut draining, got {other:?}"),
        }
        assert_eq!(got[2], Change::ServicePut(service("web", &[2])));
        assert_eq!(got[3], Change::PolicyPut(p));
        assert_eq!(got[4], Change::DrainPut(drain(2)));
        assert_eq!(got[5], Change::AuditAppended(entry));
        assert_eq!(got[6], Change::DrainDeleted(ServerId(2)));
        assert_eq!(got[7], Change::ServiceDeleted("web".into()));
        assert_eq!(got[8], Change::ServerDeleted(ServerId(2)));
        // The sentinel comes next: the flow write produced no event.
        assert_eq!(got[9], Change::PolicyPut(Policy::default()));
    }

    pub async fn watch_filters_kinds(f: &Fixture) {
        let mut w = f.store.watch(&[WatchKind::Policy]).await.unwrap();
        f.second.put_server(&server(1)).await.unwrap();
        f.second.put_service(&service("web", &[1])).await.unwrap();
        f.second.append_audit(&audit("x")).await.unwrap();
        let p = Policy {
            max_migrations_per_sec_per_server: 7,
            ..Policy::default()
        };
        f.second.put_policy(&p).await.unwrap();
        assert_eq!(next_event(&mut w, WAIT).await.change, Change::PolicyPut(p));
        no_event(&mut w, Duration::from_millis(300)).await;
        // A watcher on the same handle that writes sees its own writes.
        let mut own = f.store.watch(&[WatchKind::Servers]).await.unwrap();
        f.store.set_server_weight(ServerId(1), 5).await.unwrap();
        match next_event(&mut own, WAIT).await.change {
            Change::ServerPut(s) => assert_eq!(s.weight, 5),
            other => panic!("{other:?}"),
        }
    }

    pub async fn leader_campaign_resign_change(f: &Fixture) {
        let ttl = Duration::from_secs(5);
        assert_eq!(f.store.leader("switchd").await.unwrap(), None);
        let a = f
            .store
            .campaign("switchd", "switch-a", ttl)
            .await
            .unwrap()
            .expect("a wins an empty election");
        assert_eq!(a.info.candidate, "switch-a");
        assert!(
            f.second
                .campaign("switchd", "switch-b", ttl)
                .await
                .unwrap()
                .is_none(),
            "b loses while a leads"
        );
        assert!(
            f.store
                .campaign("switchd", "switch-a", ttl)
                .await
                .unwrap()
                .is_none(),
            "no double win"
        );
        assert_eq!(
            f.second.leader("switchd").await.unwrap(),
            Some(a.info.clone())
        );
        // Elections are independent.
        let other = f
            .second
            .campaign("other", "switch-b", ttl)
            .await
            .unwrap()
            .expect("other election");
        f.store.keep_alive(&a).await.unwrap();
        f.store.resign(&a).await.unwrap();
        f.store.resign(&a).await.unwrap(); // idempotent
        assert_eq!(f.second.leader("switchd").await.unwrap(), None);
        let e = f.store.keep_alive(&a).await.unwrap_err();
        assert!(matches!(e, StoreError::NotLeader { .. }), "{e}");
        let b = f
            .second
            .campaign("switchd", "switch-b", ttl)
            .await
            .unwrap()
            .expect("b wins after a resigned");
        assert!(
            b.info.term > a.info.term,
            "term increases: {} > {}",
            b.info.term,
            a.info.term
        );
        assert_eq!(
            f.store.leader("switchd").await.unwrap().unwrap().candidate,
            "switch-b"
        );
        assert_eq!(
            f.store.leader("other").await.unwrap(),
            Some(other.info.clone())
        );
        f.second.resign(&b).await.unwrap();
        f.second.resign(&other).await.unwrap();
        assert!(f.store.campaign("bad/name", "x", ttl).await.is_err());
    }

    pub async fn lease_expiry_hands_over(f: &Fixture) {
        let a = f
            .store
            .campaign("ha", "switch-a", Duration::from_millis(900))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            a.ttl,
            Duration::from_secs(1),
            "TTL rounds up to whole seconds"
        );
        // No keep-alive: the lease expires and b takes over.
        let b = eventually(Duration::from_secs(8), "lease expiry", || async {
            f.second
                .campaign("ha", "switch-b", Duration::from_secs(5))
                .await
                .unwrap()
        })
        .await;
        assert!(b.info.term > a.info.term);
        let e = f.store.keep_alive(&a).await.unwrap_err();
        assert!(matches!(e, StoreError::NotLeader { .. }), "{e}");
        // A stale resign does not dethrone the new leader.
        f.store.resign(&a).await.unwrap();
        assert_eq!(
            f.store.leader("ha").await.unwrap().unwrap().candidate,
            "switch-b"
        );
        f.second.resign(&b).await.unwrap();
    }

    pub async fn keep_alive_holds_leadership(f: &Fixture) {
        let a = f
            .store
            .campaign("ka", "switch-a", Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        let start = std::time::Instant::now();
        // 2.5 lease lifetimes, renewing every 300 ms.
        while start.elapsed() < Duration::from_millis(2500) {
            f.store.keep_alive(&a).await.unwrap();
            assert!(f
                .second
                .campaign("ka", "switch-b", Duration::from_secs(1))
                .await
                .unwrap()
                .is_none());
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert_eq!(
            f.second.leader("ka").await.unwrap().unwrap().candidate,
            "switch-a"
        );
        f.store.resign(&a).await.unwrap();
    }

    pub async fn leader_watch_sees_change_and_expiry(f: &Fixture) {
        let mut w = f.second.watch(&[WatchKind::Leader]).await.unwrap();
        let a = f
            .store
            .campaign("lw", "switch-a", Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        match next_event(&mut w, WAIT).await.change {
            Change::LeaderChanged { election, leader } => {
                assert_eq!(election, "lw");
                assert_eq!(leader, Some(a.info.clone()));
            }
            other => panic!("{other:?}"),
        }
        // Expiry (no keep-alive) is reported as "no leader".
        match next_event(&mut w, Duration::from_secs(8)).await.change {
            Change::LeaderChanged { leader, .. } => assert_eq!(leader, None),
            other => panic!("{other:?}"),
        }
        let b = f
            .second
            .campaign("lw", "switch-b", Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        match next_event(&mut w, WAIT).await.change {
            Change::LeaderChanged { leader, .. } => {
                assert_eq!(leader.unwrap().candidate, "switch-b")
            }
            other => panic!("{other:?}"),
        }
        f.second.resign(&b).await.unwrap();
        match next_event(&mut w, WAIT).await.change {
            Change::LeaderChanged { leader, .. } => assert_eq!(leader, None),
            other => panic!("{other:?}"),
        }
    }

    /// `apply_flows_fenced` writes only while the fence's lease holds the
    /// election: refused (nothing written, `NotLeader` naming the holder)
    /// after a resign and takeover, after a plain expiry, and for a lease
    /// that never held it; a fenced batch larger than one etcd transaction
    /// is written in fenced chunks.
    pub async fn fenced_flow_writes_follow_leadership(f: &Fixture) {
        let put = |i: u32, s: u32| FlowOp::Put {
            key: flow(i),
            server: ServerId(s),
        };
        let a = f
            .store
            .campaign("fence", "switch-a", Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        f.store
            .apply_flows_fenced(&[put(1, 1)], &a.info)
            .await
            .unwrap();
        f.store.apply_flows_fenced(&[], &a.info).await.unwrap();
        let big: Vec<FlowOp> = (100..2600).map(|i| put(i, 2)).collect();
        f.second.apply_flows_fenced(&big, &a.info).await.unwrap();
        assert_eq!(f.second.count_flows().await.unwrap(), 2501);
        // A lease that never held the election.
        let forged = LeaderInfo {
            lease_id: a.info.lease_id + 7,
            ..a.info.clone()
        };
        let e = f
            .store
            .apply_flows_fenced(&[put(2, 1)], &forged)
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::NotLeader { .. }), "{e}");

        // Deposed: a resigns, b wins; a's writes are refused, b's land.
        f.store.resign(&a).await.unwrap();
        let b = f
            .second
            .campaign("fence", "switch-b", Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        let e = f
            .store
            .apply_flows_fenced(&[put(1, 9), put(3, 9)], &a.info)
            .await
            .unwrap_err();
        match &e {
            StoreError::NotLeader { election, reason } => {
                assert_eq!(election, "fence");
                assert!(reason.contains("switch-b"), "names the holder: {reason}");
            }
            other => panic!("{other}"),
        }
        assert_eq!(
            f.second.get_flow(&flow(1)).await.unwrap(),
            Some(ServerId(1))
        );
        assert_eq!(f.second.get_flow(&flow(3)).await.unwrap(), None);
        assert!(f.store.apply_flows_fenced(&[], &a.info).await.is_err());
        f.second
            .apply_flows_fenced(&[put(3, 3)], &b.info)
            .await
            .unwrap();
        assert_eq!(f.store.get_flow(&flow(3)).await.unwrap(), Some(ServerId(3)));
        // Plain apply_flows is not fenced (the API's own writes).
        f.store.apply_flows(&[put(4, 4)]).await.unwrap();
        f.second.resign(&b).await.unwrap();

        // Expiry with nobody taking over also fences the old lease out.
        let c = f
            .store
            .campaign("fence-expiry", "switch-c", Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        f.store
            .apply_flows_fenced(&[put(5, 5)], &c.info)
            .await
            .unwrap();
        eventually(Duration::from_secs(8), "lease expiry fences", || async {
            match f.store.apply_flows_fenced(&[], &c.info).await {
                Err(StoreError::NotLeader { .. }) => Some(()),
                Err(e) => panic!("{e}"),
                Ok(()) => None,
            }
        })
        .await;
        let e = f
            .store
            .apply_flows_fenced(&[put(6, 6)], &c.info)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no live leader"), "{e}");
        assert_eq!(f.second.get_flow(&flow(6)).await.unwrap(), None);
    }

    /// A fenced `FlowWriter` writes nothing without a lease, writes what it
    /// held once one is set, keeps a batch the store refuses (reporting the
    /// lease through the fence) and, closed without a lease, drops the rest
    /// and says so.
    pub async fn fenced_flow_writer_stops_when_deposed(f: &Fixture) {
        let fence = WriteFence::new();
        let writer = FlowWriter::spawn_fenced(
            f.store.clone(),
            FlowWriterConfig {
                linger: Duration::from_millis(1),
                ..Default::default()
            },
            fence.clone(),
        );
        let put = |i: u32| FlowOp::Put {
            key: flow(i),
            server: ServerId(1),
        };
        writer.try_push(put(1)).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(f.second.get_flow(&flow(1)).await.unwrap(), None);
        let m = writer.metrics();
        assert!(m.waiting_for_lease && m.backlog == 1, "{m:?}");

        let a = f
            .store
            .campaign("wf", "switch-a", Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        fence.set(Some(&a.info));
        writer.flush(WAIT).await.unwrap();
        assert_eq!(
            f.second.get_flow(&flow(1)).await.unwrap(),
            Some(ServerId(1))
        );
        assert!(!writer.metrics().waiting_for_lease);

        // Deposed behind the writer's back: the next batch is refused.
        f.store.resign(&a).await.unwrap();
        let b = f
            .second
            .campaign("wf", "switch-b", Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        writer.try_push(put(2)).unwrap();
        let refused = eventually(WAIT, "refusal reported", || async { fence.take_refused() }).await;
        assert_eq!(refused, a.info.lease_id);
        let m = writer.metrics();
        assert!(m.fenced_total >= 1 && m.waiting_for_lease, "{m:?}");
        assert!(
            m.last_error.as_deref().unwrap_or("").contains("switch-b"),
            "{m:?}"
        );
        assert!(m
            .to_prometheus()
            .contains("capybara_store_flow_writer_waiting_for_lease 1"));
        // Still refused while the owner has not set a new lease.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(f.second.get_flow(&flow(2)).await.unwrap(), None);

        fence.set(None);
        writer.try_push(put(3)).unwrap();
        let e = writer.close(WAIT).await.unwrap_err();
        assert_eq!(e.unwritten, 2, "{e}");
        assert_eq!(writer.metrics().abandoned_total, 2);
        assert_eq!(writer.metrics().backlog, 0);
        for i in [2, 3] {
            assert_eq!(f.second.get_flow(&flow(i)).await.unwrap(), None);
        }
        f.second.resign(&b).await.unwrap();
    }

    pub async fn flow_writer_persists_everything(f: &Fixture) {
        let writer = FlowWriter::spawn(
            f.store.clone(),
            FlowWriterConfig {
                max_batch: 500,
                ..Default::default()
            },
        );
        let n = 20_000u32;
        for i in 0..n {
            writer
                .try_push(FlowOp::Put {
                    key: flow(i),
                    server: ServerId(i % 3),
                })
                .unwrap();
        }
        for i in (0..n).step_by(4) {
            writer.try_push(FlowOp::Delete { key: flow(i) }).unwrap();
        }
        writer.flush(Duration::from_secs(30)).await.unwrap();
        let m = writer.metrics();
        assert_eq!(m.backlog, 0);
        assert_eq!(m.written_total, u64::from(n + n / 4));
        assert_eq!(m.overflow_total, 0);
        assert!(m.batches_total >= u64::from((n + n / 4) / 500));
        assert!(m
            .to_prometheus()
            .contains("capybara_store_flow_writer_backlog 0"));
        assert_eq!(f.second.count_flows().await.unwrap(), u64::from(n - n / 4));
        writer.close(Duration::from_secs(5)).await.unwrap();
        let e = writer
            .try_push(FlowOp::Delete { key: flow(1) })
            .unwrap_err();
        assert_eq!(e.reason, OverflowReason::WriterClosed);
    }
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let f = sqlite_fixture().await;
                    cases::$case(&f).await;
                }
            )*
        }
        mod etcd {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let f = etcd_fixture().await;
                    cases::$case(&f).await;
                }
            )*
        }
    };
}

conformance!(
    servers_crud,
    server_instance_roundtrip,
    seq_floors_raise_per_instance,
    server_state_and_weight,
    services_crud,
    seeded_marks,
    retiring_records,
    retiring_records_per_address,
    registered_server_keeps_concurrent_operator_weights,
    policy_default_roundtrip_and_validation,
    policy_put_if_absent,
    flows_batch_semantics,
    flows_large_batch_and_scan,
    drains_crud_and_progress,
    legacy_drain_states_move_to_drain_records,
    audit_append_and_page,
    concurrent_writers,
    watch_delivers_changes_from_other_handle,
    watch_filters_kinds,
    leader_campaign_resign_change,
    lease_expiry_hands_over,
    keep_alive_holds_leadership,
    leader_watch_sees_change_and_expiry,
    flow_writer_persists_everything,
    fenced_flow_writes_follow_leadership,
    fenced_flow_writer_stops_when_deposed,
);
