//! Interface and route facts from the kernel of the namespace switchd runs
//! in (control path only: registration, start-up, takeover).

use std::net::Ipv4Addr;
use std::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("interface {name:?} does not exist in this network namespace")]
    NoInterface { name: String },
    #[error("{what}: {detail}")]
    Command { what: String, detail: String },
}

fn ip(args: &[&str]) -> Result<String, SysError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| SysError::Command { what: format!("ip {}", args.join(" ")), detail: e.to_string() })?;
    if !out.status.success() {
        return Err(SysError::Command {
            what: format!("ip {}", args.join(" ")),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn ifindex(name: &str) -> Result<u32, SysError> {
    let c = std::ffi::CString::new(name).map_err(|_| SysError::NoInterface { name: name.into() })?;
    // SAFETY: valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(SysError::NoInterface { name: name.into() });
    }
    Ok(i)
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in mac.iter_mut() {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// Ethernet address of an interface.
pub fn iface_mac(name: &str) -> Result<[u8; 6], SysError> {
    let out = ip(&["-o", "link", "show", "dev", name])?;
    let mut it = out.split_whitespace();
    while let Some(tok) = it.next() {
        if tok == "link/ether" {
            if let Some(m) = it.next().and_then(parse_mac) {
                return Ok(m);
            }
        }
    }
    Err(SysError::Command { what: format!("MAC of {name}"), detail: format!("no link/ether in {out:?}") })
}

/// The interface name and ifindex the kernel routes `addr` through.
pub fn route_dev(addr: Ipv4Addr) -> Result<(String, u32), SysError> {
    let out = ip(&["-o", "route", "get", &addr.to_string()])?;
    let mut it = out.split_whitespace();
    while let Some(tok) = it.next() {
        if tok == "dev" {
            if let Some(dev) = it.next() {
                return Ok((dev.to_string(), ifindex(dev)?));
            }
        }
    }
    Err(SysError::Command { what: format!("route to {addr}"), detail: format!("no dev in {out:?}") })
}

#[cfg(test)]
mod tests {
    #[test]
    fn macs_parse_and_format() {
        let m = super::parse_mac("02:00:0a:ff:00:01").unwrap();
        assert_eq!(super::format_mac(&m), "02:00:0a:ff:00:01");
        assert!(super::parse_mac("02:00").is_none());
        assert!(super::parse_mac("02:00:0a:ff:00:01:02").is_none());
        assert!(super::parse_mac("zz:00:0a:ff:00:01").is_none());
    }
}
