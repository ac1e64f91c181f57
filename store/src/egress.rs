//! The SSRF guard: which addresses webhooks may be sent to.
//!
//! A node sends HTTP requests to URLs that API callers register, so a
//! handler URL must not reach what only the node can reach: its own
//! loopback services, the private network around it, the cloud metadata
//! endpoint (`169.254.169.254`). [`EgressPolicy`] refuses a target address
//! in any of these ranges ([`refused_range`]) unless it falls in one of the
//! node's allowed CIDRs (node option `webhook_allow_cidrs`, flag
//! `--webhook-allow-cidrs`, env `LANEBUS_WEBHOOK_ALLOW_CIDRS`, comma-separated):
//!
//! | range | why |
//! | --- | --- |
//! | `0.0.0.0/8`, `::/128` | unspecified ("this host") |
//! | `127.0.0.0/8`, `::1/128` | loopback |
//! | `10.0.0.0/8`, `172.16.0.0/12`, `192.168.0.0/16` | private (RFC 1918) |
//! | `100.64.0.0/10` | shared address space, carrier-grade NAT (RFC 6598) |
//! | `169.254.0.0/16`, `fe80::/10` | link-local (cloud metadata lives here) |
//! | `192.0.0.0/24`, `198.18.0.0/15`, `240.0.0.0/4` | IETF protocol assignments, benchmarking, reserved |
//! | `255.255.255.255/32` | broadcast |
//! | `224.0.0.0/4`, `ff00::/8` | multicast |
//! | `fc00::/7`, `fec0::/10` | unique-local, site-local (deprecated) |
//! | `::ffff:0:0/96`, `::/96`, `64:ff9b::/96`, `2002::/16` | IPv4-mapped, IPv4-compatible, NAT64 and 6to4 forms: the embedded IPv4 address is checked |
//!
//! The ranges are those of the IANA special-purpose address registries
//! (<https://www.iana.org/assignments/iana-ipv4-special-registry>,
//! <https://www.iana.org/assignments/iana-ipv6-special-registry>) that are
//! not globally reachable, less the documentation ranges (harmless: nothing
//! answers there).
//!
//! The check runs twice: at registration ([`EgressPolicy::check_url`]: the
//! scheme must be `http`, `https`, `nats` or `kafka`, and every address the host resolves to
//! must pass; a name that does not resolve is accepted, since the send-time
//! check covers it) and at send time, where the node's HTTP client resolves
//! names through the policy and connects only to addresses it passed, so a
//! DNS answer that changed since registration (rebinding) cannot slip
//! between check and connect. A send-time refusal is a failed attempt whose
//! error says which address was refused and why.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

pub use ipnet::IpNet;

/// How long a registration waits for the DNS answer before accepting the
/// URL unchecked (the send-time check still applies).
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The flag, environment variable and option that allow refused ranges,
/// as named in messages.
pub const ALLOW_OPTION: &str =
    "webhook_allow_cidrs (--webhook-allow-cidrs, LANEBUS_WEBHOOK_ALLOW_CIDRS)";

/// Where webhooks may be sent: everything but the [`refused_range`]s, plus
/// the allowed CIDRs. Cheap to clone. The default allows no refused range.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    allow: Arc<[IpNet]>,
}

/// Why a target was refused; its `Display` is the message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

impl EgressPolicy {
    /// A policy allowing, besides public addresses, the addresses in `allow`.
    pub fn new(allow: Vec<IpNet>) -> Self {
        EgressPolicy {
            allow: allow.into(),
        }
    }

    /// A policy allowing loopback (`127.0.0.0/8`, `::1/128`): for tests and
    /// the demo, whose receivers listen on this machine.
    pub fn allow_loopback() -> Self {
        EgressPolicy::new(vec![
            "127.0.0.0/8".parse().expect("valid cidr"),
            "::1/128".parse().expect("valid cidr"),
        ])
    }

    /// The allowed CIDRs.
    pub fn allowed(&self) -> &[IpNet] {
        &self.allow
    }

