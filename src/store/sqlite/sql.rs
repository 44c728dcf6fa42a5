//! The SQLite statements, one per store operation (a few have variants),
//! kept apart from the code that runs them so each reads as SQL. Rows are
//! named by `columns!`, in the order `rows.rs` reads them; timestamps are
//! integer microseconds (`?` parameters say which is now); id lists and
//! claim tokens travel as one JSON array (`json_each`), so a batch is one
//! statement.

/// The row columns, in the order `rows::activation_from_row` reads them.
macro_rules! columns {
    () => {
        "id, activation, topic, partition, kafka_offset, added_at, received_at, \
         processing_attempts, expires_at, delay_until, processing_deadline_duration, \
         processing_deadline, claim_expires_at, status, at_most_once, application, namespace, \
         taskname, on_attempts_exceeded, bucket, retry_max_attempts, retry_delay_on_retry"
    };
}

pub(super) const INSERT: &str = concat!(
    "INSERT INTO inflight_taskactivations (",
    columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, \
     ?19, ?20, ?21, ?22) ON CONFLICT (id) DO NOTHING"
);

// The single writer makes "skip rows others hold" unnecessary: no other
// claim runs at the same time. `?4` is now + lease; the expiry is strictly
// later than any this row had.
// Paused applications and namespaces: a JSON array of `[application,
// namespace]` pairs, "" for "any". The variants without it are the common
// case and keep their plans exactly as before.
macro_rules! not_paused {
    ($param:literal) => {
        concat!(
            " AND NOT EXISTS (SELECT 1 FROM json_each(",
            $param,
            ") AS p \
               WHERE (p.value ->> 0 = '' OR p.value ->> 0 = inflight_taskactivations.application) \
                 AND (p.value ->> 1 = '' OR p.value ->> 1 = inflight_taskactivations.namespace))"
        )
    };
}

// A claim's byte budget (FETCH_BATCH_BYTES, as in the PostgreSQL
// statements): of the candidate rows `$candidates` (id, added_at, size),
// oldest first, those whose predecessors add up to less than `$budget`
// bytes. length() of a BLOB column reads its size without loading the
// value.
macro_rules! within_bytes {
    ($candidates:expr, $budget:literal) => {
        concat!(
            "SELECT id FROM (SELECT id, size, \
                sum(size) OVER (ORDER BY added_at, id) AS upto FROM (",
            $candidates,
            ")) WHERE upto - size < ",
            $budget
        )
    };
}

// `?1`, `?2` buckets, `?3` limit, `?4` the new claim expiry, `?5` now,
// `?6` the claiming broker (`claimed_by`), `?7` the byte budget, `?8`
// paused rules (the _UNPAUSED variant).
macro_rules! claim_for_push {
    ($filter:expr) => {
        concat!(
            "UPDATE inflight_taskactivations \
               SET status = 'Claimed', claimed_by = ?6, claim_expires_at = max(?4, coalesce(claim_expires_at + 1, 0)) \
             WHERE id IN (",
            within_bytes!(
                concat!(
                    "SELECT id, added_at, length(activation) AS size FROM inflight_taskactivations \
                      WHERE status = 'Pending' AND bucket BETWEEN ?1 AND ?2 \
                        AND (expires_at IS NULL OR expires_at > ?5)",
                    $filter,
                    " ORDER BY added_at LIMIT ?3"
                ),
                "?7"
            ),
            ") RETURNING ",
            columns!()
        )
    };
}
pub(super) const CLAIM_FOR_PUSH: &str = claim_for_push!("");
pub(super) const CLAIM_FOR_PUSH_UNPAUSED: &str = claim_for_push!(not_paused!("?8"));

