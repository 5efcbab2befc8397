//! Value and key encoding shared by both backends.
//!
//! Values are versioned JSON: `{"v":1,"data":{...}}`. Decoding checks the
//! version before the shape, so a value written by a newer Capybara yields
//! `UnsupportedVersion` and garbage yields `MalformedValue`; both name the key.
//!
//! Logical keys (relative to the backend's root) are the same in both
//! backends and are what errors report: `servers/{id}`, `services/{name}`,
//! `policy`, `drains/{server id}`, `audit/{seq:020}`, `leader/{election}`,
//! `retiring/{service name}/{vip}:{port}` (and `retiring/{service name}`,
//! as written before records were per address),
//! `flows/{client_ip}:{client_port}->{service_ip}:{service_port}`.

use std::net::Ipv4Addr;

use capybara_proto::flow::{FlowKey, ServerId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::StoreError;

pub const VALUE_VERSION: u64 = 1;

#[derive(Serialize)]
struct EnvelopeOut<'a, T> {
    v: u64,
    data: &'a T,
}

#[derive(Deserialize)]
struct Head {
    v: serde_json::Value,
}

#[derive(Deserialize)]
struct EnvelopeIn<T> {
    #[allow(dead_code)]
    v: u64,
    data: T,
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing our own plain structs into a Vec cannot fail.
    serde_json::to_vec(&EnvelopeOut {
        v: VALUE_VERSION,
        data: value,
    })
    .unwrap_or_default()
}

pub fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    let malformed = |reason: String| StoreError::MalformedValue {
        key: key.to_string(),
        reason,
    };
    let head: Head = serde_json::from_slice(bytes)
        .map_err(|e| malformed(format!("not a versioned JSON object ({e})")))?;
    let version = head.v.as_u64().ok_or_else(|| {
        malformed(format!(
            "format version `v` must be a non-negative integer, got {}",
            head.v
        ))
    })?;
    if version != VALUE_VERSION {
        return Err(StoreError::UnsupportedVersion {
            key: key.to_string(),
            found: version,
            supported: VALUE_VERSION,
        });
    }
    let env: EnvelopeIn<T> = serde_json::from_slice(bytes).map_err(|e| malformed(e.to_string()))?;
    Ok(env.data)
}

/// Stored value of a flow mapping.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowValue {
    pub server: u32,
}

/// Stored value of a control-channel seq floor (`seq_floors/{id}`).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeqFloorValue {
    pub instance: u64,
    pub seq: u64,
}

pub fn seq_floor_key(id: ServerId) -> String {
    format!("seq_floors/{}", id.0)
}

/// Stored value of a seeded mark (`seeded/{name}`): its presence is the
/// mark; no fields yet (unknown ones are ignored, for later additions).
#[derive(Serialize, Deserialize)]
pub struct SeededValue {}

/// Key of a configured service name switchd seeded (`Store::mark_seeded`).
pub fn seeded_key(name: &str) -> String {
    format!("seeded/{name}")
}

/// Key of a retiring record as the build before per-address records
/// wrote it (one per name); still read, and forgotten, as before.
pub fn retiring_key(name: &str) -> String {
    format!("retiring/{name}")
}

/// Key of the retiring record of service `name`'s address `addr`
/// (`Store::list_retiring_services`).
pub fn retiring_addr_key(name: &str, addr: std::net::SocketAddrV4) -> String {
    format!("retiring/{name}/{addr}")
}

/// The name and, for a per-address key, the address in the part of a
/// retiring key after `retiring/` (`NAME` or `NAME/VIP:PORT`).
pub fn parse_retiring_key(
    full_key: &str,
    rest: &str,
) -> Result<(String, Option<std::net::SocketAddrV4>), StoreError> {
    match rest.split_once('/') {
        None => Ok((rest.to_string(), None)),
        Some((name, addr)) => {
            let (ip, port) = parse_endpoint(full_key, addr)?;
            Ok((
                name.to_string(),
                Some(std::net::SocketAddrV4::new(ip, port)),
            ))
        }
    }
}

/// Decodes a retiring service record stored under `key` for service
/// `name` (and address `addr`, for a per-address key): the record must
/// name the same service (and address).
pub fn decode_retiring(
    key: &str,
    name: &str,
    addr: Option<std::net::SocketAddrV4>,
    bytes: &[u8],
) -> Result<crate::model::RetiringService, StoreError> {
    crate::model::check_name("service name", name).map_err(|e| StoreError::MalformedKey {
        key: key.to_string(),
        reason: e.to_string(),
    })?;
    let r: crate::model::RetiringService = decode(key, bytes)?;
    if r.service.name != name {
        return Err(StoreError::MalformedValue {
            key: key.to_string(),
            reason: format!("holds service {:?}", r.service.name),
        });
    }
    if let Some(addr) = addr {
        if r.addr() != addr {
            return Err(StoreError::MalformedValue {
                key: key.to_string(),
                reason: format!("holds address {}", r.addr()),
            });
        }
    }
    Ok(r)
}

