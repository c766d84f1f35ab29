"""What a team submits: a suite of cases, a harness, graders, judges, sinks and batch policy.

Specs carry secret *names* only; values are resolved where they are used and never published.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from evalbus_contracts import subjects
from evalbus_contracts.objects import DatasetIndex, ObjectRef

TraceKind = Literal["none", "otel", "mlflow", "langfuse", "langsmith", "phoenix"]
"""Where a harness exports its trace (`none`: only what it prints)."""
PlatformKind = Literal["otel", "mlflow", "langfuse", "langsmith", "phoenix"]
"""The trace platforms evalbus reads from and exports to."""
CollectMode = Literal["job", "control-plane"]
"""Who pulls the platform trace: the dispatcher after release, or the collector later."""
Correlate = Literal["id", "tag"]
"""How a trace is found: the platform trace id is the run id, or the run id is a tag on it."""

DEFAULT_LANE = subjects.DEFAULT_LANE
"""The lane of a harness that names none, and of every case requested before lanes existed."""
LANE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
"""A lane name: a subject token and a part of a consumer name (`dispatcher-cases-<lane>`)."""


def lane_problem(lane: str) -> str | None:
    """Why `lane` is not a lane name, or None when it is one."""
    if LANE_PATTERN.match(lane):
        return None
    return "a lane is 1 to 32 lowercase letters, digits, '-' or '_', starting with a letter or a digit"


class _Spec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False, omit_defaults=True):
    pass


# ---------------------------------------------------------------- graders


class _Grader(_Spec, frozen=True, kw_only=True, tag_field="kind"):
    id: str
    """Grader id, unique within the case; also the score's `grader_id`."""


class TestsPassGrader(_Grader, frozen=True, kw_only=True, tag="tests-pass"):
    """Ground truth: run a command in the sandbox; pass when it exits 0. Metric `tests_pass`."""

    __test__ = False
    command: str
    """Shell command run in the case's workdir."""
    timeout_s: float = 600.0
    """Seconds before the command is killed (a `grader_timeout`)."""


class CommandGrader(_Grader, frozen=True, kw_only=True, tag="command"):
    """Objective check in the sandbox: pass when stdout matches `pass_pattern`, else on `expect_exit`."""

    command: str
    """Shell command run in the case's workdir."""
    metric: str = "command"
    """Metric name of the score."""
    pass_pattern: str | None = None
    """Regex searched in stdout; when set it decides pass."""
    expect_exit: int = 0
    """Exit code that passes when no pattern is set."""
    timeout_s: float = 1800.0
    """Seconds before the command is killed."""


class ScriptScoreGrader(_Grader, frozen=True, kw_only=True, tag="script-score"):
    """Run a script in the sandbox that prints `SCORE=<number>`; pass at or above the threshold."""

    command: str
    """Shell command run in the case's workdir."""
    metric: str = "score"
    """Metric name of the score."""
    pass_threshold: float = 0.6
    """Minimum score that passes."""
    timeout_s: float = 600.0
    """Seconds before the command is killed."""


class AnswerMatchGrader(_Grader, frozen=True, kw_only=True, tag="answer-match"):
    """Objective: the final answer against the case's `expected`. Metric `answer_match`."""

    mode: Literal["exact", "contains", "normalized"] = "normalized"
    """`exact` string equality, `contains` substring, `normalized` case/space/punctuation-insensitive equality."""


class TextMetricGrader(_Grader, frozen=True, kw_only=True, tag="text-metric"):
    """Observation: a number captured by a regex from the final answer (group 1). No pass."""

    pattern: str
    """Regex with one capture group holding a number."""
    metric: str = "text"
    """Metric name of the score."""


class StepsGrader(_Grader, frozen=True, kw_only=True, tag="steps"):
    """Observation: the number of tool calls. Metric `tool_calls`; pass when at most `max_steps`."""

    max_steps: int | None = None
    """Optional budget; when set the score has pass/fail."""


