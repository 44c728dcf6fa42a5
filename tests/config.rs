//! Configuration: parsing, validation messages, the derived claim lease, redaction, and the
//! generated reference in `docs/configuration.md`. The process environment is never touched:
//! every test passes its own lookup.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use taskbroker::config::{
    Allowed, AutoOffsetReset, CLAIM_LEASE_MARGIN, Config, ConfigError, DeliveryMode, ENV_PREFIX,
    LogFormat, REDACTED, SETTINGS, WorkerEndpoints, reference_markdown, unknown_variables,
};

/// Worker endpoints push mode (the default) requires; tests that are not
/// about them get this value unless they set the variable themselves.
const TEST_ENDPOINTS: &str = "*=http://worker:50052";

/// Parses with these variables set (full names), plus `TEST_ENDPOINTS`.
fn parse(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let mut env: HashMap<String, String> = vars
        .iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect();
    env.entry("TASKBROKER_WORKER_ENDPOINTS".to_owned())
        .or_insert_with(|| TEST_ENDPOINTS.to_owned());
    Config::from_lookup(|name| env.get(name).cloned())
}

#[test]
fn push_mode_requires_worker_endpoints() {
    assert_single_problem(
        &[("TASKBROKER_WORKER_ENDPOINTS", "")],
        "TASKBROKER_WORKER_ENDPOINTS=: is required when TASKBROKER_DELIVERY_MODE=push: name the \
         workers to push to, e.g. `*=http://worker:50052`, or set TASKBROKER_DELIVERY_MODE=pull",
    );
    let pull = parse_ok(&[
        ("TASKBROKER_WORKER_ENDPOINTS", ""),
        ("TASKBROKER_DELIVERY_MODE", "pull"),
    ]);
    assert!(pull.worker_endpoints.is_empty());
}

fn parse_ok(vars: &[(&str, &str)]) -> Config {
    match parse(vars) {
        Ok(config) => config,
        Err(error) => panic!("expected a valid configuration, got: {error}"),
    }
}

fn parse_err(vars: &[(&str, &str)]) -> ConfigError {
    match parse(vars) {
        Ok(config) => panic!("expected a configuration error, got: {config:?}"),
        Err(error) => error,
    }
}

/// Asserts the error has exactly one problem and its line names variable, value and allowed.
fn assert_single_problem(vars: &[(&str, &str)], expected_line: &str) {
    let error = parse_err(vars);
    assert_eq!(error.problems.len(), 1, "{error}");
    assert_eq!(error.problems[0].to_string(), expected_line);
    assert!(
        error
            .to_string()
            .lines()
            .any(|line| line.trim() == expected_line),
        "the error lists each problem on its own line: {error}"
    );
}

#[test]
fn defaults_parse_to_the_documented_values() {
    let config = parse_ok(&[]);
    assert_eq!(config.delivery_mode, DeliveryMode::Push);
    assert_eq!(config.database_url, None);
    assert_eq!(config.sqlite_path.to_str(), Some("./taskbroker.sqlite"));
    assert_eq!(config.db_pool_size, 16);
    assert!(!config.db_async_commit);
    assert_eq!(config.kafka_brokers, "127.0.0.1:9092");
    assert_eq!(config.kafka_topic, "taskworker");
    assert_eq!(config.kafka_consumer_group, "taskbroker");
    assert_eq!(config.kafka_retry_topic, None);
    assert_eq!(config.retry_topic(), "taskworker");
    assert_eq!(config.kafka_dlq_topic, "taskworker-dlq");
    assert_eq!(config.kafka_ingest_dlq_topic, "taskworker-ingest-dlq");
    assert_eq!(config.kafka_auto_offset_reset, AutoOffsetReset::Earliest);
    assert!(config.kafka_config.is_empty());
    assert_eq!(config.grpc_addr.to_string(), "0.0.0.0:50051");
    assert_eq!(config.grpc_advertised_addr, None);
    assert_eq!(config.metrics_addr.to_string(), "0.0.0.0:9090");
    assert!(config.grpc_shared_secrets.is_empty());
    assert_eq!(config.grpc_max_request_bytes, 8 * 1024 * 1024 + 64 * 1024);
    assert_eq!(
        config.worker_endpoints.endpoints_for("anything"),
        Some(&["http://worker:50052".to_string()][..])
    );
    assert_eq!(config.fetch_actors, 2);
    assert_eq!(config.fetch_batch_size, 64);
    assert_eq!(config.fetch_batch_bytes, 16 << 20);
    assert_eq!(config.fetch_backoff, Duration::from_millis(100));
    assert_eq!(config.push_concurrency, 64);
    assert_eq!(config.push_queue_size, 128);
    assert_eq!(config.push_queue_bytes, 64 << 20);
    assert_eq!(config.push_queue_timeout, Duration::from_millis(2000));
    assert_eq!(config.push_timeout, Duration::from_millis(5000));
    assert_eq!(config.claim_lease_override, None);
    assert_eq!(config.insert_batch_size, 256);
    assert_eq!(config.insert_batch_bytes, 16 << 20);
    assert_eq!(config.max_activation_bytes, 8_388_608);
    assert_eq!(config.insert_batch_max_wait, Duration::ZERO);
    assert_eq!(config.max_inflight, 30_000);
    assert_eq!(config.max_inflight_bytes, 2 << 30);
    assert_eq!(config.max_processing_attempts, 5);
    assert_eq!(config.processing_deadline_grace, Duration::from_secs(3));
    assert_eq!(config.max_delay, Duration::from_secs(3600));
    assert_eq!(config.upkeep_interval, Duration::from_millis(1000));
    assert_eq!(config.upkeep_batch_limit, 1000);
    assert_eq!(config.restart_grace, Duration::from_secs(60));
    assert_eq!(config.shutdown_timeout, Duration::from_millis(30_000));
    assert_eq!(config.log, "info");
    assert_eq!(config.log_format, LogFormat::Text);
}

