//! The PostgreSQL statements, one per store operation (a few have variants),
//! kept apart from the code that runs them so each reads as SQL. Rows are
//! named by `columns!`, in the order `rows.rs` reads them; batch
//! statements take whole arrays (`unnest`), so a batch is one round trip.

/// The row columns, in the order `rows::activation_from_row` reads them.
macro_rules! columns {
    () => {
        "id, activation, topic, partition, kafka_offset, added_at, received_at, \
         processing_attempts, expires_at, delay_until, processing_deadline_duration, \
         processing_deadline, claim_expires_at, status, at_most_once, application, namespace, \
         taskname, on_attempts_exceeded, bucket, retry_max_attempts, retry_delay_on_retry"
    };
    (t) => {
        "t.id, t.activation, t.topic, t.partition, t.kafka_offset, t.added_at, t.received_at, \
         t.processing_attempts, t.expires_at, t.delay_until, t.processing_deadline_duration, \
         t.processing_deadline, t.claim_expires_at, t.status, t.at_most_once, t.application, \
         t.namespace, t.taskname, t.on_attempts_exceeded, t.bucket, t.retry_max_attempts, \
         t.retry_delay_on_retry"
    };
}

// Bounded statements pick their rows in a MATERIALIZED CTE: a
// `WHERE id IN (SELECT .. LIMIT n FOR UPDATE SKIP LOCKED)` may be re-run per
// outer row and then touch far more than `n` rows.

/// The channel new rows are announced on (`pg_notify`), so every replica's
/// fetchers wake for rows any replica stored.
macro_rules! new_rows_channel {
    () => {
        "taskbroker_new_rows"
    };
}
pub(super) const NEW_ROWS_CHANNEL: &str = new_rows_channel!();

// Returns the rows inserted; when there are any, announces them on
// NEW_ROWS_CHANNEL (delivered at commit, once per transaction) with the
// inserting store's id ($23), so its own listener can skip them: its
// fetchers are woken in-process already.
pub(super) const INSERT: &str = concat!(
    "WITH ins AS (INSERT INTO inflight_taskactivations (",
    columns!(),
    ") SELECT * FROM unnest($1::text[], $2::bytea[], $3::text[], $4::int4[], $5::int8[], \
     $6::timestamptz[], $7::timestamptz[], $8::int4[], $9::timestamptz[], $10::timestamptz[], \
     $11::int4[], $12::timestamptz[], $13::timestamptz[], $14::text[], $15::bool[], $16::text[], \
     $17::text[], $18::text[], $19::int4[], $20::int2[], $21::int8[], $22::int8[]) \
     ON CONFLICT (id) DO NOTHING RETURNING 1), \
     n AS (SELECT count(*) AS n FROM ins) \
     SELECT n.n FROM n LEFT JOIN LATERAL (SELECT pg_notify('",
    new_rows_channel!(),
    "', $23::text) WHERE n.n > 0) AS announced ON true"
);

// The new expiry is strictly later than any this row had, even if the clock
// or the lease went backwards: that is what makes the fence unambiguous.
// Paused applications and namespaces ($5, $6: one pair per rule, NULL for
// "any") are left out of claims. The variant without them is the common
// case and keeps its plan exactly as before.
macro_rules! not_paused {
    ($app:literal, $namespace:literal) => {
        concat!(
            " AND NOT EXISTS (SELECT 1 FROM unnest(",
            $app,
            "::text[], ",
            $namespace,
            "::text[]) AS p(application, namespace) \
               WHERE (p.application IS NULL OR p.application = inflight_taskactivations.application) \
                 AND (p.namespace IS NULL OR p.namespace = inflight_taskactivations.namespace))"
        )
    };
}

// A claim's byte budget (FETCH_BATCH_BYTES): of the rows `$picked` locked,
// oldest first, those whose predecessors' activations add up to less than
// `$budget` bytes; so always the first, and at most the budget plus one
// activation. The rest stay Pending (their locks end with the statement).
// octet_length() reads a stored value's size from its TOAST pointer.
macro_rules! within_bytes {
    ($picked:expr, $budget:literal) => {
        concat!(
            "(SELECT id FROM (SELECT b.id, octet_length(b.activation) AS size, \
                sum(octet_length(b.activation)) OVER (ORDER BY b.added_at, b.id) AS upto \
              FROM ",
            $picked,
            " AS p JOIN inflight_taskactivations b ON b.id = p.id) AS sized \
              WHERE upto - size < ",
            $budget,
            "::int8)"
        )
    };
}

