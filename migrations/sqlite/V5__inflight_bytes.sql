-- Bytes of the activations the table holds, per topic; mirrors
-- migrations/postgres. SQLite has only row triggers; the single writer
-- means no counter row is ever contended.
CREATE TABLE IF NOT EXISTS taskbroker_inflight_bytes (
    topic TEXT    NOT NULL PRIMARY KEY,
    bytes INTEGER NOT NULL
);

CREATE TRIGGER IF NOT EXISTS taskbroker_inserted_bytes
AFTER INSERT ON inflight_taskactivations
BEGIN
    INSERT INTO taskbroker_inflight_bytes (topic, bytes)
    VALUES (NEW.topic, length(NEW.activation))
    ON CONFLICT (topic) DO UPDATE SET bytes = bytes + excluded.bytes;
END;

CREATE TRIGGER IF NOT EXISTS taskbroker_deleted_bytes
AFTER DELETE ON inflight_taskactivations
BEGIN
    UPDATE taskbroker_inflight_bytes SET bytes = bytes - length(OLD.activation)
     WHERE topic = OLD.topic;
END;

INSERT OR REPLACE INTO taskbroker_inflight_bytes (topic, bytes)
SELECT topic, sum(length(activation)) FROM inflight_taskactivations GROUP BY topic;