pub fn server_key(id: ServerId) -> String {
    format!("servers/{}", id.0)
}
pub fn service_key(name: &str) -> String {
    format!("services/{name}")
}
pub const POLICY_KEY: &str = "policy";
pub fn drain_key(id: ServerId) -> String {
    format!("drains/{}", id.0)
}
pub fn audit_key(seq: u64) -> String {
    format!("audit/{seq:020}")
}
pub fn leader_key(election: &str) -> String {
    format!("leader/{election}")
}
pub fn flow_key(key: &FlowKey) -> String {
    format!("flows/{key}")
}

fn malformed_key(key: &str, reason: impl Into<String>) -> StoreError {
    StoreError::MalformedKey {
        key: key.to_string(),
        reason: reason.into(),
    }
}

pub fn parse_server_id(full_key: &str, s: &str) -> Result<ServerId, StoreError> {
    s.parse::<u32>().map(ServerId).map_err(|_| {
        malformed_key(
            full_key,
            format!("server id {s:?} is not a 32-bit unsigned integer"),
        )
    })
}

pub fn parse_audit_seq(full_key: &str, s: &str) -> Result<u64, StoreError> {
    s.parse::<u64>().map_err(|_| {
        malformed_key(
            full_key,
            format!("audit sequence {s:?} is not an unsigned integer"),
        )
    })
}

fn parse_endpoint(full_key: &str, s: &str) -> Result<(Ipv4Addr, u16), StoreError> {
    let (ip, port) = s
        .rsplit_once(':')
        .ok_or_else(|| malformed_key(full_key, format!("{s:?} is not ip:port")))?;
    let ip = ip
        .parse::<Ipv4Addr>()
        .map_err(|_| malformed_key(full_key, format!("{ip:?} is not an IPv4 address")))?;
    let port = port
        .parse::<u16>()
        .map_err(|_| malformed_key(full_key, format!("{port:?} is not a port number")))?;
    Ok((ip, port))
}

/// Parses the flow part of a flow key (`a.b.c.d:p->e.f.g.h:q`).
pub fn parse_flow(full_key: &str, s: &str) -> Result<FlowKey, StoreError> {
    let (client, service) = s
        .split_once("->")
        .ok_or_else(|| malformed_key(full_key, "flow must be client_ip:port->service_ip:port"))?;
    let (client_ip, client_port) = parse_endpoint(full_key, client)?;
    let (service_ip, service_port) = parse_endpoint(full_key, service)?;
    Ok(FlowKey {
        client_ip,
        client_port,
        service_ip,
        service_port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Policy;

    #[test]
    fn round_trip_and_errors_name_the_key() {
        let p = Policy::default();
        let bytes = encode(&p);
        assert_eq!(decode::<Policy>("policy", &bytes).unwrap(), p);
        let e = decode::<Policy>("policy", b"\xff\x00garbage").unwrap_err();
        assert!(
            matches!(e, StoreError::MalformedValue { ref key, .. } if key == "policy"),
            "{e}"
        );
        let e = decode::<Policy>("policy", br#"{"v":7,"data":{}}"#).unwrap_err();
        assert!(
            matches!(e, StoreError::UnsupportedVersion { found: 7, .. }),
            "{e}"
        );
        let e = decode::<Policy>("policy", br#"{"v":1,"data":{"bogus":1}}"#).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let e = decode::<Policy>("policy", br#"{"v":-1}"#).unwrap_err();
        assert!(matches!(e, StoreError::MalformedValue { .. }), "{e}");
    }

    #[test]
    fn server_records_without_weight_set_decode_and_are_written_without_it() {
        use crate::model::Server;
        let old = br#"{"v":1,"data":{"id":3,"name":"s3","mgmt_addr":"10.0.0.3:7691","data_addr":"10.1.0.3","state":"active","weight":5,"registered_unix_ms":1,"updated_unix_ms":2}}"#;
        let s: Server = decode("servers/3", old).unwrap();
        assert_eq!((s.weight, s.weight_set), (5, false));
        // Not the operator's: written as before (older readers decode it).
        let text = String::from_utf8(encode(&s)).unwrap();
        assert!(!text.contains("weight_set"), "{text}");
        let set = Server {
            weight: 0,
            weight_set: true,
            ..s
        };
        let back: Server = decode("servers/3", &encode(&set)).unwrap();
        assert_eq!((back.weight, back.weight_set), (0, true));
    }

    #[test]
    fn flow_keys_round_trip() {
        let k = FlowKey {
            client_ip: Ipv4Addr::new(10, 0, 0, 1),
            client_port: 40000,
            service_ip: Ipv4Addr::new(192, 168, 1, 1),
            service_port: 443,
        };
        let s = flow_key(&k);
        assert_eq!(
            parse_flow(&s, s.strip_prefix("flows/").unwrap()).unwrap(),
            k
        );
        for bad in [
            "",
            "1.2.3.4:5",
            "1.2.3.4:5->x:1",
            "1.2.3.4:70000->1.2.3.4:1",
            "1.2.3:5->1.2.3.4:1",
        ] {
            assert!(
                matches!(parse_flow(bad, bad), Err(StoreError::MalformedKey { .. })),
                "{bad}"
            );
        }
    }
}
