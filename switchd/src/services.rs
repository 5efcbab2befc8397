//! The services switchd serves, and where they come from.
//!
//! With a store, the store's service records (what `POST /v1/services`,
//! `PUT` and `DELETE` write) are the services served: switchd reads them at
//! start and at every takeover, then polls them, and the data plane follows
//! within a poll. The config's `[[services]]` seed the store, once per
//! name: at start (and at a takeover) the active switchd writes each
//! configured service whose name was never seeded before (the store keeps
//! a mark per seeded name, `Store::seeded_services`) and the store does not
//! hold, unless another stored service already has its VIP:port; then it
//! marks the name. From then on the stored record is the truth: an
//! operator's edit of a configured service stays, and so does a delete
//! through the API (the next start logs that it skipped the service; to
//! serve it again, create it through the API). A service added to the
//! config, or renamed there, is seeded once. A store written before the
//! marks existed has none: a configured name it holds counts as seeded
//! (and is marked), one it does not hold is seeded once. Without a store
//! the config's services are served.
//!
//! A configured service keeps what the store has no field for: its own
//! `placement` (when it names one other than the global one) and its pool
//! members' weights.

use std::net::SocketAddrV4;

use capybara_proto::ServerId;

use crate::config::{Config, Service as ConfigService};
use crate::control::{Placement, PoolSpec, ServiceSpec};

/// The services of the config alone (no store, or before it is read).
pub fn config_specs(cfg: &Config) -> Vec<ServiceSpec> {
    cfg.services
        .iter()
        .map(|c| ServiceSpec {
            name: c.name.clone(),
            addr: c.vip,
            placement: c.placement,
            follows_global: c.placement == cfg.placement,
            pool: PoolSpec {
                members: c
                    .pool
                    .iter()
                    .map(|m| (ServerId(m.server), m.weight))
                    .collect(),
                open: c.pool.is_empty(),
            },
        })
        .collect()
}

/// The services to serve from the store's records: ordered by name; a
/// record's empty pool is an open pool (every registered server). `global`
/// is the placement in force for services that follow the global one.
pub fn store_specs(
    stored: &[capybara_store::Service],
    cfg: &Config,
    global: Placement,
) -> Vec<ServiceSpec> {
    let mut stored: Vec<&capybara_store::Service> = stored.iter().collect();
    stored.sort_by(|a, b| a.name.cmp(&b.name));
    stored
        .into_iter()
        .map(|s| {
            let conf: Option<&ConfigService> = cfg.services.iter().find(|c| c.name == s.name);
            let own = conf.map(|c| c.placement).filter(|p| *p != cfg.placement);
            let weight = |id: ServerId| {
                conf.and_then(|c| c.pool.iter().find(|m| m.server == id.0))
                    .map_or(0, |m| m.weight)
            };
            ServiceSpec {
                name: s.name.clone(),
                addr: SocketAddrV4::new(s.vip, s.port),
                placement: own.unwrap_or(global),
                follows_global: own.is_none(),
                pool: PoolSpec {
                    members: s.pool.iter().map(|id| (*id, weight(*id))).collect(),
                    open: s.pool.is_empty(),
                },
            }
        })
        .collect()
}

/// A stored service switchd read and does not serve, and why (a VIP:port
/// or name used twice, no free service slot, or the data plane did not
/// take the change): `refused_services` in `/status`, which the API shows
/// as the service's `refused` state with this reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedService {
    pub name: String,
    pub addr: SocketAddrV4,
    pub reason: String,
}

/// The specs of one apply that are not served after it, each with the
/// reason `why` gives for its name (`None`: not refused, e.g. served
/// under its address already). A spec is served when a live (not
/// retiring) service of that name is at its address.
pub fn refused(
    specs: &[ServiceSpec],
    served: &[crate::control::Service],
    why: impl Fn(&str) -> Option<String>,
) -> Vec<RefusedService> {
    specs
        .iter()
        .filter(|spec| {
            !served
                .iter()
                .any(|s| s.retiring.is_none() && s.name == spec.name && s.addr() == spec.addr)
        })
        .filter_map(|spec| {
            Some(RefusedService {
                name: spec.name.clone(),
                addr: spec.addr,
                reason: why(&spec.name)?,
            })
        })
        .collect()
}