#[test]
fn every_setting_is_read_through_the_lookup_with_its_full_name() {
    let asked = RefCell::new(Vec::new());
    let result = Config::from_lookup(|name| {
        asked.borrow_mut().push(name.to_string());
        (name == "TASKBROKER_DELIVERY_MODE").then(|| "pull".to_owned())
    });
    assert!(result.is_ok(), "{result:?}");
    let asked = asked.into_inner();
    let expected: Vec<String> = SETTINGS.iter().map(|s| s.variable()).collect();
    assert_eq!(asked, expected);
}

#[test]
fn setting_names_are_unique_and_well_formed() {
    let mut seen = HashSet::new();
    for setting in SETTINGS {
        assert!(seen.insert(setting.name), "{} appears twice", setting.name);
        assert!(
            !setting.name.starts_with(ENV_PREFIX)
                && setting
                    .name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'),
            "{} must be upper case without the prefix",
            setting.name
        );
        assert!(
            !setting.description.is_empty() && !setting.description.contains('\n'),
            "{} needs a one-line description",
            setting.name
        );
    }
}

#[test]
fn explicit_values_are_used_and_empty_values_count_as_unset() {
    let config = parse_ok(&[
        ("TASKBROKER_DELIVERY_MODE", "pull"),
        ("TASKBROKER_LOG_FORMAT", " JSON "),
        ("TASKBROKER_KAFKA_AUTO_OFFSET_RESET", "latest"),
        ("TASKBROKER_DB_ASYNC_COMMIT", "true"),
        ("TASKBROKER_FETCH_ACTORS", "8"),
        ("TASKBROKER_PROCESSING_DEADLINE_GRACE_SEC", "0"),
        ("TASKBROKER_KAFKA_RETRY_TOPIC", "taskworker-retry"),
        ("TASKBROKER_FETCH_BATCH_SIZE", ""),
        ("TASKBROKER_DATABASE_URL", "   "),
    ]);
    assert_eq!(config.delivery_mode, DeliveryMode::Pull);
    assert_eq!(config.log_format, LogFormat::Json);
    assert_eq!(config.kafka_auto_offset_reset, AutoOffsetReset::Latest);
    assert!(config.db_async_commit);
    assert_eq!(config.fetch_actors, 8);
    assert_eq!(config.processing_deadline_grace, Duration::ZERO);
    assert_eq!(config.retry_topic(), "taskworker-retry");
    assert_eq!(config.fetch_batch_size, 64);
    assert_eq!(config.database_url, None);
}

#[test]
fn non_number_is_refused_with_variable_value_and_range() {
    assert_single_problem(
        &[("TASKBROKER_FETCH_BATCH_SIZE", "lots")],
        "TASKBROKER_FETCH_BATCH_SIZE=lots: must be an integer from 1 to 1024",
    );
    assert_single_problem(
        &[("TASKBROKER_PUSH_TIMEOUT_MS", "-5")],
        "TASKBROKER_PUSH_TIMEOUT_MS=-5: must be a whole number of milliseconds from 100 to 300000",
    );
}

#[test]
fn out_of_range_number_is_refused() {
    assert_single_problem(
        &[("TASKBROKER_DB_POOL_SIZE", "0")],
        "TASKBROKER_DB_POOL_SIZE=0: must be an integer from 1 to 512",
    );
    assert_single_problem(
        &[("TASKBROKER_MAX_DELAY_SEC", "99999999999999999999999")],
        "TASKBROKER_MAX_DELAY_SEC=99999999999999999999999: \
         must be a whole number of seconds from 0 to 2592000",
    );
}

#[test]
fn fetch_actors_must_be_a_power_of_two() {
    assert_single_problem(
        &[("TASKBROKER_FETCH_ACTORS", "3")],
        "TASKBROKER_FETCH_ACTORS=3: must be a power of two between 1 and 256",
    );
    assert_single_problem(
        &[("TASKBROKER_FETCH_ACTORS", "512")],
        "TASKBROKER_FETCH_ACTORS=512: must be a power of two between 1 and 256",
    );
}

#[test]
fn unknown_words_are_refused_with_the_allowed_words() {
    assert_single_problem(
        &[("TASKBROKER_DELIVERY_MODE", "fast")],
        "TASKBROKER_DELIVERY_MODE=fast: must be one of `push`, `pull`",
    );
    assert_single_problem(
        &[("TASKBROKER_LOG_FORMAT", "xml")],
        "TASKBROKER_LOG_FORMAT=xml: must be one of `text`, `json`",
    );
    assert_single_problem(
        &[("TASKBROKER_DB_ASYNC_COMMIT", "yes")],
        "TASKBROKER_DB_ASYNC_COMMIT=yes: must be `true` or `false`",
    );
}

#[test]
fn database_url_with_another_scheme_is_refused_without_printing_it() {
    assert_single_problem(
        &[(
            "TASKBROKER_DATABASE_URL",
            "mysql://broker:hunter2@db:3306/tasks",
        )],
        "TASKBROKER_DATABASE_URL=<redacted>: must be a URL starting with `postgres://` or \
         `postgresql://` (the scheme is `mysql`)",
    );
    let error = parse_err(&[("TASKBROKER_DATABASE_URL", "hunter2")]);
    assert!(!error.to_string().contains("hunter2"), "{error}");

    let config = parse_ok(&[(
        "TASKBROKER_DATABASE_URL",
        "postgresql://broker:hunter2@db/tasks",
    )]);
    assert_eq!(
        config.database_url.as_deref(),
        Some("postgresql://broker:hunter2@db/tasks")
    );
}