// Fair dispatch, step by step in one write: the flows (application,
// namespace) with Pending rows, one index probe each (`?1`, `?2` the flow
// before); a flow's oldest rows in the bucket range (`?3`, `?4`; `?5` now,
// `?6` its share); then the interleaved ids (`?1`, a JSON array) claimed
// (`?2` the new claim expiry, `?3` the claiming broker) while still
// Pending.
pub(super) const FIRST_FLOW: &str = "SELECT application, namespace \
     FROM inflight_taskactivations INDEXED BY inflight_pending_by_flow \
     WHERE status = 'Pending' ORDER BY application, namespace LIMIT 1";
// The next flow as two seeks (a row-value comparison would walk every row of
// the current flow): the next namespace of the same application, else the
// first flow of the next application.
pub(super) const NEXT_NAMESPACE: &str = "SELECT application, namespace \
     FROM inflight_taskactivations INDEXED BY inflight_pending_by_flow \
     WHERE status = 'Pending' AND application = ?1 AND namespace > ?2 \
     ORDER BY application, namespace LIMIT 1";
pub(super) const NEXT_APPLICATION: &str = "SELECT application, namespace \
     FROM inflight_taskactivations INDEXED BY inflight_pending_by_flow \
     WHERE status = 'Pending' AND application > ?1 \
     ORDER BY application, namespace LIMIT 1";
pub(super) const FLOW_HEADS: &str = "SELECT id, length(activation) \
     FROM inflight_taskactivations INDEXED BY inflight_pending_by_flow \
     WHERE status = 'Pending' AND application = ?1 AND namespace = ?2 \
       AND bucket BETWEEN ?3 AND ?4 AND (expires_at IS NULL OR expires_at > ?5) \
     ORDER BY added_at LIMIT ?6";
pub(super) const CLAIM_IDS: &str = concat!(
    "UPDATE inflight_taskactivations \
       SET status = 'Claimed', claimed_by = ?3, claim_expires_at = max(?2, coalesce(claim_expires_at + 1, 0)) \
     WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'Pending' \
     RETURNING ",
    columns!()
);

// Concurrency limits (the single writer makes count-then-claim atomic):
// `?1` namespace; then `?2` limit, `?3` claim expiry, `?4` now, `?5` the
// claiming broker, `?6` the byte budget.
pub(super) const COUNT_NAMESPACE_IN_FLIGHT: &str = "SELECT count(*) \
     FROM inflight_taskactivations WHERE namespace = ?1 AND status IN ('Claimed', 'Processing')";
pub(super) const CLAIM_LIMITED: &str = concat!(
    "UPDATE inflight_taskactivations \
       SET status = 'Claimed', claimed_by = ?5, claim_expires_at = max(?3, coalesce(claim_expires_at + 1, 0)) \
     WHERE id IN (",
    within_bytes!(
        "SELECT id, added_at, length(activation) AS size FROM inflight_taskactivations \
          WHERE status = 'Pending' AND namespace = ?1 \
            AND (expires_at IS NULL OR expires_at > ?4) \
          ORDER BY added_at LIMIT ?2",
        "?6"
    ),
    ") RETURNING ",
    columns!()
);

// `?1` now, `?2` now + grace (µs), `?3` application, `?4` namespace, `?5`
// paused rules (the _UNPAUSED variants).
macro_rules! claim_for_pull {
    ($filter:expr) => {
        concat!(
            "UPDATE inflight_taskactivations \
               SET status = 'Processing', \
                   processing_deadline = ?2 + processing_deadline_duration * 1000000 \
             WHERE id IN (SELECT id FROM inflight_taskactivations \
               WHERE status = 'Pending' AND (expires_at IS NULL OR expires_at > ?1) ",
            $filter,
            " ORDER BY added_at LIMIT 1) RETURNING ",
            columns!()
        )
    };
}
macro_rules! pull_filter {
    (any) => {
        "AND ?3 IS NULL AND ?4 IS NULL"
    };
    (application) => {
        "AND application = ?3 AND ?4 IS NULL"
    };
    (namespace) => {
        "AND application = ?3 AND namespace = ?4"
    };
}
pub(super) const CLAIM_FOR_PULL_ANY: &str = claim_for_pull!(pull_filter!(any));
pub(super) const CLAIM_FOR_PULL_APPLICATION: &str = claim_for_pull!(pull_filter!(application));
pub(super) const CLAIM_FOR_PULL_NAMESPACE: &str = claim_for_pull!(pull_filter!(namespace));
pub(super) const CLAIM_FOR_PULL_ANY_UNPAUSED: &str =
    claim_for_pull!(concat!(pull_filter!(any), not_paused!("?5")));