// `$5` (`$9` in the fair claim, `$4` in the limited one) is the claiming
// broker's id, recorded in `claimed_by`; the last parameter is the byte
// budget (`within_bytes!`).
macro_rules! claim_for_push {
    ($filter:expr, $budget:literal) => {
        concat!(
            "WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
               WHERE status = 'Pending' AND bucket BETWEEN $1 AND $2 \
                 AND (expires_at IS NULL OR expires_at > now())",
            $filter,
            " ORDER BY added_at LIMIT $3 FOR UPDATE SKIP LOCKED) \
             UPDATE inflight_taskactivations t SET status = 'Claimed', claimed_by = $5, \
               claim_expires_at = GREATEST(now() + $4::int8 * interval '1 microsecond', \
                                           t.claim_expires_at + interval '1 microsecond') \
             FROM ",
            within_bytes!("picked", $budget),
            " AS picked WHERE t.id = picked.id RETURNING ",
            columns!(t)
        )
    };
}
pub(super) const CLAIM_FOR_PUSH: &str = claim_for_push!("", "$6");
pub(super) const CLAIM_FOR_PUSH_UNPAUSED: &str = claim_for_push!(not_paused!("$6", "$7"), "$8");

// Fair dispatch ($5, $6: paused rules as above; $7, $8: namespaces and
// their weights, others weigh 1). `flows` walks the distinct (application,
// namespace) pairs with Pending rows through their index, one probe each;
// each flow not paused locks ⌈$3 × weight / total⌉ of its oldest rows in
// the bucket range; those are interleaved by turn (rank / weight, ties in
// random order) and the first $3 kept; `fill` tops the batch up oldest
// first. Rows a flow locked beyond the first $3 stay Pending (`fill` may
// still take them); the shares exceed $3 by fewer rows than there are flows.
// A flow's rows are named by a range of (application, namespace, added_at)
// rather than by equality, so that only the flow index
// (inflight_pending_by_flow) gives their order: with equality the planner
// may walk inflight_pending_by_age instead, which for a small namespace
// behind a flood reads the whole flood first.
pub(super) const CLAIM_FOR_PUSH_FAIR: &str = concat!(
    "WITH RECURSIVE flows AS ( \
       (SELECT application, namespace FROM inflight_taskactivations \
          WHERE status = 'Pending' ORDER BY application, namespace LIMIT 1) \
       UNION ALL \
       SELECT next.application, next.namespace FROM flows f CROSS JOIN LATERAL ( \
         SELECT t.application, t.namespace FROM inflight_taskactivations t \
          WHERE t.status = 'Pending' \
            AND (t.application, t.namespace) > (f.application, f.namespace) \
          ORDER BY t.application, t.namespace LIMIT 1) AS next), \
     weighted AS (SELECT f.application, f.namespace, COALESCE(w.weight, 1)::float8 AS weight \
       FROM flows f LEFT JOIN unnest($7::text[], $8::int4[]) AS w(namespace, weight) \
         ON w.namespace = f.namespace \
       WHERE NOT EXISTS (SELECT 1 FROM unnest($5::text[], $6::text[]) AS p(application, namespace) \
         WHERE (p.application IS NULL OR p.application = f.application) \
           AND (p.namespace IS NULL OR p.namespace = f.namespace))), \
     shares AS (SELECT application, namespace, weight, \
         ceil($3::int8 * weight / sum(weight) OVER ())::int8 AS share FROM weighted), \
     fair AS MATERIALIZED (SELECT head.id FROM shares s CROSS JOIN LATERAL ( \
         SELECT id, row_number() OVER (ORDER BY added_at) AS turn FROM ( \
           SELECT id, added_at FROM inflight_taskactivations t \
            WHERE t.status = 'Pending' \
              AND (t.application, t.namespace, t.added_at) \
                  > (s.application, s.namespace, '-infinity'::timestamptz) \
              AND (t.application, t.namespace, t.added_at) \
                  < (s.application, s.namespace, 'infinity'::timestamptz) \
              AND t.bucket BETWEEN $1 AND $2 \
              AND (t.expires_at IS NULL OR t.expires_at > now()) \
            ORDER BY t.application, t.namespace, t.added_at LIMIT s.share \
            FOR UPDATE SKIP LOCKED) AS oldest) AS head \
       ORDER BY head.turn / s.weight, random() LIMIT $3), \
     fill AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
        WHERE status = 'Pending' AND bucket BETWEEN $1 AND $2 \
          AND (expires_at IS NULL OR expires_at > now())",
    not_paused!("$5", "$6"),
    " AND id NOT IN (SELECT id FROM fair) \
        ORDER BY added_at LIMIT $3 - (SELECT count(*) FROM fair) FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Claimed', claimed_by = $9, \
       claim_expires_at = GREATEST(now() + $4::int8 * interval '1 microsecond', \
                                   t.claim_expires_at + interval '1 microsecond') \
     FROM ",
    within_bytes!("(SELECT id FROM fair UNION ALL SELECT id FROM fill)", "$10"),
    " AS picked WHERE t.id = picked.id RETURNING ",
    columns!(t)
);

