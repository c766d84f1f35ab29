-- The event store: every CASES event, append-only, plus the seals of settled runs and the
-- messages the recorder refused. None of these three tables is ever updated or deleted.

CREATE FUNCTION evalbus_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'evalbus: % on % is not allowed (append-only)', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TABLE events (
    stream_seq  bigint PRIMARY KEY,            -- sequence in the CASES stream
    subject     text        NOT NULL,
    type        text        NOT NULL,
    event_id    text        NOT NULL,
    batch_id    text,
    case_id     text,
    run_id      text,
    attempt     integer     NOT NULL DEFAULT 1,
    ts          timestamptz NOT NULL,          -- when the event was built
    body        jsonb       NOT NULL,
    dedupe_key  text        NOT NULL UNIQUE,   -- <type>:<run_id> or <type>:<batch_id>: first one wins
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX events_run_seq ON events (run_id, stream_seq) WHERE run_id IS NOT NULL;
CREATE INDEX events_batch_seq ON events (batch_id, stream_seq) WHERE batch_id IS NOT NULL;

CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION evalbus_append_only();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION evalbus_append_only();

-- A settled run's hash chain (see evalbus_gateway.store.chain). `seqs` and `hashes` keep every
-- link so verification can name the first event that no longer matches.
CREATE TABLE seals (
    run_id      text PRIMARY KEY,
    batch_id    text,
    head_hash   text        NOT NULL,
    event_count integer     NOT NULL,
    first_seq   bigint      NOT NULL,
    last_seq    bigint      NOT NULL,
    seqs        bigint[]    NOT NULL,
    hashes      text[]      NOT NULL,
    sealed_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX seals_batch ON seals (batch_id) WHERE batch_id IS NOT NULL;

CREATE TRIGGER seals_append_only BEFORE UPDATE OR DELETE ON seals
    FOR EACH ROW EXECUTE FUNCTION evalbus_append_only();
CREATE TRIGGER seals_no_truncate BEFORE TRUNCATE ON seals
    FOR EACH STATEMENT EXECUTE FUNCTION evalbus_append_only();

-- Messages the recorder refused: 'duplicate' (dedupe key already taken), 'sealed' (the run was
-- already sealed), 'invalid' (the body cannot be stored as jsonb).
CREATE TABLE rejections (
    stream_seq  bigint PRIMARY KEY,
    subject     text        NOT NULL,
    type        text        NOT NULL,
    event_id    text,
    batch_id    text,
    run_id      text,
    dedupe_key  text,
    reason      text        NOT NULL CHECK (reason IN ('duplicate', 'sealed', 'invalid')),
    detail      text,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX rejections_run ON rejections (run_id) WHERE run_id IS NOT NULL;

CREATE TRIGGER rejections_append_only BEFORE UPDATE OR DELETE ON rejections
    FOR EACH ROW EXECUTE FUNCTION evalbus_append_only();
CREATE TRIGGER rejections_no_truncate BEFORE TRUNCATE ON rejections
    FOR EACH STATEMENT EXECUTE FUNCTION evalbus_append_only();