#[test]
fn worker_endpoints_route_by_application_with_a_fallback() {
    let config = parse_ok(&[(
        "TASKBROKER_WORKER_ENDPOINTS",
        "billing=http://billing-0:50052|http://billing-1:50052; *=http://worker:50052;",
    )]);
    let endpoints = &config.worker_endpoints;
    assert_eq!(
        endpoints.endpoints_for("billing"),
        Some(
            &[
                "http://billing-0:50052".to_string(),
                "http://billing-1:50052".to_string()
            ][..]
        )
    );
    assert_eq!(
        endpoints.endpoints_for("search"),
        Some(&["http://worker:50052".to_string()][..])
    );
    assert_eq!(
        endpoints.all_urls(),
        vec![
            "http://billing-0:50052",
            "http://billing-1:50052",
            "http://worker:50052"
        ]
    );

    let without_fallback = WorkerEndpoints::parse("billing=http://billing:50052");
    assert_eq!(
        without_fallback.map(|e| e.endpoints_for("search").is_none()),
        Ok(true)
    );
}

#[test]
fn worker_endpoints_render_in_a_form_that_parses_back() {
    let text = "search=http://s:1;billing=http://b0:1|http://b1:1;*=http://w:1";
    let endpoints = WorkerEndpoints::parse(text).expect("valid endpoints");
    let canonical = endpoints.to_string();
    assert_eq!(
        canonical,
        "billing=http://b0:1|http://b1:1;search=http://s:1;*=http://w:1"
    );
    assert_eq!(WorkerEndpoints::parse(&canonical), Ok(endpoints));
}

#[test]
fn worker_endpoint_with_a_bad_url_scheme_is_refused() {
    assert_single_problem(
        &[("TASKBROKER_WORKER_ENDPOINTS", "billing=ftp://billing:21")],
        "TASKBROKER_WORKER_ENDPOINTS=billing=ftp://billing:21: must be \
         `app=url|url;app2=url;*=url` with `http://` or `https://` URLs \
         (URL `ftp://billing:21` does not start with `http://` or `https://`)",
    );
}

#[test]
fn malformed_worker_endpoints_are_refused_naming_the_entry() {
    for (value, detail) in [
        (
            "http://worker:50052",
            "entry `http://worker:50052` has no `=`",
        ),
        ("=http://worker:50052", "needs an application name"),
        ("billing=", "URL `` does not start with `http://`"),
        ("billing=http://a:1||http://b:1", "URL `` does not start"),
        ("billing=http://", "URL `http://` has no host"),
        ("b=http://a:1;b=http://c:1", "application `b` appears twice"),
        ("*=http://a:1;*=http://c:1", "application `*` appears twice"),
        (";;", "no entries"),
    ] {
        let error = parse_err(&[("TASKBROKER_WORKER_ENDPOINTS", value)]);
        assert_eq!(error.problems.len(), 1, "{error}");
        let line = error.problems[0].to_string();
        assert!(
            line.starts_with(&format!(
                "TASKBROKER_WORKER_ENDPOINTS={value}: must be `app=url|"
            )),
            "{line}"
        );
        assert!(line.contains(detail), "{value:?}: {line}");
    }
}

#[test]
fn kafka_config_is_parsed_into_pairs() {
    let config = parse_ok(&[(
        "TASKBROKER_KAFKA_CONFIG",
        "security.protocol=SASL_SSL, sasl.password=a=b, ssl.ca.location=",
    )]);
    assert_eq!(
        config.kafka_config,
        vec![
            ("security.protocol".to_string(), "SASL_SSL".to_string()),
            ("sasl.password".to_string(), "a=b".to_string()),
            ("ssl.ca.location".to_string(), String::new()),
        ]
    );
}

#[test]
fn malformed_kafka_config_is_refused_without_printing_it() {
    for (value, detail) in [
        ("sasl.password=x,hunter2", "item 2 of 2 has no `=`"),
        ("=hunter2", "item 1 of 1 has no key before `=`"),
        ("sasl.username=u,,x=y", "item 2 of 3 has no `=`"),
        (
            "bad key=hunter2",
            "item 1 of 1 has a key that is not a property name",
        ),
        (
            "enable.auto.commit=true",
            "item 1 of 1 sets `enable.auto.commit`, which the broker sets itself",
        ),
        ("a.b=hunter2,a.b=c", "item 2 of 2 repeats the key of item 1"),
    ] {
        let error = parse_err(&[("TASKBROKER_KAFKA_CONFIG", value)]);
        assert_eq!(error.problems.len(), 1, "{error}");
        let line = error.problems[0].to_string();
        assert!(
            line.starts_with(
                "TASKBROKER_KAFKA_CONFIG=<redacted>: must be comma-separated `key=value` \
                 librdkafka properties"
            ),
            "{line}"
        );
        assert!(line.contains(detail), "{value:?}: {line}");
        assert!(!line.contains("hunter2"), "{line}");
    }
}

#[test]
fn shared_secrets_are_split_and_empty_items_refused() {
    let config = parse_ok(&[("TASKBROKER_GRPC_SHARED_SECRETS", "new-secret, old-secret")]);
    assert_eq!(config.grpc_shared_secrets, vec!["new-secret", "old-secret"]);

    assert_single_problem(
        &[("TASKBROKER_GRPC_SHARED_SECRETS", "hunter2,")],
        "TASKBROKER_GRPC_SHARED_SECRETS=<redacted>: must be a comma-separated list without \
         empty items (item 2 of 2 is empty)",
    );
}

