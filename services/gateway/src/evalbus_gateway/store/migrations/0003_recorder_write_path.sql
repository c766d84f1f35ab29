-- The recorder's write path at 10k events/s (issue 3).
--
-- events.body_sha256: sha256_hex of the canonical bytes of `body` (evalbus_gateway.store.chain),
-- computed by the recorder when it inserts a run's event, from the payload it sends. Sealing a run
-- chains these instead of reading and re-encoding its bodies. NULL for events of no run (never
-- chained), for rows stored before this migration and for the rare body whose stored form the
-- recorder does not predict: a seal computes those from `body::text`. `evalbus verify` never reads
-- this column; it recomputes every digest from `body`.
ALTER TABLE events ADD COLUMN body_sha256 text;

-- lz4 instead of pglz for new values of the large jsonb columns: most event bodies are over the
-- 2 kB compression threshold, and pglz costs about a quarter of an insert. A server built without
-- lz4 keeps pglz.
DO $$
BEGIN
    ALTER TABLE events ALTER COLUMN body SET COMPRESSION lz4;
    ALTER TABLE batches ALTER COLUMN spec SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'evalbus: this server has no lz4; jsonb values stay pglz-compressed';
END;
$$;
