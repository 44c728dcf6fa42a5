//! `TASKBROKER_WORKER_ENDPOINTS`: which worker URLs serve which application.

use std::collections::BTreeMap;
use std::fmt;

/// Push routing: application → worker URLs, with an optional `*` fallback.
///
/// Format: entries separated by `;`, each `application=url`, several URLs for one application
/// separated by `|`; the application `*` serves every application without its own entry.
/// Example: `billing=http://billing-0:50052|http://billing-1:50052;*=http://worker:50052`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerEndpoints {
    by_application: BTreeMap<String, Vec<String>>,
    fallback: Option<Vec<String>>,
}

impl WorkerEndpoints {
    /// The application name that matches every application without its own entry.
    pub const FALLBACK: &'static str = "*";

    /// Parses the format above; the error says which entry is wrong and why.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut endpoints = Self::default();
        for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((application, urls)) = entry.split_once('=') else {
                return Err(format!("entry `{entry}` has no `=`"));
            };
            let application = application.trim();
            if application.is_empty() || application.contains(char::is_whitespace) {
                return Err(format!(
                    "entry `{entry}` needs an application name without spaces before `=`"
                ));
            }
            let urls = urls
                .split('|')
                .map(|url| check_http_url(url.trim()).map(str::to_owned))
                .collect::<Result<Vec<_>, _>>()?;
            if application == Self::FALLBACK {
                if endpoints.fallback.replace(urls).is_some() {
                    return Err("application `*` appears twice".to_owned());
                }
            } else if endpoints
                .by_application
                .insert(application.to_owned(), urls)
                .is_some()
            {
                return Err(format!("application `{application}` appears twice"));
            }
        }
        if endpoints.is_empty() {
            return Err("no entries".to_owned());
        }
        Ok(endpoints)
    }

    /// The URLs to push `application`'s activations to: its own entry, else the `*` entry.
    pub fn endpoints_for(&self, application: &str) -> Option<&[String]> {
        self.by_application
            .get(application)
            .or(self.fallback.as_ref())
            .map(Vec::as_slice)
    }

    /// The URLs of the `*` entry.
    pub fn fallback(&self) -> Option<&[String]> {
        self.fallback.as_deref()
    }

    /// Applications with their own entry, sorted by name.
    pub fn applications(&self) -> impl Iterator<Item = (&str, &[String])> {
        self.by_application
            .iter()
            .map(|(application, urls)| (application.as_str(), urls.as_slice()))
    }

    /// Every distinct URL, sorted: one channel each is enough.
    pub fn all_urls(&self) -> Vec<&str> {
        let mut urls: Vec<&str> = self
            .by_application
            .values()
            .chain(self.fallback.as_ref())
            .flatten()
            .map(String::as_str)
            .collect();
        urls.sort_unstable();
        urls.dedup();
        urls
    }

    /// True when no application is routed at all.
    pub fn is_empty(&self) -> bool {
        self.by_application.is_empty() && self.fallback.is_none()
    }
}

/// The canonical form: applications sorted, `*` last; it parses back to the same value.
impl fmt::Display for WorkerEndpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fallback = self.fallback.as_deref().map(|urls| (Self::FALLBACK, urls));
        let entries = self.applications().chain(fallback);
        for (i, (application, urls)) in entries.enumerate() {
            if i > 0 {
                f.write_str(";")?;
            }
            write!(f, "{application}={}", urls.join("|"))?;
        }
        Ok(())
    }
}

fn check_http_url(url: &str) -> Result<&str, String> {
    // No TLS client is built in yet: refuse https:// here rather than fail
    // every push later.
    let rest = url.strip_prefix("http://");
    match rest {
        None => Err(format!(
            "URL `{url}` does not start with `http://` (TLS to workers is not supported)"
        )),
        Some(rest) if rest.is_empty() || rest.starts_with('/') => {
            Err(format!("URL `{url}` has no host"))
        }
        Some(_) if url.contains(char::is_whitespace) => {
            Err(format!("URL `{url}` contains whitespace"))
        }
        Some(_) => Ok(url),
    }
}