#[test]
fn addresses_are_validated() {
    assert_single_problem(
        &[("TASKBROKER_GRPC_ADDR", "localhost:50051")],
        "TASKBROKER_GRPC_ADDR=localhost:50051: must be an `ip:port` address to listen on, \
         e.g. `0.0.0.0:50051` or `[::]:50051`",
    );
    assert_single_problem(
        &[("TASKBROKER_KAFKA_BROKERS", "kafka-0:9092,kafka-1")],
        "TASKBROKER_KAFKA_BROKERS=kafka-0:9092,kafka-1: must be comma-separated `host:port` \
         addresses (`kafka-1` has no `:port`)",
    );
    assert_single_problem(
        &[("TASKBROKER_GRPC_ADVERTISED_ADDR", "broker-0:0")],
        "TASKBROKER_GRPC_ADVERTISED_ADDR=broker-0:0: must be a `host:port` address \
         (`broker-0:0` has no port from 1 to 65535)",
    );
    assert_single_problem(
        &[("TASKBROKER_KAFKA_TOPIC", "task worker")],
        "TASKBROKER_KAFKA_TOPIC=task worker: must be a Kafka topic name: up to 249 of \
         `a-z A-Z 0-9 . _ -`",
    );
}

#[test]
fn metrics_may_not_share_the_grpc_port() {
    assert_single_problem(
        &[("TASKBROKER_METRICS_ADDR", "127.0.0.1:50051")],
        "TASKBROKER_METRICS_ADDR=127.0.0.1:50051: must not take the port of \
         TASKBROKER_GRPC_ADDR=0.0.0.0:50051",
    );
    parse_ok(&[
        ("TASKBROKER_GRPC_ADDR", "10.0.0.1:50051"),
        ("TASKBROKER_METRICS_ADDR", "127.0.0.1:50051"),
    ]);
}

#[test]
fn claim_lease_shorter_than_the_legitimate_push_path_is_refused() {
    // With the defaults: 2000 + ⌈(128 + 2 + 1) / 64⌉ = 3 rounds × 5000 + 5000.
    assert_single_problem(
        &[("TASKBROKER_CLAIM_LEASE_MS", "21999")],
        "TASKBROKER_CLAIM_LEASE_MS=21999: must be at least TASKBROKER_PUSH_QUEUE_TIMEOUT_MS + \
         ⌈(TASKBROKER_PUSH_QUEUE_SIZE + TASKBROKER_FETCH_ACTORS + 1) / \
         TASKBROKER_PUSH_CONCURRENCY⌉ × TASKBROKER_PUSH_TIMEOUT_MS + TASKBROKER_PUSH_TIMEOUT_MS \
         = 2000 + ⌈(128 + 2 + 1) / 64⌉ × 5000 + 5000 = 22000 ms, or unset to derive it, so a \
         claim cannot expire while its push may still succeed",
    );
    let config = parse_ok(&[("TASKBROKER_CLAIM_LEASE_MS", "22000")]);
    assert_eq!(config.claim_lease(), Duration::from_millis(22000));
}

/// Issue 13's example: a deep queue drained by one slot needs hours, not 7 s.
#[test]
fn claim_lease_far_below_a_deep_single_slot_queue_is_refused() {
    let error = parse_err(&[
        ("TASKBROKER_CLAIM_LEASE_MS", "7000"),
        ("TASKBROKER_PUSH_QUEUE_SIZE", "4096"),
        ("TASKBROKER_PUSH_CONCURRENCY", "1"),
    ]);
    assert_eq!(error.problems.len(), 1, "{error}");
    let problem = &error.problems[0];
    assert_eq!(problem.variable, "TASKBROKER_CLAIM_LEASE_MS");
    // 2000 + (4096 + 2 + 1) × 5000 + 5000
    let text = problem.to_string();
    assert!(text.contains("TASKBROKER_CLAIM_LEASE_MS=7000"), "{text}");
    assert!(text.contains("= 20502000 ms"), "{text}");
}

#[test]
fn shutdown_timeout_must_exceed_the_push_timeout() {
    assert_single_problem(
        &[
            ("TASKBROKER_SHUTDOWN_TIMEOUT_MS", "5000"),
            ("TASKBROKER_PUSH_TIMEOUT_MS", "5000"),
        ],
        "TASKBROKER_SHUTDOWN_TIMEOUT_MS=5000: must be greater than \
         TASKBROKER_PUSH_TIMEOUT_MS=5000, so pushes in flight can finish and claims be released \
         before the deadline",
    );
}

#[test]
fn a_takeover_timeout_under_three_heartbeats_is_refused() {
    assert_single_problem(
        &[
            ("TASKBROKER_HEARTBEAT_INTERVAL_MS", "1000"),
            ("TASKBROKER_TAKEOVER_TIMEOUT_MS", "2999"),
        ],
        "TASKBROKER_TAKEOVER_TIMEOUT_MS=2999: must be at least 3 × \
         TASKBROKER_HEARTBEAT_INTERVAL_MS = 3000 ms, so one late heartbeat does not get a live \
         broker taken over",
    );
    let config = parse_ok(&[
        ("TASKBROKER_HEARTBEAT_INTERVAL_MS", "200"),
        ("TASKBROKER_TAKEOVER_TIMEOUT_MS", "600"),
    ]);
    assert_eq!(config.takeover_timeout, Duration::from_millis(600));
}

#[test]
fn a_broker_id_must_be_printable_and_short_enough() {
    assert_single_problem(
        &[("TASKBROKER_BROKER_ID", "broker one")],
        "TASKBROKER_BROKER_ID=broker one: must be printable ASCII without spaces",
    );
    let long = "b".repeat(254);
    let error = parse_err(&[("TASKBROKER_BROKER_ID", &long)]);
    assert!(
        error.to_string().contains("must be 1 to 253 bytes long"),
        "{error}"
    );
    let config = parse_ok(&[("TASKBROKER_BROKER_ID", "taskbroker-0")]);
    assert_eq!(config.broker_id(|_| None), "taskbroker-0");
}