// Concurrency limits: under a transaction-scoped advisory lock on the
// namespace (so two brokers never count and claim at once), count its rows
// in flight, then claim at most the room left, all bucket ranges.
pub(super) const LOCK_NAMESPACE_LIMIT: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('taskbroker/limit/' || $1::text, 0))";
pub(super) const COUNT_NAMESPACE_IN_FLIGHT: &str = "SELECT count(*)::int8 \
     FROM inflight_taskactivations WHERE namespace = $1 AND status IN ('Claimed', 'Processing')";
pub(super) const CLAIM_LIMITED: &str = concat!(
    "WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Pending' AND namespace = $1 \
         AND (expires_at IS NULL OR expires_at > now()) \
       ORDER BY added_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Claimed', claimed_by = $4, \
       claim_expires_at = GREATEST(now() + $3::int8 * interval '1 microsecond', \
                                   t.claim_expires_at + interval '1 microsecond') \
     FROM ",
    within_bytes!("picked", "$5"),
    " AS picked WHERE t.id = picked.id RETURNING ",
    columns!(t)
);

macro_rules! claim_for_pull {
    ($filter:expr) => {
        concat!(
            "WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
               WHERE status = 'Pending' AND (expires_at IS NULL OR expires_at > now()) ",
            $filter,
            " ORDER BY added_at LIMIT 1 FOR UPDATE SKIP LOCKED) \
             UPDATE inflight_taskactivations t SET status = 'Processing', \
               processing_deadline = now() + ($1::float8 + t.processing_deadline_duration) \
                                              * interval '1 second' \
             FROM picked WHERE t.id = picked.id RETURNING ",
            columns!(t)
        )
    };
}
macro_rules! pull_filter {
    (any) => {
        "AND $2::text IS NULL AND $3::text IS NULL"
    };
    (application) => {
        "AND application = $2 AND $3::text IS NULL"
    };
    (namespace) => {
        "AND application = $2 AND namespace = $3"
    };
}
pub(super) const CLAIM_FOR_PULL_ANY: &str = claim_for_pull!(pull_filter!(any));
pub(super) const CLAIM_FOR_PULL_APPLICATION: &str = claim_for_pull!(pull_filter!(application));
pub(super) const CLAIM_FOR_PULL_NAMESPACE: &str = claim_for_pull!(pull_filter!(namespace));
pub(super) const CLAIM_FOR_PULL_ANY_UNPAUSED: &str =
    claim_for_pull!(concat!(pull_filter!(any), not_paused!("$4", "$5")));
pub(super) const CLAIM_FOR_PULL_APPLICATION_UNPAUSED: &str =
    claim_for_pull!(concat!(pull_filter!(application), not_paused!("$4", "$5")));
pub(super) const CLAIM_FOR_PULL_NAMESPACE_UNPAUSED: &str =
    claim_for_pull!(concat!(pull_filter!(namespace), not_paused!("$4", "$5")));

// Every way out of Claimed clears `claimed_by`, so the column names only a
// row's current claim: a broker older than V4 claims without writing it,
// and a stale id left on such a claim would have the restart or takeover of
// the broker named release it (tests/broker_membership.rs).
//
// Batch writes by id lock their rows in id order first (`held`): two
// batches touching the same rows (a push pool marking pushes while workers
// report results) would otherwise lock them in different orders and
// deadlock. The fence (status and claim_expires_at) is re-checked on the
// locked row version.
macro_rules! fenced_claims {
    () => {
        "WITH held AS MATERIALIZED (SELECT t.id FROM inflight_taskactivations t \
           JOIN unnest($1::text[], $2::timestamptz[]) AS r(id, claim_expires_at) \
             ON t.id = r.id AND t.claim_expires_at = r.claim_expires_at \
           WHERE t.status = 'Claimed' ORDER BY t.id FOR UPDATE OF t) "
    };
}