pub(super) const CLAIM_FOR_PULL_APPLICATION_UNPAUSED: &str =
    claim_for_pull!(concat!(pull_filter!(application), not_paused!("?5")));
pub(super) const CLAIM_FOR_PULL_NAMESPACE_UNPAUSED: &str =
    claim_for_pull!(concat!(pull_filter!(namespace), not_paused!("?5")));

// Fenced by id, status and the exact claim_expires_at the holder saw: one
// statement for the whole batch, its tokens unpacked from one JSON array.
macro_rules! fenced_claims {
    ($set:literal) => {
        concat!(
            "UPDATE inflight_taskactivations AS t SET ",
            $set,
            " FROM (SELECT value ->> 0 AS id, value ->> 1 AS claim_expires_at \
                    FROM json_each(?1)) AS r \
             WHERE t.id = r.id AND t.claim_expires_at = r.claim_expires_at \
               AND t.status = 'Claimed' \
             RETURNING id"
        )
    };
}

pub(super) const RELEASE_CLAIMS: &str = fenced_claims!("status = 'Pending'");

pub(super) const MARK_PROCESSING: &str = fenced_claims!(
    "status = 'Processing', processing_deadline = ?2 + processing_deadline_duration * 1000000"
);

pub(super) const FAIL_CLAIM_ATTEMPT: &str = fenced_claims!(
    "processing_attempts = processing_attempts + 1, \
     status = CASE WHEN processing_attempts + 1 >= ?2 THEN 'Failure' ELSE 'Pending' END"
);

// The push used up the task's one delivery: the attempt counts.
pub(super) const FAIL_CLAIMS: &str =
    fenced_claims!("processing_attempts = processing_attempts + 1, status = 'Failure'");

pub(super) const DEFER_CLAIMS: &str = fenced_claims!("status = 'Delay', delay_until = ?2");

// Answers one row when the report applied, with the row's namespace,
// saying whether it likely came from an earlier delivery (`?3` now): past the processing deadline, or
// delivered before. The update changes only `status` (and a RETRY's edit
// columns), so RETURNING sees the deadline and attempts as they were. Of Claimed and Processing rows only
// Processing ones carry a deadline (handing a task out sets it, deadline
// expiry clears it), so no status test is needed.
macro_rules! set_status {
    ($set:literal) => {
        concat!(
            "UPDATE inflight_taskactivations SET status = ?2",
            $set,
            " WHERE id = ?1 AND status IN ('Claimed', 'Processing') \
             RETURNING (processing_deadline IS NOT NULL AND processing_deadline < ?3) \
               OR processing_attempts > 0, namespace"
        )
    };
}
pub(super) const SET_STATUS: &str = set_status!("");
// A RETRY report with edits: the same statement, which also stores the
// edit's given values (`?4`, `?5`) with the row, under the same fence.
pub(super) const SET_STATUS_WITH_EDIT: &str = set_status!(
    ", retry_max_attempts = coalesce(?4, retry_max_attempts), \
     retry_delay_on_retry = coalesce(?5, retry_delay_on_retry)"
);

// A report that finishes the task for good (`?2`: COMPLETE, or FAILURE of
// a task that discards) deletes its handed-out row instead; `late` as above.
pub(super) const DELETE_FINISHED: &str = "DELETE FROM inflight_taskactivations \
     WHERE id = ?1 AND status IN ('Claimed', 'Processing') \
       AND (?2 = 'Complete' OR (?2 = 'Failure' AND on_attempts_exceeded <> 2)) \
     RETURNING (processing_deadline IS NOT NULL AND processing_deadline < ?3) \
       OR processing_attempts > 0, namespace";

