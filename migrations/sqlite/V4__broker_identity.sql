-- Broker identity and liveness; mirrors migrations/postgres (timestamps are
-- INTEGER microseconds since the Unix epoch). Only one process opens an
-- SQLite store, so every other row here belongs to a broker that is gone.
CREATE TABLE IF NOT EXISTS taskbroker_brokers (
    id           TEXT    NOT NULL PRIMARY KEY,
    host         TEXT    NOT NULL,
    incarnation  TEXT    NOT NULL,
    started_at   INTEGER NOT NULL,
    heartbeat_at INTEGER NOT NULL
);

-- The broker that wrote the row's latest claim (see migrations/postgres).
ALTER TABLE inflight_taskactivations ADD COLUMN claimed_by TEXT NULL;
