-- A worker's RETRY edit of the retry state, kept beside the row and applied
-- to the activation upkeep publishes; `activation` stays as received. NULL:
-- no edit. Mirrors migrations/postgres (the same columns and encoding:
-- `delay_on_retry` as the two's-complement bit pattern of the uint64).
ALTER TABLE inflight_taskactivations ADD COLUMN retry_max_attempts INTEGER NULL;
ALTER TABLE inflight_taskactivations ADD COLUMN retry_delay_on_retry INTEGER NULL;
