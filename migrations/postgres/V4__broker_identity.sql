-- Broker identity and liveness (DESIGN.md, "Broker identity and recovery").
--
-- Each running broker keeps a row here and refreshes `heartbeat_at` about
-- every second. `incarnation` changes with every start (and every
-- re-registration after a takeover), so a broker can tell its own row from
-- one a peer, or a second process misconfigured with the same id, wrote.
-- A peer that finds `heartbeat_at` older than the takeover timeout deletes
-- the row and, in the same statement, returns the broker's claims to
-- Pending.
CREATE TABLE IF NOT EXISTS taskbroker_brokers (
    id           TEXT        PRIMARY KEY,
    host         TEXT        NOT NULL,
    incarnation  TEXT        NOT NULL,
    started_at   TIMESTAMPTZ NOT NULL,
    heartbeat_at TIMESTAMPTZ NOT NULL
);

-- The broker that wrote the row's latest claim. Only meaningful while the
-- row is Claimed: a new claim overwrites it. NULL on rows claimed before
-- this migration (their lease still returns them).
--
-- A nullable column without a default: PostgreSQL only updates the
-- catalog, so this is safe on a live, large table. No index: releasing one
-- broker's claims reads the Claimed rows through inflight_claimed_by_expiry,
-- and they are few (what the brokers' pipelines hold).
ALTER TABLE inflight_taskactivations
    ADD COLUMN IF NOT EXISTS claimed_by TEXT NULL;
