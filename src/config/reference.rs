//! `docs/configuration.md`, generated from [`SETTINGS`](super::SETTINGS).

use std::fmt::Write as _;

use super::{Config, SETTINGS};

const MARKDOWN_INTRO: &str = "\
The broker reads these environment variables at startup; a bad value stops it with a message \
naming the variable, the value and what is allowed. `taskbroker config` prints the effective \
configuration with secrets redacted.

This file is generated from `src/config/settings.rs`: regenerate it with
`cargo run -- config --markdown > docs/configuration.md`.

";

const MARKDOWN_FORMATS: &str = "
## Formats

- An empty value counts as unset; surrounding whitespace is ignored.
- Durations are whole numbers in the unit their name ends with: `_MS` milliseconds, `_SEC` seconds.
- `TASKBROKER_WORKER_ENDPOINTS`: entries separated by `;`, each `application=url`; several URLs
  for one application are separated by `|` and pushes are spread over them; the application `*`
  serves every application without its own entry. Example:
  `billing=http://billing-0:50052|http://billing-1:50052;*=http://worker:50052`.
- `TASKBROKER_KAFKA_CONFIG`: comma-separated `key=value` librdkafka properties applied to the
  consumer and the producers, e.g.
  `security.protocol=SASL_PLAINTEXT,sasl.mechanism=PLAIN,sasl.username=broker,sasl.password=...`.
- `TASKBROKER_GRPC_SHARED_SECRETS`: comma-separated. To rotate, append the new secret everywhere,
  then move it first (pushes are signed with the first), then remove the old one.

## Claim lease

A claimed activation must not return to Pending while its push may still succeed, so the
default lease covers the longest legitimate time between a claim and its push result:

```text
  PUSH_QUEUE_TIMEOUT_MS                                       submitting to a full push pool
+ ceil((PUSH_QUEUE_SIZE + FETCH_ACTORS + 1) / PUSH_CONCURRENCY)
    * PUSH_TIMEOUT_MS                                         waiting behind busy push slots
+ PUSH_TIMEOUT_MS                                             its own push
+ 5000                                                        the mark-processing write
```

";

const MARKDOWN_LEASE_AND_COMMIT: &str = "\
The push pool's mailbox holds `PUSH_QUEUE_SIZE` activations plus one per FetchActor (each is a
sender, and actix lets every sender put one message into a full mailbox), and the pool holds one
more while it waits for a free slot: hence `PUSH_QUEUE_SIZE + FETCH_ACTORS + 1`.
`TASKBROKER_CLAIM_LEASE_MS` overrides it; a value below the formula without its 5000 ms margin
is refused. A longer lease only delays redelivery after a broker crash; a lease that is too short
delivers tasks twice.

## Asynchronous commit

With `TASKBROKER_DB_ASYNC_COMMIT=true` the transitions that a lease or a deadline would replay
anyway (claim, mark processing, removal of finished rows) commit without waiting for the
database's write-ahead log flush. After a database crash some tasks run twice; none is lost,
because inserts of consumed activations always commit durably before their offsets.
";

/// The full content of `docs/configuration.md`, generated from [`SETTINGS`].
pub fn reference_markdown() -> String {
    fn cell(text: &str) -> String {
        text.replace('|', "\\|")
    }
    let mut out = String::from("# Configuration\n\n");
    out.push_str(MARKDOWN_INTRO);
    out.push_str("| Variable | Default | Allowed | Description |\n");
    out.push_str("|---|---|---|---|\n");
    for setting in SETTINGS {
        let default = if setting.default.is_empty() {
            "unset".to_owned()
        } else {
            format!("`{}`", setting.default)
        };
        let mut description = setting.description.to_owned();
        if setting.secret {
            description.push_str(" Secret: never printed.");
        }
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} |",
            setting.variable(),
            cell(&default),
            cell(&setting.allowed.describe()),
            cell(&description),
        );
    }
    out.push_str(MARKDOWN_FORMATS);
    // Computed, so the example cannot go stale when a default changes.
    // Push mode refuses to start without endpoints; the lease does not
    // depend on them, so derive it from the other defaults.
    let defaults =
        Config::from_lookup(|name| (name == "TASKBROKER_DELIVERY_MODE").then(|| "pull".to_owned()));
    if let Ok(defaults) = defaults {
        let _ = writeln!(
            out,
            "With the defaults that is {} ms.",
            defaults.claim_lease().as_millis()
        );
    }
    out.push_str(MARKDOWN_LEASE_AND_COMMIT);
    out
}