/// What the active switchd does with the config's services at start (and
/// at a takeover): see [`seed`].
#[derive(Debug, Default, PartialEq)]
pub struct Seeding {
    /// Configured services to write to the store.
    pub put: Vec<capybara_store::Service>,
    /// Names to mark seeded once `put` is written: the written ones, and
    /// configured ones the store holds without a mark (a store written
    /// before marks existed, or a record created through the API first).
    pub mark: Vec<String>,
    /// One line for each configured service not written because the
    /// store differs, or because it was seeded before and deleted since.
    pub notes: Vec<String>,
}

/// The seeding of the store from the config: a configured service is
/// written only if its name was never seeded (`seeded`, the store's marks)
/// and the store has no record of it, and no stored service uses its
/// VIP:port (then it is left unmarked, so it is seeded once the address is
/// free). So a configured service deleted through the API stays deleted;
/// one added to the config (or renamed) is seeded once.
pub fn seed(stored: &[capybara_store::Service], seeded: &[String], cfg: &Config) -> Seeding {
    let mut out = Seeding::default();
    let marked = |name: &str| seeded.iter().any(|n| n == name);
    for c in &cfg.services {
        let (vip, port) = (*c.vip.ip(), c.vip.port());
        if let Some(s) = stored.iter().find(|s| s.name == c.name) {
            if !marked(&c.name) {
                out.mark.push(c.name.clone());
            }
            if s.vip != vip || s.port != port {
                out.notes.push(format!(
                    "configured service {:?} ({}) is {}:{} in the store: the stored record applies (config services only seed the store)",
                    c.name, c.vip, s.vip, s.port
                ));
            }
            continue;
        }
        if marked(&c.name) {
            out.notes.push(format!(
                "configured service {:?} not written: deleted through the API earlier (create it again through the API to serve it)",
                c.name
            ));
            continue;
        }
        if let Some(s) = stored.iter().find(|s| s.vip == vip && s.port == port) {
            out.notes.push(format!(
                "configured service {:?} not written to the store: {} is the address of stored service {:?}",
                c.name, c.vip, s.name
            ));
            continue;
        }
        out.put.push(capybara_store::Service {
            name: c.name.clone(),
            vip,
            port,
            pool: c.pool.iter().map(|m| ServerId(m.server)).collect(),
        });
        out.mark.push(c.name.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        let toml = r#"
control_listen = "127.0.0.1:7300"
key_file = "/dev/null"
[[interfaces]]
name = "c0"
role = "client"
[[interfaces]]
name = "s0"
role = "server"
[[services]]
name = "web"
vip = "198.18.100.1:80"
pool = [{ server = 1, weight = 3 }, { server = 2 }]
[[services]]
name = "cache"
vip = "198.18.100.2:6379"
placement = "lwrr"
"#;
        Config::from_toml(toml).expect("test config")
    }

    fn stored(name: &str, addr: &str, pool: &[u32]) -> capybara_store::Service {
        let a: SocketAddrV4 = addr.parse().unwrap();
        capybara_store::Service {
            name: name.into(),
            vip: *a.ip(),
            port: a.port(),
            pool: pool.iter().map(|i| ServerId(*i)).collect(),
        }
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn an_empty_store_is_seeded_with_every_configured_service() {
        let out = seed(&[], &[], &cfg());
        assert!(out.notes.is_empty());
        assert_eq!(
            out.put,
            vec![
                stored("web", "198.18.100.1:80", &[1, 2]),
                stored("cache", "198.18.100.2:6379", &[]),
            ]
        );
        assert_eq!(out.mark, names(&["web", "cache"]));
    }

    #[test]
    fn stored_records_win_over_the_config() {
        // "web" edited through the API (other VIP), "cache"'s address taken
        // by another stored service: nothing is written, both are noted;
        // "web" is marked (the store holds it), "cache" is not (never
        // written: seeded once its address is free).
        let s = [
            stored("web", "198.18.100.9:80", &[2]),
            stored("other", "198.18.100.2:6379", &[]),
        ];
        let out = seed(&s, &[], &cfg());
        assert!(out.put.is_empty());
        assert_eq!(out.mark, names(&["web"]));
        assert_eq!(out.notes.len(), 2, "{:?}", out.notes);
        assert!(
            out.notes[0].contains("stored record applies"),
            "{:?}",
            out.notes
        );
        assert!(out.notes[1].contains("\"other\""), "{:?}", out.notes);
        // An unchanged, marked record is no news.
        let out = seed(
            &[stored("web", "198.18.100.1:80", &[1])],
            &names(&["web"]),
            &cfg(),
        );
        assert_eq!(out.put, vec![stored("cache", "198.18.100.2:6379", &[])]);
        assert_eq!(out.mark, names(&["cache"]));
        assert!(out.notes.is_empty());
    }

    #[test]
    fn a_seeded_service_deleted_since_is_not_written_again() {
        // Both seeded before; "web" deleted through the API since.
        let out = seed(
            &[stored("cache", "198.18.100.2:6379", &[])],
            &names(&["cache", "web"]),
            &cfg(),
        );
        assert_eq!(out, Seeding {
            put: vec![],
            mark: vec![],
            notes: vec!["configured service \"web\" not written: deleted through the API earlier (create it again through the API to serve it)".into()],
        });
        // Created again through the API (its record is back): served from
        // the store as any other, nothing to write or say.
        let out = seed(
            &[
                stored("cache", "198.18.100.2:6379", &[]),
                stored("web", "198.18.100.1:80", &[]),
            ],
            &names(&["cache", "web"]),
            &cfg(),
        );
        assert_eq!(out, Seeding::default());
        // Marks of names no longer configured change nothing.
        let out = seed(&[], &names(&["old", "other"]), &cfg());
        assert_eq!(out.put.len(), 2);
    }

    #[test]
    fn a_store_without_marks_counts_what_it_holds_as_seeded() {
        // Written before marks existed: "web" is held (marked, not
        // rewritten), "cache" is not (seeded once, as before).
        let out = seed(&[stored("web", "198.18.100.1:80", &[1, 2])], &[], &cfg());
        assert_eq!(out.put, vec![stored("cache", "198.18.100.2:6379", &[])]);
        assert_eq!(out.mark, names(&["web", "cache"]));
        assert!(out.notes.is_empty());
    }

    #[test]
    fn a_service_renamed_in_the_config_is_seeded_once() {
        // "web" seeded, then renamed "www" in the config (same VIP): the
        // stored "web" keeps the address, so "www" is not written and not
        // marked; once "web" is deleted through the API, "www" is seeded.
        let mut c = cfg();
        c.services[0].name = "www".into();
        let held = [stored("web", "198.18.100.1:80", &[1, 2])];
        let seeded = names(&["cache", "web"]);
        let out = seed(&held, &seeded, &c);
        assert!(out.put.is_empty() && out.mark.is_empty());
        assert!(out.notes[0].contains("\"www\""), "{:?}", out.notes);
        let out = seed(&[], &seeded, &c);
        assert_eq!(out.put, vec![stored("www", "198.18.100.1:80", &[1, 2])]);
        assert_eq!(out.mark, names(&["www"]));
        assert!(out.notes[0].contains("\"cache\" not written: deleted through the API"));
    }

    #[test]
    fn store_specs_keep_config_weights_and_own_placement() {
        let s = [
            stored("web", "198.18.100.1:80", &[2, 1, 7]),
            stored("cache", "198.18.100.2:6379", &[]),
            stored("api", "198.18.100.3:8080", &[4]),
        ];
        let specs = store_specs(&s, &cfg(), Placement::Lwrr);
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["api", "cache", "web"]);
        // Not configured: follows the global placement, REGISTER weights.
        assert_eq!(specs[0].placement, Placement::Lwrr);
        assert!(specs[0].follows_global);
        assert_eq!(specs[0].pool.members, vec![(ServerId(4), 0)]);
        assert!(!specs[0].pool.open);
        // Configured with the global placement (maglev in the config):
        // follows the policy's; configured weights kept, new members 0.
        assert_eq!(specs[2].placement, Placement::Lwrr);
        assert!(specs[2].follows_global);
        assert_eq!(
            specs[2].pool.members,
            vec![(ServerId(2), 1), (ServerId(1), 3), (ServerId(7), 0)]
        );
        // Its own placement stays; an empty stored pool is open.
        let specs = store_specs(&s, &cfg(), Placement::Maglev);
        assert_eq!(specs[1].placement, Placement::Lwrr);
        assert!(!specs[1].follows_global);
        assert!(specs[1].pool.open);
    }

    #[test]
    fn config_specs_match_the_config() {
        let specs = config_specs(&cfg());
        assert_eq!(specs.len(), 2);
        assert!(specs[0].follows_global && !specs[1].follows_global);
        assert!(!specs[0].pool.open && specs[1].pool.open);
    }
}
