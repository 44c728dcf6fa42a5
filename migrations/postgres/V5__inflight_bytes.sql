-- Bytes of the activations the table holds, per topic (issue 32): the
-- consumer pauses on them (MAX_INFLIGHT_BYTES) and /metrics shows them
-- (taskbroker_inflight_bytes). Statement-level triggers keep the sums with
-- every insert and delete, whichever code path runs it, so reading the bound
-- is a read of a few rows here instead of a sum over the table.
--
-- Each topic's sum is spread over 16 slots, chosen by the writing backend,
-- so that concurrent transactions (brokers storing and completing at once)
-- seldom wait on the same counter row; a reader adds the slots up. Rows
-- are upserted in topic order, so two statements never take the same pair
-- of counter rows in opposite orders.
--
-- octet_length() of a stored (TOASTed) bytea reads its size from the
-- pointer; it does not fetch the value.
CREATE TABLE IF NOT EXISTS taskbroker_inflight_bytes (
    topic TEXT     NOT NULL,
    slot  SMALLINT NOT NULL,
    bytes BIGINT   NOT NULL,
    PRIMARY KEY (topic, slot)
);

CREATE OR REPLACE FUNCTION taskbroker_count_inserted_bytes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO taskbroker_inflight_bytes AS b (topic, slot, bytes)
    SELECT topic, (pg_backend_pid() % 16)::int2, sum(octet_length(activation))::int8
      FROM inserted GROUP BY topic ORDER BY topic
    ON CONFLICT (topic, slot) DO UPDATE SET bytes = b.bytes + EXCLUDED.bytes;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION taskbroker_count_deleted_bytes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO taskbroker_inflight_bytes AS b (topic, slot, bytes)
    SELECT topic, (pg_backend_pid() % 16)::int2, -sum(octet_length(activation))::int8
      FROM deleted GROUP BY topic ORDER BY topic
    ON CONFLICT (topic, slot) DO UPDATE SET bytes = b.bytes + EXCLUDED.bytes;
    RETURN NULL;
END
$$;

-- CREATE TRIGGER locks the table against writes until this migration
-- commits, so the starting sums below match the rows exactly even while
-- brokers of the previous version keep writing.
DROP TRIGGER IF EXISTS taskbroker_inserted_bytes ON inflight_taskactivations;
CREATE TRIGGER taskbroker_inserted_bytes
    AFTER INSERT ON inflight_taskactivations
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION taskbroker_count_inserted_bytes();
DROP TRIGGER IF EXISTS taskbroker_deleted_bytes ON inflight_taskactivations;
CREATE TRIGGER taskbroker_deleted_bytes
    AFTER DELETE ON inflight_taskactivations
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION taskbroker_count_deleted_bytes();

DELETE FROM taskbroker_inflight_bytes;
INSERT INTO taskbroker_inflight_bytes (topic, slot, bytes)
SELECT topic, 0, sum(octet_length(activation))::int8
  FROM inflight_taskactivations GROUP BY topic;