#[test]
fn the_broker_id_defaults_to_the_pod_name_in_kubernetes_else_a_fresh_one() {
    let config = parse_ok(&[]);
    let kubernetes = |name: &str| match name {
        "KUBERNETES_SERVICE_HOST" => Some("10.0.0.1".to_owned()),
        "HOSTNAME" => Some("taskbroker-7d9f-abcde".to_owned()),
        _ => None,
    };
    assert_eq!(config.broker_id(kubernetes), "taskbroker-7d9f-abcde");
    // Outside Kubernetes a host name is not unique per process: fresh ids.
    let docker = |name: &str| (name == "HOSTNAME").then(|| "3f2a9c1b".to_owned());
    let (one, two) = (config.broker_id(docker), config.broker_id(docker));
    assert!(
        one.starts_with("broker-") && two.starts_with("broker-"),
        "{one}"
    );
    assert_ne!(one, two);
    // A pod name the id rules refuse is not used.
    let odd = |name: &str| match name {
        "KUBERNETES_SERVICE_HOST" => Some("10.0.0.1".to_owned()),
        "HOSTNAME" => Some("has space".to_owned()),
        _ => None,
    };
    assert!(config.broker_id(odd).starts_with("broker-"));
}

#[test]
fn every_problem_is_reported_at_once() {
    let error = parse_err(&[
        ("TASKBROKER_FETCH_ACTORS", "3"),
        ("TASKBROKER_LOG_FORMAT", "xml"),
        ("TASKBROKER_PUSH_QUEUE_SIZE", "many"),
        ("TASKBROKER_CLAIM_LEASE_MS", "1000"),
    ]);
    let variables: Vec<&str> = error.problems.iter().map(|p| p.variable.as_str()).collect();
    assert_eq!(
        variables,
        vec![
            // Each setting on its own, in table order; then the checks across settings.
            "TASKBROKER_FETCH_ACTORS",
            "TASKBROKER_PUSH_QUEUE_SIZE",
            "TASKBROKER_LOG_FORMAT",
            "TASKBROKER_CLAIM_LEASE_MS",
        ],
        "{error}"
    );
    let text = error.to_string();
    assert_eq!(text.lines().count(), 1 + error.problems.len(), "{text}");
    for problem in &error.problems {
        assert!(text.contains(&problem.to_string()), "{text}");
    }
}

#[test]
fn odd_input_is_an_error_not_a_panic() {
    for value in [
        "\u{0}",
        "\n\t",
        "💥",
        "=",
        ";",
        "|",
        ",",
        "::",
        "http://",
        "18446744073709551616",
        "\u{fffd}",
    ] {
        let vars: Vec<(String, &str)> = SETTINGS.iter().map(|s| (s.variable(), value)).collect();
        let vars: Vec<(&str, &str)> = vars.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        if let Err(error) = parse(&vars) {
            assert!(!error.problems.is_empty());
            assert!(
                !error.to_string().contains('\u{0}'),
                "control characters are escaped"
            );
        }
    }
}

#[test]
fn derived_claim_lease_follows_the_documented_formula() {
    let config = parse_ok(&[]);
    // 2000 + ceil((128 + 2 + 1) / 64) × 5000 + 5000 + 5000
    assert_eq!(config.claim_lease(), Duration::from_millis(27_000));
    assert_eq!(CLAIM_LEASE_MARGIN, Duration::from_millis(5000));

    let config = parse_ok(&[
        ("TASKBROKER_PUSH_QUEUE_TIMEOUT_MS", "1000"),
        ("TASKBROKER_PUSH_QUEUE_SIZE", "100"),
        ("TASKBROKER_PUSH_CONCURRENCY", "30"),
        ("TASKBROKER_PUSH_TIMEOUT_MS", "2000"),
    ]);
    // 1000 + ceil((100 + 2 + 1) / 30) = 4 rounds × 2000 + 2000 + 5000
    assert_eq!(config.claim_lease(), Duration::from_millis(16_000));

    // One sender handle per FetchActor and the message the pool holds count
    // as queue places: 1000 + ceil((4 + 8 + 1) / 1) = 13 rounds × 1000 + 1000 + 5000.
    let config = parse_ok(&[
        ("TASKBROKER_PUSH_QUEUE_TIMEOUT_MS", "1000"),
        ("TASKBROKER_PUSH_QUEUE_SIZE", "4"),
        ("TASKBROKER_FETCH_ACTORS", "8"),
        ("TASKBROKER_PUSH_CONCURRENCY", "1"),
        ("TASKBROKER_PUSH_TIMEOUT_MS", "1000"),
    ]);
    assert_eq!(config.claim_lease(), Duration::from_millis(20_000));
}

#[test]
fn explicit_claim_lease_overrides_the_derived_one() {
    let config = parse_ok(&[("TASKBROKER_CLAIM_LEASE_MS", "60000")]);
    assert_eq!(config.claim_lease_override, Some(Duration::from_secs(60)));
    assert_eq!(config.claim_lease(), Duration::from_secs(60));
}

#[test]
fn advertised_address_is_derived_from_the_host_name_when_binding_everywhere() {
    let config = parse_ok(&[]);
    assert_eq!(config.advertised_addr("broker-0"), "broker-0:50051");

    let config = parse_ok(&[("TASKBROKER_GRPC_ADDR", "10.1.2.3:6000")]);
    assert_eq!(config.advertised_addr("broker-0"), "10.1.2.3:6000");

    let config = parse_ok(&[("TASKBROKER_GRPC_ADVERTISED_ADDR", "broker.svc:443")]);
    assert_eq!(config.advertised_addr("broker-0"), "broker.svc:443");
}

#[test]
fn render_effective_lists_every_setting_in_table_order() {
    let rendered = parse_ok(&[]).render_effective();
    let lines: Vec<&str> = rendered.lines().collect();
    assert_eq!(lines.len(), SETTINGS.len());
    for (line, setting) in lines.iter().zip(SETTINGS) {
        let (variable, value) = line.split_once('=').expect("NAME=value");
        assert_eq!(variable, setting.variable());
        assert!(!value.contains("<not rendered>"), "{line}");
        if !setting.default.is_empty() {
            assert_eq!(value, setting.default, "defaults render as written");
        }
    }
    assert!(lines.contains(&"TASKBROKER_CLAIM_LEASE_MS=27000 (derived)"));
    assert!(lines.contains(&"TASKBROKER_KAFKA_RETRY_TOPIC=taskworker (derived)"));
    assert!(lines.contains(&"TASKBROKER_GRPC_ADVERTISED_ADDR=<host name>:50051 (derived)"));
    assert!(lines.contains(&"TASKBROKER_DATABASE_URL="));
    assert!(lines.contains(&"TASKBROKER_GRPC_SHARED_SECRETS="));
}