pub(super) const RELEASE_CLAIMS: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t SET status = 'Pending', claimed_by = NULL \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed'"
);

pub(super) const MARK_PROCESSING: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t SET status = 'Processing', claimed_by = NULL, \
       processing_deadline = now() + ($3::float8 + t.processing_deadline_duration) \
                                      * interval '1 second' \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed' RETURNING t.id"
);

pub(super) const FAIL_CLAIM_ATTEMPT: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t \
       SET processing_attempts = t.processing_attempts + 1, claimed_by = NULL, \
           status = CASE WHEN t.processing_attempts + 1 >= $3 THEN 'Failure' ELSE 'Pending' END \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed'"
);

// The push used up the task's one delivery: the attempt counts.
pub(super) const FAIL_CLAIMS: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t \
       SET processing_attempts = t.processing_attempts + 1, status = 'Failure', \
           claimed_by = NULL \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed'"
);

pub(super) const DEFER_CLAIMS: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t SET status = 'Delay', delay_until = $3, claimed_by = NULL \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed'"
);

// Counts are over distinct ids; `existing` is read from the statement's
// snapshot, i.e. before the writes. `late` marks reports that likely come
// from an earlier delivery (the row is past its processing deadline, or was
// delivered before): `held` keeps the locked row's values from before the
// writes, so the count needs no second query. A report that finishes the
// task for good (COMPLETE, or FAILURE of a task that discards) deletes the
// row in this statement; RETRY and dead-lettering FAILURE rows stay for
// upkeep to publish. The last three columns are the applied reports per
// namespace and reported status, as parallel arrays in one order.
macro_rules! set_status {
    ($reports:literal, $set:literal) => {
        concat!(
            "WITH u AS (SELECT DISTINCT ON (id) * FROM ",
            $reports,
            "), \
             held AS MATERIALIZED (SELECT t.id, t.namespace, u.status AS reported, \
                 (t.status = 'Processing' AND t.processing_deadline < now()) \
                   OR t.processing_attempts > 0 AS late, \
                 u.status = 'Complete' \
                   OR (u.status = 'Failure' AND t.on_attempts_exceeded <> 2) AS finished \
               FROM inflight_taskactivations t JOIN u ON t.id = u.id \
               WHERE t.status IN ('Claimed', 'Processing') ORDER BY t.id FOR UPDATE OF t), \
             deleted AS (DELETE FROM inflight_taskactivations t USING held \
               WHERE t.id = held.id AND held.finished AND t.status IN ('Claimed', 'Processing') \
               RETURNING held.late, held.namespace, held.reported), \
             updated AS (UPDATE inflight_taskactivations t SET status = u.status, claimed_by = NULL",
            $set,
            " FROM u, held \
               WHERE t.id = u.id AND t.id = held.id AND NOT held.finished \
                 AND t.status IN ('Claimed', 'Processing') \
               RETURNING held.late, held.namespace, held.reported), \
             written AS (SELECT * FROM deleted UNION ALL SELECT * FROM updated), \
             results AS (SELECT namespace, reported, count(*)::int8 AS n FROM written \
               GROUP BY namespace, reported) \
             SELECT (SELECT count(*) FROM u), \
                    (SELECT count(*) FROM inflight_taskactivations t JOIN u ON t.id = u.id), \
                    (SELECT count(*) FROM written), \
                    (SELECT count(*) FROM written WHERE late), \
                    ARRAY(SELECT namespace FROM results ORDER BY namespace, reported), \
                    ARRAY(SELECT reported FROM results ORDER BY namespace, reported), \
                    ARRAY(SELECT n FROM results ORDER BY namespace, reported)"
        )
    };
}
pub(super) const SET_STATUS: &str =
    set_status!("unnest($1::text[], $2::text[]) AS u(id, status)", "");
// A batch where some RETRY reports carry edits: the same statement, which
// also stores each edit's given values with its row, under the same fence.
pub(super) const SET_STATUS_WITH_EDITS: &str = set_status!(
    "unnest($1::text[], $2::text[], $3::int8[], $4::int8[]) \
       AS u(id, status, max_attempts, delay_on_retry)",
    ", retry_max_attempts = COALESCE(u.max_attempts, t.retry_max_attempts), \
     retry_delay_on_retry = COALESCE(u.delay_on_retry, t.retry_delay_on_retry)"
);

