//! Connections to PostgreSQL: building the deadpool pools (timeouts,
//! asynchronous commit for the replayable pool) and telling the caller what
//! a failure means: `Unavailable` (retry), `Rejected` (the data) or `Query`.

use deadpool_postgres::{
    Hook, HookError, Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime,
};
use tokio_postgres::error::SqlState;

use super::PostgresStoreConfig;
use super::tls::{RustlsConnect, split_url};
use crate::store::{StoreError, StoreResult};

/// The tokio-postgres configuration and TLS connector for `url`, honouring
/// libpq's `sslmode`/`sslrootcert`; errors name the setting.
pub(super) fn connect_config(url: &str) -> StoreResult<(tokio_postgres::Config, RustlsConnect)> {
    let config_error = |err: String| StoreError::Config(format!("TASKBROKER_DATABASE_URL: {err}"));
    let split = split_url(url).map_err(config_error)?;
    let mut pg_config: tokio_postgres::Config = split
        .url
        .parse()
        .map_err(|err| StoreError::Config(format!("invalid PostgreSQL URL: {err}")))?;
    pg_config.ssl_mode(split.ssl_mode());
    let connector = split.connector().map_err(config_error)?;
    Ok((pg_config, connector))
}

pub(super) fn build_pool(config: &PostgresStoreConfig, async_commit: bool) -> StoreResult<Pool> {
    let (mut pg_config, connector) = connect_config(&config.url)?;
    pg_config.connect_timeout(config.connect_timeout);
    if pg_config.get_application_name().is_none() {
        pg_config.application_name("taskbroker");
    }
    let manager = Manager::from_config(
        pg_config,
        connector,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let mut builder = Pool::builder(manager)
        .max_size(config.pool_size.max(1))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(config.connect_timeout))
        .create_timeout(Some(config.connect_timeout))
        .recycle_timeout(Some(config.connect_timeout));
    // Every statement the broker runs is bounded and takes a millisecond
    // or so; JIT compiling one whose estimate crosses `jit_above_cost` (the
    // fair claim's can) costs tens of milliseconds, so sessions turn it off.
    let settings = if async_commit {
        "SET jit = off; SET synchronous_commit = off"
    } else {
        "SET jit = off"
    };
    builder = builder.post_create(Hook::async_fn(move |client, _| {
        Box::pin(async move {
            client
                .batch_execute(settings)
                .await
                .map_err(HookError::Backend)
        })
    }));
    builder
        .build()
        .map_err(|err| StoreError::Config(format!("cannot build connection pool: {err}")))
}

/// The one row an aggregate statement always answers; its absence is a
/// `Query` error naming the operation.
pub(super) fn only_row(
    operation: &'static str,
    rows: Vec<tokio_postgres::Row>,
) -> Result<tokio_postgres::Row, StoreError> {
    rows.into_iter().next().ok_or(StoreError::Query {
        operation,
        message: "the statement returned no row".to_owned(),
    })
}

/// Connection-level failures are retryable (`Unavailable`); data the server
/// refused is `Rejected`; anything else it rejected about the statement
/// itself is a `Query` error.
pub(super) fn query_error(operation: &'static str, err: tokio_postgres::Error) -> StoreError {
    let unavailable = match err.code() {
        Some(code) => {
            code.code().starts_with("08")
                || [
                    SqlState::ADMIN_SHUTDOWN,
                    SqlState::CRASH_SHUTDOWN,
                    SqlState::CANNOT_CONNECT_NOW,
                    SqlState::TOO_MANY_CONNECTIONS,
                    // Transient: the same statement succeeds when re-run.
                    SqlState::T_R_DEADLOCK_DETECTED,
                    SqlState::T_R_SERIALIZATION_FAILURE,
                ]
                .contains(code)
        }
        // No SQLSTATE: a broken connection is retryable; a client-side
        // encode, decode or row-count error is not.
        None => {
            err.is_closed()
                || std::error::Error::source(&err).is_some_and(|s| s.is::<std::io::Error>())
        }
    };
    // Data exception, integrity constraint violation, program limit
    // exceeded (e.g. 54000, an index row too large): the rows themselves are
    // at fault and fail the same way on every retry.
    let rejected = err.code().is_some_and(|code| {
        ["22", "23", "54"]
            .iter()
            .any(|class| code.code().starts_with(class))
    });
    let message = match err.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => describe(&err),
    };
    if unavailable {
        StoreError::Unavailable { operation, message }
    } else if rejected {
        StoreError::Rejected { operation, message }
    } else {
        StoreError::Query { operation, message }
    }
}

pub(super) fn pool_error(operation: &'static str, err: PoolError) -> StoreError {
    StoreError::Unavailable {
        operation,
        message: describe(&err),
    }
}

/// `err` and its causes: deadpool and tokio-postgres keep the reason (the
/// server's message, the io error) in `source()`, not in `Display`.
pub(super) fn describe(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}
