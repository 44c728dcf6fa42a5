-- In-flight activations: every task the broker holds between Kafka and its
-- terminal outcome. Column names are the operator-facing contract (DESIGN.md).
CREATE TABLE IF NOT EXISTS inflight_taskactivations (
    id                           TEXT        PRIMARY KEY,
    activation                   BYTEA       NOT NULL,
    topic                        TEXT        NOT NULL,
    partition                    INTEGER     NOT NULL,
    kafka_offset                 BIGINT      NOT NULL,
    added_at                     TIMESTAMPTZ NOT NULL DEFAULT now(),
    received_at                  TIMESTAMPTZ NOT NULL,
    processing_attempts          INTEGER     NOT NULL DEFAULT 0,
    expires_at                   TIMESTAMPTZ NULL,
    delay_until                  TIMESTAMPTZ NULL,
    processing_deadline_duration INTEGER     NOT NULL,
    processing_deadline          TIMESTAMPTZ NULL,
    -- Expiry of the latest claim. Every claim writes a strictly later value,
    -- which is what fences release / undo / mark-processing.
    claim_expires_at             TIMESTAMPTZ NULL,
    status                       TEXT        NOT NULL,
    at_most_once                 BOOLEAN     NOT NULL DEFAULT FALSE,
    application                  TEXT        NOT NULL DEFAULT '',
    namespace                    TEXT        NOT NULL,
    taskname                     TEXT        NOT NULL,
    on_attempts_exceeded         INTEGER     NOT NULL DEFAULT 0,
    bucket                       SMALLINT    NOT NULL,
    -- Lease taken by an upkeep step publishing this row (retry / dead
    -- letter), so two replicas never publish the same row.
    publish_expires_at           TIMESTAMPTZ NULL,
    CONSTRAINT inflight_status_known CHECK (status IN
        ('Pending', 'Delay', 'Claimed', 'Processing', 'Retry', 'Failure', 'Complete')),
    CONSTRAINT inflight_bucket_range CHECK (bucket BETWEEN 0 AND 255)
);

-- Push claims: Pending rows oldest first; the bucket is in the index so a
-- FetchActor's range filter is checked without visiting the heap.
CREATE INDEX IF NOT EXISTS inflight_pending_by_age
    ON inflight_taskactivations (added_at, bucket) WHERE status = 'Pending';
-- Pull claims: Pending rows of an application / namespace, oldest first.
CREATE INDEX IF NOT EXISTS inflight_pending_by_application
    ON inflight_taskactivations (application, namespace, added_at) WHERE status = 'Pending';
-- Upkeep: lease expiry, processing deadlines, due delays.
CREATE INDEX IF NOT EXISTS inflight_claimed_by_expiry
    ON inflight_taskactivations (claim_expires_at) WHERE status = 'Claimed';
CREATE INDEX IF NOT EXISTS inflight_processing_by_deadline
    ON inflight_taskactivations (processing_deadline) WHERE status = 'Processing';
CREATE INDEX IF NOT EXISTS inflight_delay_by_due
    ON inflight_taskactivations (delay_until) WHERE status = 'Delay';
-- Upkeep: expiry of Pending rows.
CREATE INDEX IF NOT EXISTS inflight_pending_by_expiry
    ON inflight_taskactivations (expires_at) WHERE status = 'Pending' AND expires_at IS NOT NULL;
-- Upkeep: finished rows (Retry, Failure, Complete). Partial, so the hot
-- transitions (Pending -> Claimed -> Processing) do not maintain it.
CREATE INDEX IF NOT EXISTS inflight_finished_by_status
    ON inflight_taskactivations (status, added_at)
    WHERE status IN ('Retry', 'Failure', 'Complete');
-- Upkeep: Pending rows that used up their attempts.
CREATE INDEX IF NOT EXISTS inflight_pending_by_attempts
    ON inflight_taskactivations (processing_attempts) WHERE status = 'Pending';