class CostGrader(_Grader, frozen=True, kw_only=True, tag="cost"):
    """Observation: the sum of `llm_call` cost. Metric `cost_usd`. Never decides a verdict."""

    max_usd: float | None = None
    """Optional budget."""


class LatencyGrader(_Grader, frozen=True, kw_only=True, tag="latency"):
    """Observation: the span from first to last trace event, in seconds. Metric `latency_s`."""

    max_s: float | None = None
    """Optional budget."""


GraderSpec = (
    TestsPassGrader
    | CommandGrader
    | ScriptScoreGrader
    | AnswerMatchGrader
    | TextMetricGrader
    | StepsGrader
    | CostGrader
    | LatencyGrader
)
"""Any grader, discriminated on `kind`."""

COMPUTE_GRADER_KINDS: frozenset[str] = frozenset({"tests-pass", "command", "script-score"})
"""Grader kinds that run in the sandbox and must finish before it is released."""


def needs_compute(grader: GraderSpec) -> bool:
    """Whether a grader needs the sandbox (the partition rule shared by dispatcher and collector)."""
    return type(grader).__struct_config__.tag in COMPUTE_GRADER_KINDS


# ---------------------------------------------------------------- cases and suites


class CaseSpec(_Spec, frozen=True, kw_only=True):
    """One case of a dataset."""

    id: str
    """Case id, unique in the suite."""
    input: str
    """The task given to the harness (stdin and the file named by `EVALBUS_INPUT_FILE`)."""
    expected: str | None = None
    """The expected answer, for answer-match graders and rule judges."""
    graders: tuple[GraderSpec, ...] = ()
    """Graders in score order."""
    tags: tuple[str, ...] = ()
    """Free tags."""
    timeout_s: float | None = None
    """Per-case harness timeout; falls back to the harness's."""
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    """Opaque key/values passed through to results and sinks."""
    lane: str | None = None
    """The lane this case runs in when it is not the harness's (a GPU case in a CPU suite); only
    dispatchers serving that lane take it (docs/backends.md, "Lanes")."""


class SuiteSpec(_Spec, frozen=True, kw_only=True):
    """A dataset of cases."""

    id: str
    """Suite id."""
    version: str = "1"
    """Suite version."""
    description: str | None = None
    """Free text."""
    cases: tuple[CaseSpec, ...] = ()
    """The cases, inline (a small suite; empty when `dataset_ref` holds them)."""
    tags: tuple[str, ...] = ()
    """Free tags."""
    dataset_ref: ObjectRef | None = None
    """The cases as an uploaded JSONL object (`POST /v1/datasets`: one `CaseSpec` per line), for a
    suite too large to ride in an event; given instead of `cases`."""
    dataset_index: DatasetIndex | None = None
    """Set by the gateway when it has validated `dataset_ref`: the case count and objective metrics
    the services need without reading the object."""


def suite_case_count(suite: SuiteSpec) -> int:
    """Distinct case ids of a suite, inline or in its validated dataset."""
    if suite.dataset_index is not None:
        return suite.dataset_index.cases
    return len({case.id for case in suite.cases})


def trial_numbers(trials: int) -> list[int | None]:
    """The trial of each run of one case: 1..k when a batch asks for k > 1 trials, else one
    un-numbered run. The dispatcher fans out by it and every count of a batch's runs follows it."""
    return list(range(1, trials + 1)) if trials > 1 else [None]


def expected_runs(spec: BatchSpec) -> int:
    """How many runs a batch has: its distinct case ids (inline or in its dataset) × its trials.
    The one rule the dispatcher's fan-out and the gateway's finalisation, views and re-judges
    share: if they disagreed, batches would never finalize."""
    return suite_case_count(spec.suite) * len(trial_numbers(spec.policy.trials))


# ---------------------------------------------------------------- harness and trace


