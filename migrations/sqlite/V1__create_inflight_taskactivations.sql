-- In-flight activations, embedded store. Mirrors migrations/postgres with
-- SQLite's types: timestamps are INTEGER microseconds since the Unix epoch
-- (exact, so the claim_expires_at fence compares without rounding), booleans
-- are 0/1. Column names are the same as PostgreSQL's.
CREATE TABLE IF NOT EXISTS inflight_taskactivations (
    id                           TEXT    NOT NULL PRIMARY KEY,
    activation                   BLOB    NOT NULL,
    topic                        TEXT    NOT NULL,
    partition                    INTEGER NOT NULL,
    kafka_offset                 INTEGER NOT NULL,
    added_at                     INTEGER NOT NULL,
    received_at                  INTEGER NOT NULL,
    processing_attempts          INTEGER NOT NULL DEFAULT 0,
    expires_at                   INTEGER NULL,
    delay_until                  INTEGER NULL,
    processing_deadline_duration INTEGER NOT NULL,
    processing_deadline          INTEGER NULL,
    -- Expiry of the latest claim; every claim writes a strictly later value.
    claim_expires_at             INTEGER NULL,
    status                       TEXT    NOT NULL CHECK (status IN
        ('Pending', 'Delay', 'Claimed', 'Processing', 'Retry', 'Failure', 'Complete')),
    at_most_once                 INTEGER NOT NULL DEFAULT 0 CHECK (at_most_once IN (0, 1)),
    application                  TEXT    NOT NULL DEFAULT '',
    namespace                    TEXT    NOT NULL,
    taskname                     TEXT    NOT NULL,
    on_attempts_exceeded         INTEGER NOT NULL DEFAULT 0,
    bucket                       INTEGER NOT NULL CHECK (bucket BETWEEN 0 AND 255),
    -- Lease of the upkeep step publishing this row (retry / dead letter).
    publish_expires_at           INTEGER NULL
);

-- The same partial indexes as PostgreSQL, for the same statements.
CREATE INDEX IF NOT EXISTS inflight_pending_by_age
    ON inflight_taskactivations (added_at, bucket) WHERE status = 'Pending';
CREATE INDEX IF NOT EXISTS inflight_pending_by_application
    ON inflight_taskactivations (application, namespace, added_at) WHERE status = 'Pending';
CREATE INDEX IF NOT EXISTS inflight_claimed_by_expiry
    ON inflight_taskactivations (claim_expires_at) WHERE status = 'Claimed';
CREATE INDEX IF NOT EXISTS inflight_processing_by_deadline
    ON inflight_taskactivations (processing_deadline) WHERE status = 'Processing';
CREATE INDEX IF NOT EXISTS inflight_delay_by_due
    ON inflight_taskactivations (delay_until) WHERE status = 'Delay';
CREATE INDEX IF NOT EXISTS inflight_pending_by_expiry
    ON inflight_taskactivations (expires_at) WHERE status = 'Pending' AND expires_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS inflight_finished_by_status
    ON inflight_taskactivations (status, added_at)
    WHERE status IN ('Retry', 'Failure', 'Complete');
CREATE INDEX IF NOT EXISTS inflight_pending_by_attempts
    ON inflight_taskactivations (processing_attempts) WHERE status = 'Pending';
