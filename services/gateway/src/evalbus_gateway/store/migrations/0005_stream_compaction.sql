-- Stream compaction (issue 13's soak): a finalized batch's events leave the CASES stream once
-- every one of them is recorded here, `stream_keep_finalized_s` after its finalisation. The event
-- store keeps them for ever; nats-server keeps an entry in memory for every distinct subject of its
-- streams, and CASES' per-case subjects made that grow without bound (about 1.3 KB a case).
--
-- Operational state, not a read model: `evalbus replay` leaves it alone. A row says the stream
-- holds none of the batch's messages below `purged_below`; `messages` is how many were removed.
CREATE TABLE stream_compactions (
    batch_id     text        PRIMARY KEY,
    purged_below bigint      NOT NULL,
    messages     bigint      NOT NULL,
    compacted_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX batches_finalized_at ON batches (finalized_at) WHERE finalized_at IS NOT NULL;
