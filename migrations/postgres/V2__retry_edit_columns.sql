-- A worker's RETRY report may edit the task's retry state (`max_attempts`,
-- `delay_on_retry`). The edit is kept beside the row, and applied to the
-- activation upkeep publishes to the retry topic; the stored `activation`
-- bytes stay exactly as received. NULL: no edit (every row written before
-- this migration).
--
-- Nullable columns without a default: PostgreSQL only updates the catalog,
-- so this is safe on a live, large table (no rewrite, a brief lock).
-- BIGINT holds every `max_attempts` (uint32); `delay_on_retry` (uint64) is
-- kept as its two's-complement bit pattern, so values past 2^63 - 1 seconds
-- read back negative here and exact in the broker.
ALTER TABLE inflight_taskactivations
    ADD COLUMN IF NOT EXISTS retry_max_attempts   BIGINT NULL,
    ADD COLUMN IF NOT EXISTS retry_delay_on_retry BIGINT NULL;