pub(super) const DELETE_BATCH: &str = "DELETE FROM inflight_taskactivations WHERE id = ANY($1)";

pub(super) const RELEASE_EXPIRED_CLAIMS: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Claimed' AND claim_expires_at < now() \
       ORDER BY claim_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Pending', claimed_by = NULL \
     FROM picked WHERE t.id = picked.id AND t.status = 'Claimed'";

pub(super) const HANDLE_PROCESSING_DEADLINES: &str = "WITH due AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Processing' AND processing_deadline < now() \
       ORDER BY processing_deadline LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t \
       SET status = CASE WHEN t.at_most_once THEN 'Failure' ELSE 'Pending' END, \
           processing_attempts = t.processing_attempts + 1, processing_deadline = NULL \
     FROM due WHERE t.id = due.id AND t.status = 'Processing' RETURNING t.at_most_once";

pub(super) const FAIL_EXHAUSTED_ATTEMPTS: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Pending' AND processing_attempts >= $1 \
       LIMIT $2 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Failure' \
     FROM picked WHERE t.id = picked.id AND t.status = 'Pending'";

pub(super) const REMOVE_EXPIRED: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations \
       WHERE status = 'Pending' AND expires_at IS NOT NULL AND expires_at < now() \
       LIMIT $1 FOR UPDATE SKIP LOCKED) \
     DELETE FROM inflight_taskactivations t USING picked \
     WHERE t.id = picked.id AND t.status = 'Pending'";

// Killswitches ($1, $2: one pair of LIKE patterns per killswitch). Rows a
// worker is running (Processing) are left to finish; every other status
// goes, a Claimed row's push finding it gone like any stale claim.
pub(super) const REMOVE_KILLSWITCHED: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations t \
       WHERE t.status <> 'Processing' AND EXISTS (SELECT 1 \
         FROM unnest($1::text[], $2::text[]) AS k(namespace, taskname) \
         WHERE t.namespace LIKE k.namespace AND t.taskname LIKE k.taskname) \
       LIMIT $3 FOR UPDATE SKIP LOCKED) \
     DELETE FROM inflight_taskactivations t USING picked \
     WHERE t.id = picked.id AND t.status <> 'Processing'";

pub(super) const RELEASE_DELAYED: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Delay' AND delay_until <= now() \
       ORDER BY delay_until LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Pending' \
     FROM picked WHERE t.id = picked.id AND t.status = 'Delay'";

macro_rules! take_for_publish {
    ($filter:literal) => {
        concat!(
            "WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations WHERE ",
            $filter,
            " AND (publish_expires_at IS NULL OR publish_expires_at < now()) \
              ORDER BY added_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
             UPDATE inflight_taskactivations t \
               SET publish_expires_at = now() + $2::int8 * interval '1 microsecond' \
             FROM picked WHERE t.id = picked.id RETURNING ",
            columns!(t)
        )
    };
}
pub(super) const TAKE_RETRIES: &str = take_for_publish!("status = 'Retry'");
pub(super) const TAKE_DEAD_LETTERS: &str =
    take_for_publish!("status = 'Failure' AND on_attempts_exceeded = 2");

// Demoted namespaces' stored rows, to forward to the demoted topic: Pending
// or Delay rows of the namespaces $1 not consumed from the demoted topic
// $2, leased for $4 µs like rows taken for publishing (claims leave these
// namespaces out, so nothing else takes them meanwhile).
pub(super) const TAKE_DEMOTED: &str = concat!(
    "WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
       WHERE status IN ('Pending', 'Delay') AND namespace = ANY($1) AND topic <> $2 \
         AND (publish_expires_at IS NULL OR publish_expires_at < now()) \
       ORDER BY added_at LIMIT $3 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t \
       SET publish_expires_at = now() + $4::int8 * interval '1 microsecond' \
     FROM picked WHERE t.id = picked.id RETURNING ",
    columns!(t)
);

// Kafka acknowledged the forwarded rows: they are gone from here. A row
// claimed meanwhile (by a broker without the rule) stays and runs there.
pub(super) const REMOVE_FORWARDED: &str = "DELETE FROM inflight_taskactivations \
     WHERE id = ANY($1) AND status IN ('Pending', 'Delay')";

