-- Plans of the broker's hot and upkeep statements on a table of 100,000
-- rows (90,000 Pending, 5,000 Claimed, 5,000 Processing), for BENCHMARKS.md.
-- The statements are those of src/store/postgres/sql.rs with their
-- parameters written in; keep them in step when a statement changes.
--
--   createdb -h 127.0.0.1 -U postgres explain_tb
--   psql -h 127.0.0.1 -U postgres -d explain_tb -f migrations/postgres/V1__create_inflight_taskactivations.sql
--   psql -h 127.0.0.1 -U postgres -d explain_tb -f migrations/postgres/V2__retry_edit_columns.sql
--   psql -h 127.0.0.1 -U postgres -d explain_tb -f tools/sql/explain.sql
\set ON_ERROR_STOP on
TRUNCATE inflight_taskactivations;
INSERT INTO inflight_taskactivations (id, activation, topic, partition, kafka_offset, added_at,
    received_at, processing_deadline_duration, claim_expires_at, processing_deadline, status,
    application, namespace, taskname, bucket)
SELECT 'task-' || i, '\x00'::bytea, 'tasks', i % 8, i,
       now() - (100000 - i) * interval '1 millisecond',
       now() - (100000 - i) * interval '1 millisecond', 60,
       CASE WHEN i <= 5000 THEN now() + interval '20 seconds' END,
       CASE WHEN i > 5000 AND i <= 10000 THEN now() + interval '60 seconds' END,
       CASE WHEN i <= 5000 THEN 'Claimed' WHEN i <= 10000 THEN 'Processing' ELSE 'Pending' END,
       'app', 'ns', 'task', i % 256
FROM generate_series(1, 100000) AS i;
VACUUM ANALYZE inflight_taskactivations;

\echo '=== claim_for_push (64 rows, buckets 0-127)'
BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations
   WHERE status = 'Pending' AND bucket BETWEEN 0 AND 127
     AND (expires_at IS NULL OR expires_at > now())
   ORDER BY added_at LIMIT 64 FOR UPDATE SKIP LOCKED)
UPDATE inflight_taskactivations t SET status = 'Claimed',
   claim_expires_at = GREATEST(now() + 20000000 * interval '1 microsecond',
                               t.claim_expires_at + interval '1 microsecond')
FROM picked WHERE t.id = picked.id RETURNING t.id;
ROLLBACK;

\echo '=== mark_processing (64 claims)'
BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
WITH held AS MATERIALIZED (SELECT t.id FROM inflight_taskactivations t
   JOIN unnest(ARRAY(SELECT id FROM inflight_taskactivations WHERE status = 'Claimed' LIMIT 64),
               ARRAY(SELECT claim_expires_at FROM inflight_taskactivations WHERE status = 'Claimed' LIMIT 64))
     AS r(id, claim_expires_at) ON t.id = r.id AND t.claim_expires_at = r.claim_expires_at
   WHERE t.status = 'Claimed' ORDER BY t.id FOR UPDATE OF t)
UPDATE inflight_taskactivations t SET status = 'Processing',
   processing_deadline = now() + (3 + t.processing_deadline_duration) * interval '1 second'
FROM held WHERE t.id = held.id AND t.status = 'Claimed' RETURNING t.id;
ROLLBACK;

\echo '=== set_status (64 COMPLETE reports: deleted in the statement)'
BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
WITH u AS (SELECT DISTINCT ON (id) * FROM
     unnest(ARRAY(SELECT id FROM inflight_taskactivations WHERE status = 'Processing' LIMIT 64),
            array_fill('Complete'::text, ARRAY[64])) AS u(id, status)),
 held AS MATERIALIZED (SELECT t.id,
     (t.status = 'Processing' AND t.processing_deadline < now()) OR t.processing_attempts > 0 AS late,
     u.status = 'Complete' OR (u.status = 'Failure' AND t.on_attempts_exceeded <> 2) AS finished
   FROM inflight_taskactivations t JOIN u ON t.id = u.id
   WHERE t.status IN ('Claimed', 'Processing') ORDER BY t.id FOR UPDATE OF t),
 deleted AS (DELETE FROM inflight_taskactivations t USING held
   WHERE t.id = held.id AND held.finished AND t.status IN ('Claimed', 'Processing')
   RETURNING held.late),
 updated AS (UPDATE inflight_taskactivations t SET status = u.status FROM u, held
   WHERE t.id = u.id AND t.id = held.id AND NOT held.finished
     AND t.status IN ('Claimed', 'Processing') RETURNING held.late),
 written AS (SELECT late FROM deleted UNION ALL SELECT late FROM updated)
SELECT (SELECT count(*) FROM u),
       (SELECT count(*) FROM inflight_taskactivations t JOIN u ON t.id = u.id),
       (SELECT count(*) FROM written), (SELECT count(*) FROM written WHERE late);
ROLLBACK;

\echo '=== max_pending_lag (upkeep, every cycle)'
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
SELECT COALESCE(GREATEST(EXTRACT(EPOCH FROM now() - min(runnable)), 0), 0)::float8 FROM (
   (SELECT GREATEST(received_at, COALESCE(delay_until, received_at)) AS runnable
      FROM inflight_taskactivations WHERE status = 'Pending' AND processing_attempts = 0
      ORDER BY added_at LIMIT 64)
   UNION ALL
   (SELECT GREATEST(received_at, COALESCE(delay_until, received_at))
      FROM inflight_taskactivations WHERE status = 'Claimed' AND processing_attempts = 0
      ORDER BY claim_expires_at LIMIT 64)) AS oldest;

\echo '=== count_by_status (upkeep, every 10 s)'
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
SELECT status, count(*) FROM inflight_taskactivations GROUP BY status;

\echo '=== release_expired_claims (upkeep)'
BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations
   WHERE status = 'Claimed' AND claim_expires_at < now()
   ORDER BY claim_expires_at LIMIT 1000 FOR UPDATE SKIP LOCKED)
UPDATE inflight_taskactivations t SET status = 'Pending'
FROM picked WHERE t.id = picked.id AND t.status = 'Claimed';
ROLLBACK;

\echo '=== handle_processing_deadlines (upkeep)'
BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
WITH due AS MATERIALIZED (SELECT id FROM inflight_taskactivations
   WHERE status = 'Processing' AND processing_deadline < now()
   ORDER BY processing_deadline LIMIT 1000 FOR UPDATE SKIP LOCKED)
UPDATE inflight_taskactivations t
   SET status = CASE WHEN t.at_most_once THEN 'Failure' ELSE 'Pending' END,
       processing_attempts = t.processing_attempts + 1, processing_deadline = NULL
FROM due WHERE t.id = due.id AND t.status = 'Processing' RETURNING t.at_most_once;
ROLLBACK;

\echo '=== remove_completed (upkeep)'
BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations WHERE status = 'Complete'
   LIMIT 1000 FOR UPDATE SKIP LOCKED)
DELETE FROM inflight_taskactivations t USING picked
WHERE t.id = picked.id AND t.status = 'Complete';
ROLLBACK;
