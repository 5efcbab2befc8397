//! The switch's own addresses, which the API refuses as a service VIP or a
//! server data address: the IPv4 addresses of switchd's configured
//! interfaces (read at each check: an address added while the appliance
//! runs counts), its `control_listen` and, when they are not loopback or
//! unspecified, `metrics_listen` and the API's `listen`.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use capybara_api::server::SwitchAddrs;

use super::config::{ApiSettings, ApplianceConfig};

/// The fixed addresses of `cfg`, with the config field each comes from.
pub fn configured(cfg: &ApplianceConfig, api: &ApiSettings) -> Vec<(Ipv4Addr, String)> {
    let mut out = Vec::new();
    let mut add = |ip: IpAddr, what: &str| {
        if let IpAddr::V4(a) = ip {
            if !a.is_loopback() && !a.is_unspecified() && !out.iter().any(|(b, _)| *b == a) {
                out.push((a, what.to_string()));
            }
        }
    };
    if let Some(sw) = &cfg.switchd {
        add(
            IpAddr::V4(*sw.control_listen.ip()),
            "switchd.control_listen",
        );
        add(sw.metrics_listen.ip(), "switchd.metrics_listen");
    }
    add(api.listen.ip(), "api.listen");
    out
}

/// `configured` plus the addresses of switchd's interfaces at the time of
/// each call.
pub fn switch_addrs(cfg: &ApplianceConfig, api: &ApiSettings) -> SwitchAddrs {
    let fixed = configured(cfg, api);
    let ifaces: Vec<String> = cfg
        .switchd
        .as_ref()
        .map(|sw| sw.interfaces.iter().map(|i| i.name.clone()).collect())
        .unwrap_or_default();
    Arc::new(move || {
        let mut out = fixed.clone();
        for (name, a) in capybara_switchd::sys::interface_addrs() {
            if let Some(i) = ifaces.iter().position(|n| *n == name) {
                if !out.iter().any(|(b, _)| *b == a) {
                    out.push((
                        a,
                        format!("an address of interface {name}, switchd.interfaces[{i}]"),
                    ));
                }
            }
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the API of an appliance refuses: control_listen, the API's
    /// non-loopback listen address and the configured interfaces' addresses
    /// (here `lo`, which every namespace has), each named by its field.
    #[test]
    fn the_configs_addresses_are_the_switchs() {
        let cfg = ApplianceConfig::from_toml(
            r#"
[api]
listen = "10.1.2.3:8080"
[switchd]
control_listen = "198.18.1.1:7692"
key_file = "/tmp/k"
[[switchd.interfaces]]
name = "lo"
role = "client"
[[switchd.interfaces]]
name = "sv1"
role = "server"
"#,
        )
        .unwrap();
        let api = cfg.api.clone().unwrap();
        let got = switch_addrs(&cfg, &api)();
        assert_eq!(
            got,
            vec![
                (
                    Ipv4Addr::new(198, 18, 1, 1),
                    "switchd.control_listen".into()
                ),
                (Ipv4Addr::new(10, 1, 2, 3), "api.listen".into()),
                (
                    Ipv4Addr::LOCALHOST,
                    "an address of interface lo, switchd.interfaces[0]".into()
                ),
            ]
        );
    }

    /// Loopback is listed by the system (every namespace has `lo`).
    #[test]
    fn interface_addresses_are_listed() {
        let all = capybara_switchd::sys::interface_addrs();
        assert!(
            all.iter()
                .any(|(n, a)| n == "lo" && *a == Ipv4Addr::LOCALHOST),
            "{all:?}"
        );
    }
}