class TraceSpec(_Spec, frozen=True, kw_only=True):
    """Where the harness's trace lives and how evalbus collects it."""

    kind: TraceKind = "none"
    """Platform kind; `none` means the trace is what the harness prints."""
    endpoint: str | None = None
    """Platform base URL."""
    collect: CollectMode = "job"
    """`job`: pulled by the dispatcher after release; `control-plane`: pulled by the collector."""
    correlate: Correlate = "id"
    """How the trace is found from the run id."""
    auth_secret: str | None = None
    """Secret *name* for the platform's auth; never the value."""
    experiment: str | None = None
    """MLflow experiment id (scopes tag search)."""
    project: str | None = None
    """Phoenix / LangSmith / Langfuse project."""
    service: str | None = None
    """OpenTelemetry service name (Jaeger-style tag search needs it)."""
    mapping: dict[str, str] = msgspec.field(default_factory=dict)
    """Per-harness overrides of span attribute → trace event field."""


class ComputeSpec(_Spec, frozen=True, kw_only=True):
    """What a case's job asks a container backend (Docker, Kubernetes, Nomad) for; the local backend
    ignores it, except `network: none`, which it refuses."""

    image: str | None = None
    """Container image holding the harness and the in-job runner (`python -m evalbus.runner`);
    None: the dispatcher's default image (`DISPATCHER_IMAGE`)."""
    cpu: Annotated[float, msgspec.Meta(gt=0, le=1024)] = 1.0
    """CPU cores requested and limited."""
    memory_mb: Annotated[int, msgspec.Meta(ge=4, le=4 * 1024 * 1024)] = 1024
    """Memory requested and limited, MiB (past it the orchestrator kills the job: OOM)."""
    gpus: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    """GPUs requested (`nvidia.com/gpu` on Kubernetes, a `nvidia/gpu` device on Nomad)."""
    node_selector: dict[str, str] = msgspec.field(default_factory=dict)
    """Node labels (Kubernetes) or node metadata (Nomad constraints) the job must land on."""
    network: Literal["default", "none"] = "default"
    """`default`: the backend's network (the Docker template's, the cluster's); `none`: the case's
    unit has no network — Docker `NetworkMode: none`, a Nomad group network in mode `none`, a
    Kubernetes pod labelled `evalbus.dev/network: none` under a deny-all NetworkPolicy (enforced
    only by a CNI that enforces NetworkPolicy). The local backend refuses it (`config` error)."""


HarnessKind = Literal["command", "worker"]
"""How the agent runs: a process per case, or a warm worker process per compute slot."""


class HarnessSpec(_Spec, frozen=True, kw_only=True):
    """The agent: a command run once per case, or a warm worker serving cases over the worker
    protocol (docs/harness.md)."""

    kind: HarnessKind = "command"
    """`command`: one process group per case (input on stdin, `EVALBUS_EVENT`/`EVALBUS_RESULT`
    lines on stdout); `worker`: one long-lived process per compute slot, handed one case at a time
    over the JSON-lines worker protocol, each case in its own workdir with its own run id."""
    id: str
    """Harness id."""
    version: str = "1"
    """Harness version."""
    command: tuple[str, ...] = ()
    """argv of the agent (no shell); required for `command`, for `worker` the worker's argv
    (unless `python` is given)."""
    python: str | None = None
    """`worker` only: `module:function` (or `/path/to/file.py:function`) served by the Python SDK,
    run as `<the dispatcher's python> -m evalbus.harness <python>`; instead of `command`."""
    max_cases_per_worker: Annotated[int, msgspec.Meta(ge=0)] = 0
    """`worker` only: a worker is retired and replaced after this many cases (0: never)."""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """Extra environment (plain values only)."""
    secret_env: dict[str, str] = msgspec.field(default_factory=dict)
    """Environment variable → secret *name*, resolved by the dispatcher at start."""
    files: dict[str, str] = msgspec.field(default_factory=dict)
    """Relative path → content, written into the workdir before the run."""
    timeout_s: float = 600.0
    """Seconds a case may run: past it the process group is killed (exit 124) — for `worker`, the
    worker serving it, which is then replaced."""
    trace: TraceSpec = msgspec.field(default_factory=TraceSpec)
    """Trace platform and collection."""
    compute: ComputeSpec | None = None
    """Image, resources and node selection on a cluster backend (none: the backend's defaults).
    Optional rather than an empty struct so a spec that sets none encodes without it: a gateway of
    an older release, which does not know the key, still takes what a newer CLI sends."""

    lane: str = DEFAULT_LANE
    """Which dispatchers run its cases: only those serving this lane (`DISPATCHER_LANES`, e.g. `gpu`,
    `nomad-eu`, a laptop's own); a case whose lane no dispatcher serves waits, and its placement
    says so. Omitted when `default`, so an older gateway still takes the spec (docs/backends.md)."""

    def resources(self) -> ComputeSpec:
        """`compute`, or the defaults when none is set."""
        return self.compute if self.compute is not None else ComputeSpec()


