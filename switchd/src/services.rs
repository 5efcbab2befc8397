//! The services switchd serves, and where they come from.
//!
//! With a store, the store's service records (what `POST /v1/services`,
//! `PUT` and `DELETE` write) are the services served: switchd reads them at
//! start and at every takeover, then polls them, and the data plane follows
//! within a poll. The config's `[[services]]` seed the store: at start (and
//! at a takeover) the active switchd writes each configured service whose
//! name the store does not hold, unless another stored service already has
//! its VIP:port. From then on the stored record is the truth (an operator's
//! edit of a configured service stays); a configured service deleted
//! through the API comes back at the next start unless it is also removed
//! from the config. Without a store the config's services are served.
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

/// What the active switchd writes to the store at start: the configured
/// services the store has no record of (by name) and whose VIP:port no
/// stored service uses. Also a note for each configured service that is
/// not written because the store differs.
pub fn seed(
    stored: &[capybara_store::Service],
    cfg: &Config,
) -> (Vec<capybara_store::Service>, Vec<String>) {
    let mut put = Vec::new();
    let mut notes = Vec::new();
    for c in &cfg.services {
        let (vip, port) = (*c.vip.ip(), c.vip.port());
        if let Some(s) = stored.iter().find(|s| s.name == c.name) {
            if s.vip != vip || s.port != port {
                notes.push(format!(
                    "configured service {:?} ({}) is {}:{} in the store: the stored record applies (config services only seed the store)",
                    c.name, c.vip, s.vip, s.port
                ));
            }
            continue;
        }
        if let Some(s) = stored.iter().find(|s| s.vip == vip && s.port == port) {
            notes.push(format!(
                "configured service {:?} not written to the store: {} is the address of stored service {:?}",
                c.name, c.vip, s.name
            ));
            continue;
        }
        put.push(capybara_store::Service {
            name: c.name.clone(),
            vip,
            port,
            pool: c.pool.iter().map(|m| ServerId(m.server)).collect(),
        });
    }
    (put, notes)
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

    #[test]
    fn an_empty_store_is_seeded_with_every_configured_service() {
        let (put, notes) = seed(&[], &cfg());
        assert!(notes.is_empty());
        assert_eq!(
            put,
            vec![
                stored("web", "198.18.100.1:80", &[1, 2]),
                stored("cache", "198.18.100.2:6379", &[]),
            ]
        );
    }

    #[test]
    fn stored_records_win_over_the_config() {
        // "web" edited through the API (other VIP), "cache"'s address taken
        // by another stored service: nothing is written, both are noted.
        let s = [
            stored("web", "198.18.100.9:80", &[2]),
            stored("other", "198.18.100.2:6379", &[]),
        ];
        let (put, notes) = seed(&s, &cfg());
        assert!(put.is_empty());
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].contains("stored record applies"), "{notes:?}");
        assert!(notes[1].contains("\"other\""), "{notes:?}");
        // An unchanged record is no news.
        let (put, notes) = seed(&[stored("web", "198.18.100.1:80", &[1])], &cfg());
        assert_eq!(put, vec![stored("cache", "198.18.100.2:6379", &[])]);
        assert!(notes.is_empty());
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
