-- Read models: projections of the events table, rebuilt at will by rebuild_read_models().
-- Every value here comes from an event (timestamps included), so a rebuild reproduces them.

CREATE TABLE batches (
    batch_id        text PRIMARY KEY,
    status          text    NOT NULL DEFAULT 'queued'
                    CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'superseded')),
    suite_id        text,
    submitted_by    text,
    supersede_key   text,
    spec            jsonb,
    trials          integer,
    total_runs      integer,                   -- distinct cases x trials
    requested_count integer NOT NULL DEFAULT 0,
    executed_count  integer NOT NULL DEFAULT 0,
    collected_count integer NOT NULL DEFAULT 0,
    judged_count    integer NOT NULL DEFAULT 0,
    exported_count  integer NOT NULL DEFAULT 0,
    failed_count    integer NOT NULL DEFAULT 0,
    cancelled_count integer NOT NULL DEFAULT 0,
    judge_errors    integer NOT NULL DEFAULT 0,
    summary         jsonb,
    export          jsonb,
    error           jsonb,
    created_at      timestamptz,               -- batch.requested ts
    finalized_at    timestamptz,               -- batch.finalized ts
    cancel_reason   text CHECK (cancel_reason IN ('cancelled', 'superseded')),
    cancelled_by    text,
    superseded_by   text
);
CREATE INDEX batches_open_supersede ON batches (supersede_key)
    WHERE supersede_key IS NOT NULL AND finalized_at IS NULL;
CREATE INDEX batches_created ON batches (created_at DESC);

CREATE TABLE runs (
    run_id           text PRIMARY KEY,
    batch_id         text,
    case_id          text    NOT NULL,
    trial            integer,
    attempt          integer NOT NULL DEFAULT 1,
    harness          text,
    requested_status text,                     -- 'requested'
    requested_at     timestamptz,
    executed_status  text CHECK (executed_status IN ('succeeded', 'failed', 'cancelled')),
    executed_at      timestamptz,
    collected_status text,                     -- 'collected'
    collected_at     timestamptz,
    judged_status    text CHECK (judged_status IN ('judged', 'skipped')),
    judged_at        timestamptz,
    judge_error      text,
    exported_status  text CHECK (exported_status IN ('exported', 'partial', 'failed', 'skipped')),
    exported_at      timestamptz,
    export_outcomes  jsonb,
    result_rank      smallint NOT NULL DEFAULT 0,  -- stage whose result is shown: 1 executed, 2 collected, 3 judged
    failure          jsonb,
    scores           jsonb,
    answer           text,
    verdict          text CHECK (verdict IN ('pass', 'fail')),
    verdict_rung     text,
    sandbox_seconds  double precision,
    sealed           boolean NOT NULL DEFAULT false,
    stage            text GENERATED ALWAYS AS (
        CASE
            WHEN exported_status IS NOT NULL THEN 'exported'
            WHEN judged_status IS NOT NULL THEN 'judged'
            WHEN collected_status IS NOT NULL THEN 'collected'
            WHEN executed_status IS NOT NULL THEN 'executed'
            ELSE 'requested'
        END
    ) STORED
);
CREATE INDEX runs_batch ON runs (batch_id, run_id);
CREATE INDEX runs_batch_stage ON runs (batch_id, stage, run_id);
