-- Fair dispatch reads each (application, namespace)'s oldest Pending rows
-- in a fetcher's bucket range: the bucket in the index skips other
-- fetchers' rows without reading the table. Replaces the index it extends
-- (pull claims use its prefix). Mirrors migrations/postgres.
CREATE INDEX IF NOT EXISTS inflight_pending_by_flow
    ON inflight_taskactivations (application, namespace, added_at, bucket)
    WHERE status = 'Pending';
DROP INDEX IF EXISTS inflight_pending_by_application;