pub(super) const EXISTS: &str = "SELECT 1 FROM inflight_taskactivations WHERE id = ?1";

pub(super) const DELETE_BATCH: &str = "DELETE FROM inflight_taskactivations \
     WHERE id IN (SELECT value FROM json_each(?1))";

pub(super) const RELEASE_EXPIRED_CLAIMS: &str = "UPDATE inflight_taskactivations SET status = 'Pending' \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Claimed' AND claim_expires_at < ?1 ORDER BY claim_expires_at LIMIT ?2)";

pub(super) const HANDLE_PROCESSING_DEADLINES: &str = "UPDATE inflight_taskactivations \
       SET status = CASE WHEN at_most_once THEN 'Failure' ELSE 'Pending' END, \
           processing_attempts = processing_attempts + 1, processing_deadline = NULL \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Processing' AND processing_deadline < ?1 \
       ORDER BY processing_deadline LIMIT ?2) \
     RETURNING at_most_once";

pub(super) const FAIL_EXHAUSTED_ATTEMPTS: &str = "UPDATE inflight_taskactivations SET status = 'Failure' \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Pending' AND processing_attempts >= ?1 LIMIT ?2)";

pub(super) const REMOVE_EXPIRED: &str = "DELETE FROM inflight_taskactivations \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Pending' AND expires_at IS NOT NULL AND expires_at < ?1 LIMIT ?2)";

// Killswitches: `?1` a JSON array of `[namespace, taskname]` GLOB
// patterns, `?2` limit. Processing rows are left to their worker.
pub(super) const REMOVE_KILLSWITCHED: &str = "DELETE FROM inflight_taskactivations \
     WHERE id IN (SELECT id FROM inflight_taskactivations AS t \
       WHERE t.status <> 'Processing' AND EXISTS (SELECT 1 FROM json_each(?1) AS k \
         WHERE t.namespace GLOB k.value ->> 0 AND t.taskname GLOB k.value ->> 1) \
       LIMIT ?2)";

pub(super) const RELEASE_DELAYED: &str = "UPDATE inflight_taskactivations SET status = 'Pending' \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Delay' AND delay_until <= ?1 ORDER BY delay_until LIMIT ?2)";

// `?1` now, `?2` limit, `?3` now + lease.
macro_rules! take_for_publish {
    ($filter:literal) => {
        concat!(
            "UPDATE inflight_taskactivations SET publish_expires_at = ?3 \
             WHERE id IN (SELECT id FROM inflight_taskactivations WHERE ",
            $filter,
            " AND (publish_expires_at IS NULL OR publish_expires_at < ?1) \
               ORDER BY added_at LIMIT ?2) RETURNING ",
            columns!()
        )
    };
}
pub(super) const TAKE_RETRIES: &str = take_for_publish!("status = 'Retry'");
pub(super) const TAKE_DEAD_LETTERS: &str =
    take_for_publish!("status = 'Failure' AND on_attempts_exceeded = 2");

// Demoted namespaces' stored rows, to forward: `?1` namespaces (JSON),
// `?2` the demoted topic (rows read from it stay), `?3` limit, `?4` lease
// end, `?5` now.
pub(super) const TAKE_DEMOTED: &str = concat!(
    "UPDATE inflight_taskactivations SET publish_expires_at = ?4 \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status IN ('Pending', 'Delay') \
         AND namespace IN (SELECT value FROM json_each(?1)) AND topic <> ?2 \
         AND (publish_expires_at IS NULL OR publish_expires_at < ?5) \
       ORDER BY added_at LIMIT ?3) RETURNING ",
    columns!()
);

pub(super) const REMOVE_FORWARDED: &str = "DELETE FROM inflight_taskactivations \
     WHERE id IN (SELECT value FROM json_each(?1)) AND status IN ('Pending', 'Delay')";