    /// Parses a comma-separated list of CIDRs (`127.0.0.0/8,::1/128`); a bare
    /// address counts as a single-address network. Blank entries are skipped.
    ///
    /// # Errors
    /// A message naming the entry that does not parse.
    pub fn parse_cidrs(list: &str) -> Result<Vec<IpNet>, String> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<IpNet>()
                    .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                    .map(|n| n.trunc())
                    .map_err(|_| {
                        format!("webhook_allow_cidrs entry {s:?} is not a CIDR such as 10.0.0.0/8 or ::1/128")
                    })
            })
            .collect()
    }

    /// Whether webhooks may be sent to `ip`.
    ///
    /// # Errors
    /// [`Refused`] naming the address and its range.
    pub fn check_ip(&self, ip: IpAddr) -> Result<(), Refused> {
        let Some(range) = refused_range(ip) else {
            return Ok(());
        };
        let canonical = ip.to_canonical();
        if self
            .allow
            .iter()
            .any(|n| n.contains(&ip) || n.contains(&canonical))
        {
            return Ok(());
        }
        Err(Refused(format!(
            "{ip}, which is {range}; webhooks go only to public addresses unless {ALLOW_OPTION} allows it"
        )))
    }

    /// The registration check of a handler URL: scheme `http`, `https`, `nats` or `kafka`, a
    /// host, and every address the host resolves to allowed
    /// ([`check_ip`](Self::check_ip)). A name that does not resolve (or not
    /// within [`RESOLVE_TIMEOUT`]) passes: the send-time check covers it.
    ///
    /// # Errors
    /// [`Refused`] naming the URL, the address and the reason.
    pub async fn check_url(&self, raw: &str) -> Result<(), Refused> {
        let url = url::Url::parse(raw).map_err(|e| Refused(format!("url {raw:?}: {e}")))?;
        use crate::rules::handler::{KAFKA_PORT, KAFKA_SCHEME, NATS_PORT, NATS_SCHEME};
        let port = match url.scheme() {
            "http" | "https" => url.port_or_known_default().unwrap_or(80),
            NATS_SCHEME => url.port().unwrap_or(NATS_PORT),
            KAFKA_SCHEME => url.port().unwrap_or(KAFKA_PORT),
            other => {
                return Err(Refused(format!(
                    "url {raw:?} has scheme {other:?}, expected http, https, nats or kafka"
                )))
            }
        };
        let addrs: Vec<IpAddr> = match url.host() {
            None => return Err(Refused(format!("url {raw:?} has no host"))),
            Some(url::Host::Ipv4(ip)) => vec![IpAddr::V4(ip)],
            Some(url::Host::Ipv6(ip)) => vec![IpAddr::V6(ip)],
            Some(url::Host::Domain(name)) => {
                match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((name, port)))
                    .await
                {
                    Ok(Ok(found)) => found.map(|a| a.ip()).collect(),
                    _ => Vec::new(),
                }
            }
        };
        for ip in addrs {
            self.check_ip(ip).map_err(|e| match url.host() {
                Some(url::Host::Domain(name)) => {
                    Refused(format!("url {raw:?}: host {name:?} resolves to {e}"))
                }
                _ => Refused(format!("url {raw:?} points to {e}")),
            })?;
        }
        Ok(())
    }
}

/// The refused range `ip` lies in, described for people (`"loopback"`,
/// `"private (RFC 1918)"`, ...), or `None` for an address webhooks may go to
/// without an allowlist (module docs list the ranges).
pub fn refused_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => refused_v6(v6),
    }
}

fn refused_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        _ if ip.is_broadcast() => "the broadcast address",
        (0, _, _) => "unspecified (0.0.0.0/8)",
        (127, _, _) => "loopback",
        (10, _, _) => "private (RFC 1918)",
        (172, 16..=31, _) => "private (RFC 1918)",
        (192, 168, _) => "private (RFC 1918)",
        (100, 64..=127, _) => "shared address space (carrier-grade NAT, 100.64.0.0/10)",
        (169, 254, _) => "link-local (169.254.0.0/16, cloud metadata)",
        (192, 0, 0) => "reserved for IETF protocol assignments (192.0.0.0/24)",
        (198, 18..=19, _) => "reserved for benchmarking (198.18.0.0/15)",
        (224..=239, _, _) => "multicast",
        (240..=255, _, _) => "reserved (240.0.0.0/4)",
        _ => return None,
    })
}