pub(super) const DISCARD_FAILURES: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Failure' AND on_attempts_exceeded <> 2 \
       LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Complete' \
     FROM picked WHERE t.id = picked.id AND t.status = 'Failure'";

pub(super) const MARK_PUBLISHED: &str = "UPDATE inflight_taskactivations SET status = 'Complete' \
     WHERE id = ANY($1) AND status IN ('Retry', 'Failure')";

pub(super) const REMOVE_COMPLETED: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Complete' \
       LIMIT $1 FOR UPDATE SKIP LOCKED) \
     DELETE FROM inflight_taskactivations t USING picked \
     WHERE t.id = picked.id AND t.status = 'Complete'";

// Rows per namespace and status, with the oldest first-attempt Pending
// row's runnable time: upkeep's per-namespace gauges, and the per-status
// counts summed from them (one scan of the table for both).
pub(super) const COUNT_BY_NAMESPACE: &str = "SELECT namespace, status, count(*)::int8, \
       min(GREATEST(received_at, COALESCE(delay_until, received_at))) \
         FILTER (WHERE status = 'Pending' AND processing_attempts = 0) \
     FROM inflight_taskactivations GROUP BY namespace, status";

pub(super) const COUNT_BY_STATUS: &str =
    "SELECT status, count(*) FROM inflight_taskactivations GROUP BY status";

// Each consumed topic's backpressure: a scan, run by a consumer at startup,
// before an insert that may cross MAX_INFLIGHT and while it is paused.
pub(super) const COUNT_INFLIGHT_BY_TOPIC: &str = "SELECT topic, count(*) FROM inflight_taskactivations \
     WHERE status IN ('Pending', 'Delay', 'Claimed', 'Processing') GROUP BY topic";

// The sums the triggers of migration V5 keep, a few rows per topic.
pub(super) const INFLIGHT_BYTES_BY_TOPIC: &str =
    "SELECT topic, sum(bytes)::int8 FROM taskbroker_inflight_bytes GROUP BY topic";

// Read from the two partial indexes, never the whole table: the 64 oldest
// stored first-attempt Pending rows (by `added_at`) and the 64 oldest
// first-attempt claims. The first stored is, but for a delay, the first
// received, so the oldest runnable row is among them.
pub(super) const HAS_ROWS: &str = "SELECT EXISTS (SELECT 1 FROM inflight_taskactivations)";

pub(super) const MAX_PENDING_LAG: &str = "SELECT COALESCE(GREATEST(EXTRACT(EPOCH FROM \
       now() - min(runnable)), 0), 0)::float8 FROM ( \
       (SELECT GREATEST(received_at, COALESCE(delay_until, received_at)) AS runnable \
          FROM inflight_taskactivations WHERE status = 'Pending' AND processing_attempts = 0 \
          ORDER BY added_at LIMIT 64) \
       UNION ALL \
       (SELECT GREATEST(received_at, COALESCE(delay_until, received_at)) \
          FROM inflight_taskactivations WHERE status = 'Claimed' AND processing_attempts = 0 \
          ORDER BY claim_expires_at LIMIT 64)) AS oldest";

pub(super) const GET: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM inflight_taskactivations WHERE id = $1"
);

// `taskbroker inspect` (read-only): counts per status, namespace and task
// name with the oldest Pending row's received_at, and the claims and
// deadlines due within `$1` microseconds, soonest first, at most `$2`.
pub(super) const INSPECT_GROUPS: &str = "SELECT status, namespace, taskname, count(*)::int8, \
       min(received_at) FILTER (WHERE status = 'Pending'), sum(octet_length(activation))::int8 \
     FROM inflight_taskactivations GROUP BY status, namespace, taskname";

pub(super) const INSPECT_NEAR_EXPIRY: &str = "SELECT id, namespace, taskname, status, due FROM ( \
       SELECT id, namespace, taskname, status, \
         CASE WHEN status = 'Claimed' THEN claim_expires_at ELSE processing_deadline END AS due \
       FROM inflight_taskactivations \
       WHERE (status = 'Claimed' \
              AND claim_expires_at < now() + $1::int8 * interval '1 microsecond') \
          OR (status = 'Processing' \
              AND processing_deadline < now() + $1::int8 * interval '1 microsecond')) AS d \
     ORDER BY due LIMIT $2";