#[test]
fn render_effective_and_debug_redact_secrets() {
    let config = parse_ok(&[
        (
            "TASKBROKER_DATABASE_URL",
            "postgres://broker:hunter2@db/tasks",
        ),
        ("TASKBROKER_GRPC_SHARED_SECRETS", "hunter2,hunter3"),
        ("TASKBROKER_KAFKA_CONFIG", "sasl.password=hunter2"),
        ("TASKBROKER_CLAIM_LEASE_MS", "30000"),
        (
            "TASKBROKER_WORKER_ENDPOINTS",
            "billing=http://svc:hunter2@billing:50052;*=http://token-hunter4@worker:50052",
        ),
    ]);
    let rendered = config.render_effective();
    assert!(
        rendered.contains(
            "TASKBROKER_WORKER_ENDPOINTS=billing=http://<redacted>@billing:50052;*=http://<redacted>@worker:50052\n"
        ),
        "{rendered}"
    );
    for secret in SETTINGS.iter().filter(|s| s.secret) {
        let line = format!("{}={REDACTED}", secret.variable());
        assert!(rendered.lines().any(|l| l == line), "{rendered}");
    }
    assert!(rendered.contains("TASKBROKER_CLAIM_LEASE_MS=30000\n"));
    assert!(!rendered.contains("hunter"), "{rendered}");
    let debug = format!("{config:?}");
    assert!(!debug.contains("hunter"), "{debug}");
    assert!(debug.contains(REDACTED), "{debug}");
}

#[test]
fn a_refused_worker_endpoint_is_shown_without_its_credentials() {
    let err = parse_err(&[(
        "TASKBROKER_WORKER_ENDPOINTS",
        "billing=grpcs://svc:hunter2@billing:50052",
    )]);
    let text = err.to_string();
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("grpcs://<redacted>@billing:50052"), "{text}");
}

#[test]
fn unknown_variables_reports_only_prefixed_typos() {
    let vars = [
        "TASKBROKER_FETCH_BATCH_SIZE",
        "TASKBROKER_FETCH_BATCHSIZE",
        "PATH",
        "TASKBROKER_",
        "TASKBROKER_FETCH_BATCHSIZE",
    ];
    assert_eq!(
        unknown_variables(vars.into_iter().map(String::from)),
        vec!["TASKBROKER_", "TASKBROKER_FETCH_BATCHSIZE"]
    );
}

#[test]
fn docs_configuration_md_matches_the_settings_table() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == reference_markdown(),
        "docs/configuration.md is out of date with src/config/settings.rs; regenerate it with \
         `cargo run -- config --markdown > docs/configuration.md`"
    );
}

#[test]
fn docs_table_has_one_row_per_setting() {
    let markdown = reference_markdown();
    for setting in SETTINGS {
        let row = format!("| `{}` |", setting.variable());
        assert_eq!(
            markdown.lines().filter(|l| l.starts_with(&row)).count(),
            1,
            "{}",
            setting.name
        );
    }
    assert!(markdown.contains("With the defaults that is 27000 ms."));
}

/// A valid value for the `index`-th setting that differs from its default and, for numbers,
/// from every other setting's, so a field wired to the wrong setting would show another value.
fn distinct_value(index: usize, allowed: Allowed, default: &str) -> String {
    let i = index as u64;
    match allowed {
        // Small numbers: the queue and concurrency settings then keep the lease formula far
        // below any lease; the top of each range for durations keeps shutdown above the push
        // timeout and the lease above its minimum.
        Allowed::Integer { min, max } => (min + 2 + i).min(max).to_string(),
        Allowed::PowerOfTwo { max, .. } => max.to_string(),
        Allowed::Bytes { min, max } => (min.max(1024) * 2 + i).min(max).to_string(),
        Allowed::Millis { max, .. } | Allowed::Seconds { max, .. } => (max - i).to_string(),
        // The other value than the default.
        Allowed::Bool if default == "true" => "false".to_owned(),
        Allowed::Bool => "true".to_owned(),
        Allowed::OneOf(words) => words[1].to_owned(),
        Allowed::Url { schemes } => format!("{}://user:pw@db-{i}/tasks", schemes[0]),
        Allowed::SocketAddr => format!("127.0.0.{}:{}", i + 1, 20_000 + i),
        Allowed::HostPort => format!("host-{i}:{}", 20_000 + i),
        Allowed::HostPortList => format!("kafka-{i}:9092,kafka-{i}b:9093"),
        Allowed::KafkaTopic | Allowed::KafkaTopicAt => format!("topic-{i}"),
        Allowed::TopicList => format!("topic-{i}a,topic-{i}b#group-{i}"),
        Allowed::KafkaClusters => format!("c{i}=kafka-{i}:9092"),
        Allowed::RawTopics => format!("raw-{i}=app/ns/task{i}"),
        Allowed::KafkaProperties => format!("client.id=c{i},sasl.password=p{i}"),
        Allowed::List => format!("secret-{i},old-{i}"),
        Allowed::WorkerEndpoints => format!("*=http://worker-{i}:50052"),
        Allowed::LogFilter => format!("warn,target{i}=debug"),
        Allowed::Text => format!("text-{i}"),
    }
}

