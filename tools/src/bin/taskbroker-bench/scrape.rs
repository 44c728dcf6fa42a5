//! Reading the broker's `/metrics`: a plain HTTP GET, sums of series,
//! push results and histogram quantiles between two scrapes.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sum of every series of `name` whose labels contain `labels` (`""`: all).
pub fn metric(text: &str, name: &str, labels: &str) -> f64 {
    metric_if_present(text, name, labels).unwrap_or(0.0)
}

/// As [`metric`], but `None` when no such series is exposed (a broker
/// without that metric, to be told apart from one at 0).
pub fn metric_if_present(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, series_labels) = match series.split_once('{') {
                Some((n, l)) => (n, l),
                None => (series, ""),
            };
            (series_name == name && series_labels.contains(labels)).then_some(value)
        })
        .filter_map(|value| value.parse::<f64>().ok())
        .fold(None, |sum, value| Some(sum.unwrap_or(0.0) + value))
}

/// The `q` quantile (0..1) of the events a histogram series recorded
/// between two scrapes, as Prometheus' `histogram_quantile` reads it:
/// linear within the bucket it falls in. `labels` selects the series
/// (`stage="stored_to_claimed"`); `None` without events.
pub fn histogram_quantile(
    before: &str,
    after: &str,
    name: &str,
    labels: &str,
    q: f64,
) -> Option<f64> {
    let buckets = |text: &str| -> Vec<(f64, f64)> {
        let bucket_name = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = text
            .lines()
            .filter(|line| line.starts_with(&bucket_name) && line.contains(labels))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let le = series.split("le=\"").nth(1)?.split('"').next()?;
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((bound, value.parse().ok()?))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        buckets
    };
    let (start, end) = (buckets(before), buckets(after));
    let counts: Vec<(f64, f64)> = end
        .iter()
        .map(|(bound, count)| {
            let earlier = start
                .iter()
                .find(|(b, _)| b == bound)
                .map_or(0.0, |(_, c)| *c);
            (*bound, count - earlier)
        })
        .collect();
    let total = counts.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for (bound, count) in counts {
        if count >= rank {
            if bound.is_infinite() {
                return Some(lower.0);
            }
            let within = (rank - lower.1) / (count - lower.1).max(f64::MIN_POSITIVE);
            return Some(lower.0 + (bound - lower.0) * within);
        }
        lower = (bound, count);
    }
    Some(lower.0)
}

/// `taskbroker_pushes_total` by result, as `ok 10, stale 1, …` (non-zero
/// results only), between two scrapes.
pub fn push_results(before: &str, after: &str) -> String {
    taskbroker::metrics::labels::PUSH_RESULTS
        .iter()
        .filter_map(|result| {
            let label = format!("result=\"{result}\"");
            let n = metric(after, "taskbroker_pushes_total", &label)
                - metric(before, "taskbroker_pushes_total", &label);
            (n > 0.0).then(|| format!("{result} {n:.0}"))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A plain HTTP/1.0 GET on loopback: (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream =
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
            .await
            .map_err(|_| std::io::Error::other("connect timed out"))??;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response))
        .await
        .map_err(|_| std::io::Error::other("read timed out"))??;
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::histogram_quantile;

    #[test]
    fn quantiles_are_read_from_the_buckets_filled_between_two_scrapes() {
        let scrape = |counts: [u32; 4]| {
            format!(
                "h_bucket{{stage=\"a\",le=\"0.001\"}} {}\nh_bucket{{stage=\"a\",le=\"0.01\"}} {}\n\
                 h_bucket{{stage=\"a\",le=\"0.1\"}} {}\nh_bucket{{stage=\"a\",le=\"+Inf\"}} {}\n\
                 h_bucket{{stage=\"b\",le=\"+Inf\"}} 7\n",
                counts[0], counts[1], counts[2], counts[3]
            )
        };
        let before = scrape([5, 5, 5, 5]);
        // 100 new events: 50 under 1 ms, 40 more under 10 ms, 10 under 100 ms.
        let after = scrape([55, 95, 105, 105]);
        let q = |q| histogram_quantile(&before, &after, "h", "stage=\"a\"", q).unwrap();
        assert!((q(0.5) - 0.001).abs() < 1e-9);
        assert!((q(0.7) - 0.0055).abs() < 1e-9, "{}", q(0.7));
        assert!((q(0.99) - 0.091).abs() < 1e-9, "{}", q(0.99));
        assert_eq!(
            histogram_quantile(&after, &after, "h", "stage=\"a\"", 0.5),
            None
        );
    }
}