CommandHarness = HarnessSpec
"""The harness spec under its first name (`kind` defaults to `command`)."""

_PYTHON_TARGET = re.compile(r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$")


def harness_problems(harness: HarnessSpec, at: str = "$.harness") -> list[tuple[str, str]]:
    """The rules a harness spec breaks, as (field path, message); empty when it is valid."""
    out: list[tuple[str, str]] = []
    lane = lane_problem(harness.lane)
    if lane is not None:
        out.append((f"{at}.lane", lane))
    has_command = bool(harness.command) and bool(harness.command[0].strip())
    if harness.kind == "command":
        if not has_command:
            out.append((f"{at}.command", "missing: a command harness needs its argv, at least the program"))
        if harness.python is not None:
            out.append((f"{at}.python", "only a worker harness (kind: worker) serves a Python function"))
        if harness.max_cases_per_worker:
            out.append((f"{at}.max_cases_per_worker", "only a worker harness (kind: worker) has workers to recycle"))
    elif harness.python is not None:
        if harness.command:
            out.append((f"{at}.command", "a worker harness takes either command or python, not both"))
        if not _PYTHON_TARGET.match(harness.python):
            out.append((f"{at}.python", "must be module:function (or /path/to/file.py:function)"))
    elif not has_command:
        out.append((f"{at}.command", "missing: a worker harness needs command (the worker's argv) or python"))
    return out


# ---------------------------------------------------------------- judges


class _Judge(_Spec, frozen=True, kw_only=True, tag_field="kind"):
    id: str
    """Judge id (no `:`); its metric is `judge:<id>`."""


class ExactJudge(_Judge, frozen=True, kw_only=True, tag="exact"):
    """Rule: the answer equals `expected`."""

    case_sensitive: bool = False
    """Compare case-sensitively."""
    strip: bool = True
    """Strip surrounding whitespace first."""


class ContainsJudge(_Judge, frozen=True, kw_only=True, tag="contains"):
    """Rule: the answer contains `expected`."""

    case_sensitive: bool = False
    """Compare case-sensitively."""


class RegexJudge(_Judge, frozen=True, kw_only=True, tag="regex"):
    """Rule: the answer matches a pattern (`expected` when no pattern is given)."""

    pattern: str | None = None
    """Regex searched in the answer."""


class JsonSchemaJudge(_Judge, frozen=True, kw_only=True, tag="json-schema"):
    """Rule: the answer is JSON valid against a schema."""

    json_schema: dict[str, Any] = msgspec.field(name="schema")
    """JSON Schema (the subset: type, properties, required, items, enum, const, minimum, maximum)."""


class NumericJudge(_Judge, frozen=True, kw_only=True, tag="numeric"):
    """Rule: the first number in the answer is within tolerance of `expected`."""

    tolerance: float = 1e-6
    """Allowed absolute difference (relative when `relative`)."""
    relative: bool = False
    """Tolerance is relative to |expected|."""


class ModelPrice(_Spec, frozen=True, kw_only=True):
    """A model's list price in US dollars per million tokens."""

    input_per_mtok: Annotated[float, msgspec.Meta(ge=0.0)]
    """Dollars per million prompt tokens."""
    output_per_mtok: Annotated[float, msgspec.Meta(ge=0.0)]
    """Dollars per million completion tokens."""


class ModelJudge(_Judge, frozen=True, kw_only=True, tag="model"):
    """An LLM judge over the OpenAI-compatible chat-completions API, scoring a rubric 0..1."""

    base_url: str | None = None
    """API base URL (…/v1); unset means the judge service's default endpoint, if any."""
    model: str = "gpt-4o-mini"
    """Model name."""
    api_key_secret: str | None = None
    """Secret *name* holding the API key."""
    rubric: str
    """What to judge."""
    pass_threshold: float = 0.5
    """Score at or above which the case passes, when the model gives no pass."""
    timeout_s: float = 60.0
    """Per-request timeout."""
    max_retries: int = 3
    """Retries on 429/5xx (honouring Retry-After, bounded)."""
    price: ModelPrice | None = None
    """What the model costs, to account the judge's spend (None: the provider's reported cost,
    else tokens only with the cost unmeasured)."""


class EmbeddingJudge(_Judge, frozen=True, kw_only=True, tag="embedding"):
    """Cosine similarity between answer and `expected` embeddings: from an OpenAI-compatible
    `/embeddings` endpoint, else a local sentence-transformers model when one is importable."""

    threshold: float = 0.8
    """Similarity at or above which the case passes."""
    base_url: str | None = None
    """Embeddings API base URL (…/v1); unset means the judge service's default endpoint, if any,
    else a local model."""
    model: str = "text-embedding-3-small"
    """Embedding model name (for an endpoint)."""
    api_key_secret: str | None = None
    """Secret *name* holding the endpoint's API key."""
    timeout_s: float = 30.0
    """Per-request timeout."""
    price: ModelPrice | None = None
    """What the model costs per million input tokens (`output_per_mtok` unused), to account the spend."""


class RegisteredJudge(_Judge, frozen=True, kw_only=True, tag="registered"):
    """A judge the judge service may have registered under a name; unknown names are `unsupported`."""

    name: str
    """Registry name."""
    params: dict[str, str] = msgspec.field(default_factory=dict)
    """Parameters for the registered judge."""


JudgeSpec = (
    ExactJudge
    | ContainsJudge
    | RegexJudge
    | JsonSchemaJudge
    | NumericJudge
    | ModelJudge
    | EmbeddingJudge
    | RegisteredJudge
)
"""Any judge, discriminated on `kind`."""


# ---------------------------------------------------------------- sinks


class JsonlSink(_Spec, frozen=True, kw_only=True, tag_field="kind", tag="jsonl"):
    """One JSON line per case in a file (idempotent on redelivery)."""

    path: str
    """File path on the exporter's machine; `{batch}` is replaced by the batch id."""


class PlatformSink(_Spec, frozen=True, kw_only=True, tag_field="kind", tag="platform"):
    """Export judged cases to a trace platform."""

    platform: PlatformKind
    """Which platform."""
    endpoint: str
    """Base URL."""
    auth_secret: str | None = None
    """Secret *name* for the platform's auth."""
    experiment: str | None = None
    """MLflow experiment name or id."""
    project: str | None = None
    """Project (Phoenix, LangSmith, Langfuse)."""


SinkSpec = JsonlSink | PlatformSink
"""Any sink, discriminated on `kind`."""


# ---------------------------------------------------------------- batch


class BatchPolicy(_Spec, frozen=True, kw_only=True):
    """How a batch runs."""

    concurrency: int = 0
    """Reserved for a per-batch sandbox limit across replicas; only 0 (bounded by the dispatchers'
    compute slots) is accepted today."""
    trials: int = 1
    """Runs per case (pass@k when > 1)."""
    retries: int = 1
    """Retries of retryable infrastructure failures per run."""


class RegressionGate(_Spec, frozen=True, kw_only=True):
    """A CI gate against a baseline batch: it fails when any named metric (or `verdicts`)
    regresses significantly — its Benjamini–Hochberg q-value in the comparison is below 0.05 and
    its delta goes the wrong way."""

    no_significant_regression: tuple[str, ...]
    """Metric names (or `verdicts`) that must not regress significantly."""
    baseline: str | None = None
    """The batch to compare against; default: the suite's baseline (`evalbus baseline set`)."""


GateSpec = str | RegressionGate
"""A CI gate: a threshold expression (`verdicts.pass_rate >= 0.8`, `metric.cost_usd.mean <= 0.05`,
`metric.answer_match.pass_rate.ci_low > 0.6`, `pass@3 >= 0.9`…) or a regression gate (also
written `no_significant_regression: answer_match, verdicts`)."""


class BatchSpec(_Spec, frozen=True, kw_only=True):
    """A batch as submitted to the gateway."""

    suite: SuiteSpec
    """The dataset."""
    harness: HarnessSpec
    """The agent."""
    judges: tuple[JudgeSpec, ...] = ()
    """Judges in selection order."""
    sinks: tuple[SinkSpec, ...] = ()
    """Export sinks."""
    policy: BatchPolicy = msgspec.field(default_factory=BatchPolicy)
    """Concurrency, trials, retries."""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    """Free labels."""
    supersede_key: str | None = None
    """Submitting another batch with this key supersedes open batches with the same key."""
    gates: tuple[GateSpec, ...] = ()
    """CI gates `evalbus run` checks once the batch has finalized, each printed pass/fail with what
    it measured; any failing gate makes it exit 3."""


# ---------------------------------------------------------------- online evaluation


class OnlineTarget(_Spec, frozen=True, kw_only=True):
    """Which production observations an online suite takes: every named field must match (an
    unnamed one matches anything), and every attribute must equal the observation's."""

    service: str | None = None
    """`service.name` of the application (the OTLP resource attribute)."""
    agent: str | None = None
    """Agent name (`gen_ai.agent.name`, OpenInference `agent.name`)."""
    workflow: str | None = None
    """Workflow name (`workflow.name`, `gen_ai.workflow.name`)."""
    attributes: dict[str, str] = msgspec.field(default_factory=dict)
    """Resource or root-span attributes that must equal these values (e.g.
    `deployment.environment: prod`)."""


class OnlineSuiteSpec(_Spec, frozen=True, kw_only=True):
    """An online suite: judge a deterministic sample of one target's production traces with the
    same judges batches use."""

    id: str
    """Suite id (unique; applying the same id again replaces the suite)."""
    target: OnlineTarget
    """The observations it takes."""
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    """Fraction of matching traces judged, decided by trace id exactly as OpenTelemetry's
    `TraceIdRatioBased` sampler decides (so an application tracing at ratio r ≥ this one traces
    every trace evalbus samples)."""
    judges: tuple[JudgeSpec, ...] = ()
    """Judges applied to each sampled observation, in order (the kinds of batches)."""
    description: str | None = None
    """Free text."""
    rate_per_min: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """At most this many observations sampled per UTC clock minute, counted across every collector
    replica; the others get the fate `skipped`, reason `over_rate_cap` (None: no cap)."""
    delay_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0
    """Decide (and judge) an observation only this long after it was received: time for late
    feedback or late spans (0: at once)."""
    budget_usd_per_day: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    """At most this many US dollars of model-judge calls per UTC day, counted across every judge
    replica; once it is spent the suite's model judges are not called (the observation's fate is
    `skipped`, reason `over_budget`) while its other judges still run (None: no budget)."""