/// Each setting's value reaches its own `Config` field and renders back from it: for an
/// environment that sets every setting to a distinct non-default value, every line of
/// `render_effective` shows exactly that value (secrets: `<redacted>`), none a placeholder, a
/// default or a derived value. A declaration whose parsing, field or rendering disagree fails
/// here for that setting.
#[test]
fn every_setting_renders_the_value_it_was_given() {
    let env: Vec<(String, String)> = SETTINGS
        .iter()
        .enumerate()
        .map(|(i, setting)| {
            (
                setting.variable(),
                distinct_value(i, setting.allowed, setting.default),
            )
        })
        .collect();
    for (setting, (_, value)) in SETTINGS.iter().zip(&env) {
        assert_ne!(
            value, setting.default,
            "{} needs a non-default value",
            setting.name
        );
    }
    let vars: Vec<(&str, &str)> = env.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    let config = parse_ok(&vars);
    let rendered = config.render_effective();
    let lines: Vec<&str> = rendered.lines().collect();
    assert_eq!(lines.len(), SETTINGS.len(), "{rendered}");
    for ((setting, (variable, given)), line) in SETTINGS.iter().zip(&env).zip(lines) {
        let expected = if setting.secret {
            REDACTED
        } else {
            given.as_str()
        };
        assert_eq!(line, format!("{variable}={expected}"), "{}", setting.name);
    }
    // Two settings of one type read into each other's field would also differ here.
    assert_eq!(
        config.fetch_batch_size.to_string(),
        vars_value(&env, "FETCH_BATCH_SIZE")
    );
    assert_eq!(
        config.insert_batch_size.to_string(),
        vars_value(&env, "INSERT_BATCH_SIZE")
    );
}

fn vars_value(env: &[(String, String)], name: &str) -> String {
    let variable = format!("{ENV_PREFIX}{name}");
    env.iter()
        .find(|(n, _)| *n == variable)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("{variable} is not set"))
}

/// The stranded-claim benchmark's switch is no longer a setting: it is not documented, and
/// its old name is reported as unknown like any typo.
#[test]
fn the_bench_switch_is_not_a_setting() {
    assert!(SETTINGS.iter().all(|s| !s.name.contains("RELEASE_ON_FULL")));
    assert!(!reference_markdown().contains("RELEASE_ON_FULL"));
    assert_eq!(
        unknown_variables(["TASKBROKER_BENCH_DISABLE_RELEASE_ON_FULL".to_owned()]),
        vec!["TASKBROKER_BENCH_DISABLE_RELEASE_ON_FULL"]
    );
    let rendered =
        parse_ok(&[("TASKBROKER_TEST_DISABLE_RELEASE_ON_FULL", "true")]).render_effective();
    assert!(!rendered.contains("RELEASE_ON_FULL"), "{rendered}");
}

/// The test switch is known exactly when the `test-hooks` feature compiles it in; otherwise
/// it is an unknown variable like any other.
#[test]
fn the_test_switch_is_known_only_in_a_test_hooks_build() {
    let unknown = unknown_variables(["TASKBROKER_TEST_DISABLE_RELEASE_ON_FULL".to_owned()]);
    if cfg!(feature = "test-hooks") {
        assert!(unknown.is_empty(), "{unknown:?}");
    } else {
        assert_eq!(unknown, vec!["TASKBROKER_TEST_DISABLE_RELEASE_ON_FULL"]);
    }
}

// ------------------------------------------------------------ topics and clusters

#[test]
fn unset_topics_consume_kafka_topic_alone_as_before() {
    let topology = parse_ok(&[("TASKBROKER_KAFKA_TOPIC", "jobs")]).topology();
    assert_eq!(topology.consumed.len(), 1);
    let only = &topology.consumed[0];
    assert_eq!(only.topic.to_string(), "jobs");
    assert_eq!(only.group, "taskbroker");
    assert!(only.raw.is_none());
    assert_eq!(topology.retry.to_string(), "jobs");
    assert_eq!(topology.clusters.len(), 1);
}

#[test]
fn topics_clusters_groups_and_raw_topics_resolve_into_one_table() {
    let config = parse_ok(&[
        ("TASKBROKER_KAFKA_BROKERS", "main-kafka:9092"),
        (
            "TASKBROKER_KAFKA_CLUSTERS",
            "east=east-1:9092,east-2:9092;west=west:9093",
        ),
        (
            "TASKBROKER_KAFKA_CLUSTER_EAST_CONFIG",
            "security.protocol=SSL,client.id=e",
        ),
        (
            "TASKBROKER_KAFKA_TOPICS",
            "tasks,tasks-long@east#long-pool,events",
        ),
        (
            "TASKBROKER_KAFKA_RAW_TOPICS",
            "events=app/raw/ingest,clicks@west=app/web/click",
        ),
        ("TASKBROKER_KAFKA_RAW_DEADLINE_SEC", "12"),
        ("TASKBROKER_KAFKA_RAW_COMPRESSION", "none"),
        ("TASKBROKER_KAFKA_DLQ_TOPIC", "dead@west"),
    ]);
    let topology = config.topology();
    let consumed: Vec<(String, String, Option<String>)> = topology
        .consumed
        .iter()
        .map(|c| {
            (
                c.topic.to_string(),
                c.group.clone(),
                c.raw.as_ref().map(|raw| raw.task.to_string()),
            )
        })
        .collect();
    assert_eq!(
        consumed,
        [
            ("tasks".to_owned(), "taskbroker".to_owned(), None),
            ("tasks-long@east".to_owned(), "long-pool".to_owned(), None),
            (
                "events".to_owned(),
                "taskbroker-events".to_owned(),
                Some("app/raw/ingest".to_owned())
            ),
            (
                "clicks@west".to_owned(),
                "taskbroker-clicks".to_owned(),
                Some("app/web/click".to_owned())
            ),
        ]
    );
    let raw = topology.consumed[2].raw.as_ref().unwrap();
    assert_eq!(raw.deadline, Duration::from_secs(12));
    assert_eq!(raw.compression.as_str(), "none");
    assert_eq!(topology.retry.to_string(), "tasks");
    assert_eq!(topology.dlq.to_string(), "dead@west");
    let east = topology.cluster("east").unwrap();
    assert_eq!(east.brokers, "east-1:9092,east-2:9092");
    assert_eq!(east.properties.len(), 2);
    assert!(topology.cluster("west").unwrap().properties.is_empty());

    // `taskbroker config`: the topic table, and cluster properties redacted.
    let table = topology.render();
    assert!(table.contains("tasks-long"), "{table}");
    assert!(table.contains("raw -> app/raw/ingest"), "{table}");
    let effective = config.render_effective();
    assert!(effective.contains("TASKBROKER_KAFKA_CLUSTER_EAST_CONFIG=<redacted>"));
    assert!(!effective.contains("client.id=e"));
    assert!(
        unknown_variables(["TASKBROKER_KAFKA_CLUSTER_EAST_CONFIG".to_owned()]).is_empty(),
        "a cluster's properties variable is not a typo"
    );
}

