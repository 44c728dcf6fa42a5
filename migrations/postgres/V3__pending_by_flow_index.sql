-- Fair dispatch walks the (application, namespace) pairs with Pending rows
-- and reads each pair's oldest rows in a fetcher's bucket range. With the
-- bucket in the index, rows of other fetchers' buckets are skipped in the
-- index instead of being fetched from the table. The new index serves the
-- pull claims by application / namespace as the old one did, so it
-- replaces it; the table keeps as many indexes as before.
--
-- A partial index over the Pending rows only: built in one pass while
-- inserts wait, so on a large backlog this migration holds writers for
-- about as long as a scan of the Pending rows takes.
CREATE INDEX IF NOT EXISTS inflight_pending_by_flow
    ON inflight_taskactivations (application, namespace, added_at, bucket)
    WHERE status = 'Pending';
DROP INDEX IF EXISTS inflight_pending_by_application;