pub(super) const DISCARD_FAILURES: &str = "UPDATE inflight_taskactivations SET status = 'Complete' \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Failure' AND on_attempts_exceeded <> 2 LIMIT ?1)";

pub(super) const MARK_PUBLISHED: &str = "UPDATE inflight_taskactivations SET status = 'Complete' \
     WHERE id IN (SELECT value FROM json_each(?1)) AND status IN ('Retry', 'Failure')";

pub(super) const REMOVE_COMPLETED: &str = "DELETE FROM inflight_taskactivations \
     WHERE id IN (SELECT id FROM inflight_taskactivations WHERE status = 'Complete' LIMIT ?1)";

// Rows per namespace and status, with the oldest first-attempt Pending
// row's runnable time (µs).
pub(super) const COUNT_BY_NAMESPACE: &str = "SELECT namespace, status, count(*), \
       min(CASE WHEN status = 'Pending' AND processing_attempts = 0 \
                THEN max(received_at, coalesce(delay_until, received_at)) END) \
     FROM inflight_taskactivations GROUP BY namespace, status";

pub(super) const COUNT_BY_STATUS: &str =
    "SELECT status, count(*) FROM inflight_taskactivations GROUP BY status";

// Each consumed topic's backpressure: a scan, run by a consumer at startup,
// before an insert that may cross MAX_INFLIGHT and while it is paused.
pub(super) const COUNT_INFLIGHT_BY_TOPIC: &str = "SELECT topic, count(*) FROM inflight_taskactivations \
     WHERE status IN ('Pending', 'Delay', 'Claimed', 'Processing') GROUP BY topic";

// The sums the triggers of migration V5 keep, one row per topic.
pub(super) const INFLIGHT_BYTES_BY_TOPIC: &str =
    "SELECT topic, bytes FROM taskbroker_inflight_bytes";

pub(super) const HAS_ROWS: &str = "SELECT EXISTS (SELECT 1 FROM inflight_taskactivations)";

// From the partial indexes, as PostgreSQL's MAX_PENDING_LAG: the 64 oldest
// stored first-attempt Pending rows and the 64 oldest first-attempt claims.
pub(super) const OLDEST_RUNNABLE: &str = "SELECT min(runnable) FROM ( \
       SELECT * FROM (SELECT max(received_at, coalesce(delay_until, received_at)) AS runnable \
         FROM inflight_taskactivations WHERE status = 'Pending' AND processing_attempts = 0 \
         ORDER BY added_at LIMIT 64) \
       UNION ALL \
       SELECT * FROM (SELECT max(received_at, coalesce(delay_until, received_at)) \
         FROM inflight_taskactivations WHERE status = 'Claimed' AND processing_attempts = 0 \
         ORDER BY claim_expires_at LIMIT 64))";

pub(super) const GET: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM inflight_taskactivations WHERE id = ?1"
);

// `taskbroker inspect` (read-only): counts per status, namespace and task
// name with the oldest Pending row's received_at, and the claims and
// deadlines due before `?1` (µs), soonest first, at most `?2`.
pub(super) const INSPECT_GROUPS: &str = "SELECT status, namespace, taskname, count(*), \
       min(CASE WHEN status = 'Pending' THEN received_at END), sum(length(activation)) \
     FROM inflight_taskactivations GROUP BY status, namespace, taskname";

pub(super) const INSPECT_NEAR_EXPIRY: &str = "SELECT id, namespace, taskname, status, due FROM ( \
       SELECT id, namespace, taskname, status, \
         CASE WHEN status = 'Claimed' THEN claim_expires_at ELSE processing_deadline END AS due \
       FROM inflight_taskactivations \
       WHERE (status = 'Claimed' AND claim_expires_at < ?1) \
          OR (status = 'Processing' AND processing_deadline < ?1)) \
     ORDER BY due LIMIT ?2";