#[test]
fn topic_settings_are_validated_naming_the_variable_and_the_topic() {
    assert_single_problem(
        &[("TASKBROKER_KAFKA_TOPICS", "tasks,side@east")],
        "TASKBROKER_KAFKA_TOPICS=side@east: topic `side` names cluster `east`, which \
         TASKBROKER_KAFKA_CLUSTERS does not declare",
    );
    assert_single_problem(
        &[("TASKBROKER_KAFKA_TOPICS", "tasks,tasks")],
        "TASKBROKER_KAFKA_TOPICS=tasks: lists this topic twice",
    );
    assert_single_problem(
        &[("TASKBROKER_KAFKA_RETRY_TOPIC", "again@nowhere")],
        "TASKBROKER_KAFKA_RETRY_TOPIC=again@nowhere: topic `again` names cluster `nowhere`, \
         which TASKBROKER_KAFKA_CLUSTERS does not declare",
    );
    let bad_raw = parse_err(&[("TASKBROKER_KAFKA_RAW_TOPICS", "events=app/ns")]);
    assert!(
        bad_raw.to_string().contains(
            "TASKBROKER_KAFKA_RAW_TOPICS=events=app/ns: must be comma-separated \
             `topic=application/namespace/taskname`"
        ) && bad_raw.to_string().contains("topic `events`"),
        "{bad_raw}"
    );
    let bad_cluster = parse_err(&[("TASKBROKER_KAFKA_CLUSTERS", "east=no-port")]);
    assert!(
        bad_cluster.to_string().contains("cluster 1 of 1 (`east`)"),
        "{bad_cluster}"
    );
    let secret = parse_err(&[
        ("TASKBROKER_KAFKA_CLUSTERS", "east=east:9092"),
        ("TASKBROKER_KAFKA_CLUSTER_EAST_CONFIG", "sasl.password"),
    ]);
    assert_eq!(secret.problems.len(), 1, "{secret}");
    assert_eq!(
        secret.problems[0].variable,
        "TASKBROKER_KAFKA_CLUSTER_EAST_CONFIG"
    );
    assert_eq!(secret.problems[0].value, REDACTED);
}

#[test]
fn the_retry_topic_may_never_be_a_raw_topic() {
    // Unset, retries go to the first consumed topic: refused when it is raw.
    let error = parse_err(&[
        ("TASKBROKER_KAFKA_TOPIC", "events"),
        ("TASKBROKER_KAFKA_RAW_TOPICS", "events=app/ns/task"),
    ]);
    assert_eq!(error.problems.len(), 1, "{error}");
    assert!(
        error.problems[0]
            .to_string()
            .starts_with("TASKBROKER_KAFKA_RAW_TOPICS=events: is the retry topic"),
        "{error}"
    );
    let explicit = parse_err(&[
        ("TASKBROKER_KAFKA_RETRY_TOPIC", "events"),
        ("TASKBROKER_KAFKA_RAW_TOPICS", "events=app/ns/task"),
    ]);
    assert_eq!(explicit.problems.len(), 1, "{explicit}");
    parse_ok(&[
        ("TASKBROKER_KAFKA_RETRY_TOPIC", "tasks-retry"),
        ("TASKBROKER_KAFKA_RAW_TOPICS", "events=app/ns/task"),
    ]);
}

/// Byte sizes take a whole number of bytes or a binary suffix; anything else
/// is refused with a message naming the variable and what is allowed.
#[test]
fn byte_sizes_take_binary_suffixes_and_refuse_anything_else() {
    for (raw, bytes) in [
        ("268435456", 268_435_456u64),
        ("256MiB", 256 << 20),
        ("256 mib", 256 << 20),
        ("2GiB", 2 << 30),
        ("64KiB", 64 << 10),
        ("0", 0),
    ] {
        let config = parse_ok(&[("TASKBROKER_MAX_INFLIGHT_BYTES", raw)]);
        assert_eq!(config.max_inflight_bytes, bytes, "{raw}");
    }
    for raw in [
        "256MB",
        "1.5GiB",
        "-1",
        "GiB",
        "99999999999999999999",
        "2TiB",
    ] {
        let error = Config::from_lookup(|name| {
            (name == "TASKBROKER_MAX_INFLIGHT_BYTES").then(|| raw.to_owned())
        })
        .expect_err(raw)
        .to_string();
        assert!(
            error.contains("TASKBROKER_MAX_INFLIGHT_BYTES"),
            "{raw}: {error}"
        );
        assert!(error.contains("`KiB`, `MiB` or `GiB`"), "{raw}: {error}");
    }
    let config = parse_ok(&[("TASKBROKER_MAX_ACTIVATION_BYTES", "6MiB")]);
    assert_eq!(config.max_activation_bytes, 6 << 20);
}
