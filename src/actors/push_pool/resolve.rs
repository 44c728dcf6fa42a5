//! How worker host names become addresses: the system resolver in
//! production; a table the caller edits in tests, so a test can add and
//! remove the "pods" behind one name the way a headless Service's DNS
//! answers change, without touching the machine's resolver.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Longest wait for one lookup: a resolver that hangs must not hold up the
/// refresh of every other worker URL for long.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// Where worker host names are looked up.
#[derive(Debug, Clone, Default)]
pub enum Resolver {
    /// The system's resolver (`getaddrinfo`: /etc/hosts, then DNS).
    #[default]
    System,
    /// A fixed table of host → addresses; names not in it do not resolve.
    Hosts(StaticHosts),
}

/// A host table shared with whoever edits it.
#[derive(Debug, Clone, Default)]
pub struct StaticHosts(Arc<Mutex<HashMap<String, Vec<IpAddr>>>>);

impl StaticHosts {
    /// Makes `host` resolve to `addresses` (none: it stops resolving).
    pub fn set(&self, host: &str, addresses: Vec<IpAddr>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(host.to_owned(), addresses);
    }

    fn get(&self, host: &str) -> Option<Vec<IpAddr>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(host)
            .cloned()
    }
}

impl Resolver {
    /// The addresses of `host`, sorted and without duplicates; an error when
    /// the name does not resolve or resolves to nothing.
    pub async fn lookup(&self, host: &str, port: u16) -> io::Result<Vec<IpAddr>> {
        let mut addresses = match self {
            Resolver::System => {
                let lookup = tokio::net::lookup_host((host, port));
                tokio::time::timeout(LOOKUP_TIMEOUT, lookup)
                    .await
                    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "lookup took over 5 s"))??
                    .map(|address| address.ip())
                    .collect::<Vec<_>>()
            }
            Resolver::Hosts(hosts) => hosts.get(host).unwrap_or_default(),
        };
        addresses.sort_unstable();
        addresses.dedup();
        if addresses.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{host} resolves to no address"),
            ));
        }
        Ok(addresses)
    }
}
