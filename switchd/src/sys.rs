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
        .map_err(|e| SysError::Command {
            what: format!("ip {}", args.join(" ")),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(SysError::Command {
            what: format!("ip {}", args.join(" ")),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn ifindex(name: &str) -> Result<u32, SysError> {
    let c =
        std::ffi::CString::new(name).map_err(|_| SysError::NoInterface { name: name.into() })?;
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
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
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
    Err(SysError::Command {
        what: format!("MAC of {name}"),
        detail: format!("no link/ether in {out:?}"),
    })
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
    Err(SysError::Command {
        what: format!("route to {addr}"),
        detail: format!("no dev in {out:?}"),
    })
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

/// A gratuitous ARP request announcing `ip` at `mac`, padded to 60 bytes.
pub fn garp_frame(mac: [u8; 6], ip: Ipv4Addr) -> [u8; 60] {
    let mut f = [0u8; 60];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    f[14..16].copy_from_slice(&1u16.to_be_bytes()); // Ethernet
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    f[18] = 6;
    f[19] = 4;
    f[20..22].copy_from_slice(&1u16.to_be_bytes()); // request
    f[22..28].copy_from_slice(&mac);
    f[28..32].copy_from_slice(&ip.octets());
    // target hardware address zero; target protocol address = sender's
    f[38..42].copy_from_slice(&ip.octets());
    f
}

/// Sends one gratuitous ARP for each of `ips` out of interface `ifindex`
/// (a new active claiming the service addresses on a shared L2 segment).
pub fn send_garp(ifindex: u32, mac: [u8; 6], ips: &[Ipv4Addr]) -> std::io::Result<usize> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let proto = (libc::ETH_P_ARP as u16).to_be();
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto as i32) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed sockaddr_ll is a valid value.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    let mut sent = 0;
    for ip in ips {
        let f = garp_frame(mac, *ip);
        // SAFETY: valid buffer and sockaddr for the given lengths.
        let n = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                f.as_ptr() as *const libc::c_void,
                f.len(),
                0,
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        sent += 1;
    }
    Ok(sent)
}

#[cfg(test)]
mod garp_tests {
    #[test]
    fn garp_frame_layout() {
        let f = super::garp_frame([2, 0, 0, 0, 0, 1], std::net::Ipv4Addr::new(198, 18, 100, 1));
        assert_eq!(&f[12..14], &[0x08, 0x06]);
        assert_eq!(&f[20..22], &[0, 1]);
        assert_eq!(&f[28..32], &[198, 18, 100, 1]);
        assert_eq!(&f[38..42], &[198, 18, 100, 1]);
    }
}

/// Every IPv4 address of this network namespace, by interface name (empty
/// when the system cannot list them).
pub fn interface_addrs() -> Vec<(String, Ipv4Addr)> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is an element of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null()
            // SAFETY: a non-null ifa_addr points to a sockaddr.
            && i32::from(unsafe { (*ifa.ifa_addr).sa_family }) == libc::AF_INET
            && !ifa.ifa_name.is_null()
        {
            // SAFETY: an AF_INET address is a sockaddr_in; the name is a C string.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            out.push((
                name.to_string_lossy().into_owned(),
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
            ));
        }
        p = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}
