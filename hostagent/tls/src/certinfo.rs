//! What an operator checks after rotating a certificate: the leaf's
//! subject, its expiry and its fingerprint, read from the DER with a
//! minimal reader (X.509 `tbsCertificate` up to the subject, RFC 5280
//! §4.1). Only for logs: a field it cannot read is `None`, never an error
//! or a panic (rustls has already accepted the certificate).

use std::fmt;

use rustls_pki_types::CertificateDer;

/// Summary of a certificate for logs; `Display` gives
/// `subject CN=example.com, expires 2027-01-31T12:00:00Z, sha256 ab12...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// The subject's common attributes (`CN=..,O=..`), when readable.
    pub subject: Option<String>,
    /// `notAfter` as `YYYY-MM-DDTHH:MM:SSZ`, when readable.
    pub not_after: Option<String>,
    /// SHA-256 of the DER, lowercase hex (`openssl x509 -fingerprint
    /// -sha256` without the colons).
    pub sha256: String,
}

impl CertInfo {
    pub fn of(cert: &CertificateDer<'_>) -> CertInfo {
        let der = cert.as_ref();
        let digest = ring::digest::digest(&ring::digest::SHA256, der);
        let sha256 = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        let (subject, not_after) = read(der).unwrap_or((None, None));
        CertInfo {
            subject,
            not_after,
            sha256,
        }
    }
}

impl fmt::Display for CertInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "subject {}, expires {}, sha256 {}",
            self.subject.as_deref().unwrap_or("(unreadable)"),
            self.not_after.as_deref().unwrap_or("(unreadable)"),
            self.sha256
        )
    }
}

/// One DER element: (tag, contents, rest of the input).
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |a, &b| (a << 8) | b as usize);
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;

type Read = (Option<String>, Option<String>);

fn read(der: &[u8]) -> Option<Read> {
    let (SEQUENCE, cert, _) = element(der)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = element(cert)? else {
        return None;
    };
    let mut rest = tbs;
    // version [0] EXPLICIT, optional.
    let (tag, _, r) = element(rest)?;
    if tag == 0xa0 {
        rest = r;
    }
    // serialNumber, signature, issuer.
    for _ in 0..3 {
        rest = element(rest)?.2;
    }
    let (SEQUENCE, validity, r) = element(rest)? else {
        return None;
    };
    // notBefore, then notAfter.
    let (_, _, v) = element(validity)?;
    let (tag, t, _) = element(v)?;
    let after = time(tag, t);
    let (subject_tag, subject, _) = element(r)?;
    let subject = (subject_tag == SEQUENCE).then(|| name(subject)).flatten();
    Some((subject, after))
}

/// UTCTime (0x17, `YYMMDDHHMMSSZ`) or GeneralizedTime (0x18,
/// `YYYYMMDDHHMMSSZ`) as `YYYY-MM-DDTHH:MM:SSZ`.
fn time(tag: u8, t: &[u8]) -> Option<String> {
    // ASCII only, so that the slicing below is on character boundaries.
    let t = std::str::from_utf8(t).ok().filter(|t| t.is_ascii())?;
    let full = match (tag, t.len()) {
        (0x17, 13) => {
            // RFC 5280 §4.1.2.5.1: YY >= 50 is 19YY.
            let yy: u32 = t.get(..2)?.parse().ok()?;
            format!("{}{t}", if yy >= 50 { "19" } else { "20" })
        }
        (0x18, 15) => t.to_string(),
        _ => return None,
    };
    if !full.ends_with('Z') || !full[..14].bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(format!(
        "{}-{}-{}T{}:{}:{}Z",
        &full[..4],
        &full[4..6],
        &full[6..8],
        &full[8..10],
        &full[10..12],
        &full[12..14]
    ))
}

/// A Name's well-known attributes, in order: `CN=a,O=b`.
fn name(mut rdns: &[u8]) -> Option<String> {
    let mut parts = Vec::new();
    while !rdns.is_empty() {
        let (SET, mut set, r) = element(rdns)? else {
            return None;
        };
        rdns = r;
        while !set.is_empty() {
            let (SEQUENCE, atv, r) = element(set)? else {
                return None;
            };
            set = r;
            let (0x06, oid, v) = element(atv)? else {
                return None;
            };
            let (_, value, _) = element(v)?;
            let label = match oid {
                [0x55, 0x04, 0x03] => "CN",
                [0x55, 0x04, 0x06] => "C",
                [0x55, 0x04, 0x07] => "L",
                [0x55, 0x04, 0x08] => "ST",
                [0x55, 0x04, 0x0a] => "O",
                [0x55, 0x04, 0x0b] => "OU",
                _ => continue,
            };
            // UTF8String, PrintableString, IA5String, TeletexString: bytes
            // as text; anything else (BMPString) is shown lossily.
            parts.push(format!("{label}={}", String::from_utf8_lossy(value)));
        }
    }
    Some(if parts.is_empty() {
        "(empty)".to_string()
    } else {
        parts.join(",")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_subject_and_expiry_and_survives_garbage() {
        let mut p = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "cert-a.example");
        p.distinguished_name
            .push(rcgen::DnType::OrganizationName, "Capybara");
        p.not_after = rcgen::date_time_ymd(2031, 5, 6);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.clone().self_signed(&key).unwrap();
        let info = CertInfo::of(cert.der());
        assert_eq!(
            info.subject.as_deref(),
            Some("CN=cert-a.example,O=Capybara")
        );
        assert_eq!(info.not_after.as_deref(), Some("2031-05-06T00:00:00Z"));
        assert_eq!(info.sha256.len(), 64);
        // GeneralizedTime after 2049.
        p.not_after = rcgen::date_time_ymd(2051, 1, 2);
        let cert = p.self_signed(&key).unwrap();
        assert_eq!(
            CertInfo::of(cert.der()).not_after.as_deref(),
            Some("2051-01-02T00:00:00Z")
        );
        // Every truncation and a byte flipped anywhere: no panic.
        let der = cert.der().to_vec();
        for n in 0..der.len() {
            let _ = CertInfo::of(&CertificateDer::from(&der[..n]));
            let mut d = der.clone();
            d[n] ^= 0xff;
            let _ = CertInfo::of(&CertificateDer::from(d)).to_string();
        }
    }
}