fn refused_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let seg = ip.segments();
    if ip.is_unspecified() {
        return Some("unspecified (::)");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    // Forms that embed an IPv4 address: the embedded one decides.
    let embedded = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    let v4 = match seg {
        [0, 0, 0, 0, 0, 0xffff, hi, lo] => Some(("IPv4-mapped", embedded(hi, lo))),
        [0, 0, 0, 0, 0, 0, hi, lo] => Some(("IPv4-compatible", embedded(hi, lo))),
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => Some(("NAT64", embedded(hi, lo))),
        [0x2002, hi, lo, ..] => Some(("6to4", embedded(hi, lo))),
        _ => None,
    };
    if let Some((form, v4)) = v4 {
        return refused_v4(v4).map(|_| match form {
            "IPv4-mapped" => "an IPv4-mapped form of a refused IPv4 address",
            "IPv4-compatible" => "an IPv4-compatible form of a refused IPv4 address",
            "NAT64" => "a NAT64 form of a refused IPv4 address",
            _ => "a 6to4 form of a refused IPv4 address",
        });
    }
    Some(match seg[0] {
        s if s & 0xfe00 == 0xfc00 => "unique-local (fc00::/7)",
        s if s & 0xffc0 == 0xfe80 => "link-local (fe80::/10)",
        s if s & 0xffc0 == 0xfec0 => "site-local (fec0::/10)",
        s if s & 0xff00 == 0xff00 => "multicast",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    #[test]
    fn internal_ranges_are_refused_and_public_ones_pass() {
        let deny = EgressPolicy::default();
        for bad in [
            "127.0.0.1",
            "127.255.0.9",
            "10.0.0.1",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.254",
            "169.254.169.254",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "240.0.0.1",
            "::",
            "::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a00:1",
            "2002:7f00:1::",
        ] {
            assert!(deny.check_ip(ip(bad)).is_err(), "{bad} passed");
        }
        for good in [
            "1.1.1.1",
            "93.184.216.34",
            "172.32.0.1",
            "100.128.0.1",
            "192.169.0.1",
            "2606:4700:4700::1111",
            "::ffff:1.1.1.1",
            "64:ff9b::101:101",
        ] {
            assert!(deny.check_ip(ip(good)).is_ok(), "{good} refused");
        }
        let msg = deny.check_ip(ip("169.254.169.254")).unwrap_err().0;
        assert!(
            msg.contains("link-local") && msg.contains("webhook_allow_cidrs"),
            "{msg}"
        );
    }

    #[test]
    fn the_allowlist_opens_its_ranges_and_no_more() {
        let p =
            EgressPolicy::new(EgressPolicy::parse_cidrs(" 127.0.0.0/8, ::1 ,10.1.0.0/16").unwrap());
        for ok in ["127.0.0.1", "::1", "::ffff:127.0.0.1", "10.1.2.3"] {
            assert!(p.check_ip(ip(ok)).is_ok(), "{ok} refused");
        }
        for bad in ["10.2.0.1", "192.168.0.1", "fe80::1"] {
            assert!(p.check_ip(ip(bad)).is_err(), "{bad} passed");
        }
        let e = EgressPolicy::parse_cidrs("127.0.0.0/8,localhost").unwrap_err();
        assert!(e.contains("\"localhost\""), "{e}");
        assert_eq!(EgressPolicy::parse_cidrs("").unwrap(), Vec::<IpNet>::new());
    }

    #[tokio::test]
    async fn urls_are_checked_by_scheme_and_every_resolved_address() {
        let deny = EgressPolicy::default();
        for bad in [
            "http://127.0.0.1/",
            "http://10.0.0.1/",
            "http://[::1]/",
            "http://169.254.169.254/latest/meta-data/",
            "http://[::ffff:7f00:1]/",
            "file:///etc/passwd",
            "ftp://example.com/x",
            "http://localhost:9/",
            "nats://127.0.0.1:4222/orders",
            "nats://10.1.2.3/orders",
            "kafka://10.1.2.3/orders",
            "kafka://127.0.0.1:9092/orders",
        ] {
            let e = deny.check_url(bad).await;
            assert!(e.is_err(), "{bad} passed");
        }
        let e = deny.check_url("http://localhost:9/").await.unwrap_err().0;
        assert!(
            e.contains("\"localhost\" resolves to") && e.contains("loopback"),
            "{e}"
        );
        // Public literal and a name that does not resolve pass.
        assert!(deny.check_url("https://1.1.1.1/hook").await.is_ok());
        assert!(deny.check_url("http://inproc.invalid/x").await.is_ok());
        let allow = EgressPolicy::allow_loopback();
        assert!(allow.check_url("http://127.0.0.1:9/").await.is_ok());
        assert!(allow.check_url("http://[::1]:9/").await.is_ok());
        assert!(allow.check_url("http://localhost:9/").await.is_ok());
        assert!(allow.check_url("nats://127.0.0.1/orders").await.is_ok());
        assert!(allow.check_url("kafka://127.0.0.1/orders").await.is_ok());
        assert!(allow.check_url("http://10.0.0.1/").await.is_err());
    }
}
