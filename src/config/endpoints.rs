//! `TASKBROKER_WORKER_ENDPOINTS`: which worker URLs serve which application.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

/// Push routing: application → worker URLs, with an optional `*` fallback.
///
/// Format: entries separated by `;`, each `application=url`, several URLs for one application
/// separated by `|`; the application `*` serves every application without its own entry.
/// Example: `billing=http://billing-0:50052|http://billing-1:50052;*=https://worker:50052`
/// (`https://` URLs connect over TLS: `WORKER_TLS_CA`, `WORKER_TLS_CERT`, `WORKER_TLS_KEY`).
///
/// Its `Debug` form redacts credentials in URLs (`user:pass@`), like [`WorkerEndpoints::redacted`].
#[derive(Clone, Default, PartialEq, Eq)]
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

    /// The canonical form with credentials in URLs replaced by `<redacted>`: what the broker
    /// prints (`taskbroker config`, logs).
    pub fn redacted(&self) -> String {
        self.render(redact_url)
    }

    fn render(&self, show: impl for<'a> Fn(&'a str) -> Cow<'a, str>) -> String {
        let fallback = self.fallback.as_deref().map(|urls| (Self::FALLBACK, urls));
        let entries = self.applications().chain(fallback);
        let mut out = String::new();
        for (i, (application, urls)) in entries.enumerate() {
            if i > 0 {
                out.push(';');
            }
            out.push_str(application);
            out.push('=');
            for (j, url) in urls.iter().enumerate() {
                if j > 0 {
                    out.push('|');
                }
                out.push_str(&show(url));
            }
        }
        out
    }

    /// True when no application is routed at all.
    pub fn is_empty(&self) -> bool {
        self.by_application.is_empty() && self.fallback.is_none()
    }
}

/// The canonical form: applications sorted, `*` last; it parses back to the same value. It keeps
/// credentials: print [`WorkerEndpoints::redacted`] instead.
impl fmt::Display for WorkerEndpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(|url| Cow::Borrowed(url)))
    }
}

impl fmt::Debug for WorkerEndpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkerEndpoints({})", self.redacted())
    }
}

/// `text` with the user information (`user:pass@` before the host) of every URL in it replaced
/// by `<redacted>`, for logs, errors and printed configuration. Works on one URL or on a whole
/// `WORKER_ENDPOINTS` value; text without credentials comes back unchanged.
pub fn redact_url(text: &str) -> Cow<'_, str> {
    if !text.contains('@') {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("://") {
        let (head, tail) = rest.split_at(start + 3);
        out.push_str(head);
        let authority_end = tail
            .find(|c: char| matches!(c, '/' | '?' | '#' | '|' | ';') || c.is_whitespace())
            .unwrap_or(tail.len());
        match tail[..authority_end].rfind('@') {
            Some(at) => {
                out.push_str(super::REDACTED);
                rest = &tail[at..];
            }
            None => rest = tail,
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn check_http_url(url: &str) -> Result<&str, String> {
    // Errors show the URL redacted: it may carry credentials.
    let shown = redact_url(url);
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    match rest {
        None => Err(format!(
            "URL `{shown}` does not start with `http://` or `https://`"
        )),
        Some(rest) if rest.is_empty() || rest.starts_with('/') => {
            Err(format!("URL `{shown}` has no host"))
        }
        Some(_) if url.contains(char::is_whitespace) => {
            Err(format!("URL `{shown}` contains whitespace"))
        }
        Some(_) => Ok(url),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_urls_are_redacted() {
        assert_eq!(
            redact_url("http://user:secret@worker:50052/path"),
            "http://<redacted>@worker:50052/path"
        );
        assert_eq!(
            redact_url("http://token@worker:1"),
            "http://<redacted>@worker:1"
        );
        assert_eq!(redact_url("http://worker:50052"), "http://worker:50052");
        // An `@` after the authority is not user information.
        assert_eq!(redact_url("http://w:1/a@b"), "http://w:1/a@b");
        let endpoints = WorkerEndpoints::parse("a=http://u:p@w1:1|http://w2:2;*=http://x:y@w3:3")
            .expect("valid");
        let shown = endpoints.redacted();
        assert_eq!(
            shown,
            "a=http://<redacted>@w1:1|http://w2:2;*=http://<redacted>@w3:3"
        );
        assert!(!format!("{endpoints:?}").contains("p@"));
        // The canonical form still round-trips.
        assert_eq!(
            WorkerEndpoints::parse(&endpoints.to_string()),
            Ok(endpoints)
        );
        let err = WorkerEndpoints::parse("a=ftp://u:hunter2@w:1").unwrap_err();
        assert!(!err.contains("hunter2"), "{err}");
        assert_eq!(
            redact_url("a=http://u:p@w1:1|http://w2:2;b=http://k@w3:3/x"),
            "a=http://<redacted>@w1:1|http://w2:2;b=http://<redacted>@w3:3/x"
        );
    }
}
