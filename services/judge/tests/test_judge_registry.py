"""Judge resolution: built-in kinds, custom registrations, unsupported placeholders, the batch cache."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from evalbus_contracts import (
    CaseResult,
    EmbeddingJudge,
    ExactJudge,
    JudgeSpec,
    Measured,
    ModelJudge,
    RegisteredJudge,
    Score,
    Unmeasured,
)
from evalbus_judge import (
    ChatClient,
    EmbeddingSimilarity,
    ExactRule,
    Judge,
    JudgeContext,
    JudgeRegistry,
    ModelDefaults,
    UnavailableJudge,
    local_embedder,
)
from evalbus_judge.context import verdict
from evalbus_runtime.secrets import SecretStore

pytestmark = pytest.mark.unit


def ctx(answer: str = "Paris", expected: str | None = "Paris", run_id: str = "evb-b1-c1") -> JudgeContext:
    result = CaseResult(case_id="c1", run_id=run_id, harness="h@1", answer=answer)
    return JudgeContext.of(result, case_input="task", expected=expected)


class LengthJudge:
    """A custom judge: passes when the answer is at most `max` characters."""

    def __init__(self, spec: RegisteredJudge) -> None:
        self.judge_id = spec.id
        self.limit = int(spec.params.get("max", "10"))

    async def judge(self, ctx: JudgeContext) -> Score:
        answer = ctx.answer or ""
        return verdict(self.judge_id, len(answer) <= self.limit, f"{len(answer)} characters")


class TrigramEmbedder:
    """A deterministic embedder for exercising the embedding judge's arithmetic (the real one is
    sentence-transformers, which is not installed here)."""

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        vocabulary = sorted({t[i : i + 3] for t in texts for i in range(len(t) - 2)})
        return [[float(t.count(g)) for g in vocabulary] for t in texts]


async def test_unregistered_name_is_unsupported_for_every_case() -> None:
    registry = JudgeRegistry()
    resolved = registry.resolve([RegisteredJudge(id="tone", name="tone-v2")], batch_id="b1")
    (entry,) = resolved.judges
    assert not entry.resolved
    assert resolved.unresolved == (entry,)
    for run_id in ("evb-b1-c1", "evb-b1-c2"):
        score = await entry.judge.judge(ctx(run_id=run_id))
        assert score == Unmeasured(
            grader_id="tone",
            metric="judge:tone",
            source="judge",
            reason="unsupported",
            retryable=False,
            detail="no judge is registered as 'tone-v2'",
        )


async def test_custom_judge_by_name() -> None:
    registry = JudgeRegistry()
    registry.register("length", LengthJudge)
    assert registry.names == ("length",)
    (entry,) = registry.resolve([RegisteredJudge(id="short", name="length", params={"max": "5"})]).judges
    assert entry.resolved
    assert entry.kind == "registered"
    passed = await entry.judge.judge(ctx(answer="Paris"))
    failed = await entry.judge.judge(ctx(answer="Paris, France"))
    assert isinstance(passed, Measured)
    assert isinstance(failed, Measured)
    assert (passed.passed, failed.passed) == (True, False)


def test_register_twice_needs_replace() -> None:
    registry = JudgeRegistry()
    registry.register("length", LengthJudge)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("length", LengthJudge)
    registry.register("length", LengthJudge, replace=True)
    with pytest.raises(ValueError, match="empty"):
        registry.register("", LengthJudge)


async def test_factory_that_raises_is_an_unmeasured_judge_not_a_crash() -> None:
    def broken(spec: RegisteredJudge) -> Judge:
        raise RuntimeError("model file not found")

    registry = JudgeRegistry()
    registry.register("broken", broken)
    (entry,) = registry.resolve([RegisteredJudge(id="x", name="broken")]).judges
    score = await entry.judge.judge(ctx())
    assert isinstance(score, Unmeasured)
    assert score.reason == "grader_error"
    assert "model file not found" in (score.detail or "")


def test_builtin_kinds_resolve_to_their_rules() -> None:
    resolved = JudgeRegistry().resolve([ExactJudge(id="e")])
    assert isinstance(resolved.judges[0].judge, ExactRule)


async def test_embedding_is_unsupported_without_a_local_model() -> None:
    assert local_embedder() is None, "sentence_transformers is not a dependency of evalbus"
    (entry,) = JudgeRegistry(embedder=local_embedder()).resolve([EmbeddingJudge(id="sim")]).judges
    assert isinstance(entry.judge, UnavailableJudge)
    score = await entry.judge.judge(ctx())
    assert isinstance(score, Unmeasured)
    assert (score.reason, score.metric, score.retryable) == ("unsupported", "judge:sim", False)


async def test_embedding_judge_with_an_embedder() -> None:
    (entry,) = JudgeRegistry(embedder=TrigramEmbedder()).resolve([EmbeddingJudge(id="sim", threshold=0.5)]).judges
    assert isinstance(entry.judge, EmbeddingSimilarity)
    same = await entry.judge.judge(ctx(answer="the capital is Paris", expected="the capital is Paris"))
    close = await entry.judge.judge(ctx(answer="the capital is Paris!", expected="The capital is Paris"))
    far = await entry.judge.judge(ctx(answer="zzzz qqqq", expected="the capital is Paris"))
    empty = await entry.judge.judge(ctx(answer="", expected="Paris"))
    missing = await entry.judge.judge(ctx(answer="Paris", expected=None))
    assert isinstance(same, Measured)
    assert isinstance(close, Measured)
    assert isinstance(far, Measured)
    assert same.value == pytest.approx(1.0)
    assert same.passed is True
    assert close.passed is True
    assert 0.5 < close.value < 1.0
    assert (far.value, far.passed) == (0.0, False)
    assert isinstance(empty, Measured)
    assert empty.passed is False
    assert isinstance(missing, Unmeasured)
    assert missing.reason == "missing_evidence"


def model_spec(base_url: str | None = None, api_key_secret: str | None = None) -> ModelJudge:
    return ModelJudge(id="m", rubric="be right", base_url=base_url, api_key_secret=api_key_secret)


@pytest.mark.parametrize(
    ("registry", "judge_spec", "reason"),
    [
        (JudgeRegistry(chat=ChatClient()), model_spec(), "unsupported"),  # no base URL anywhere
        (JudgeRegistry(), model_spec(base_url="http://127.0.0.1:9/v1"), "unsupported"),  # no client
        (
            JudgeRegistry(
                chat=ChatClient(),
                secrets=SecretStore(environ={}),
                model_defaults=ModelDefaults(allowed_base_urls=("http://127.0.0.1:9/v1",)),
            ),
            model_spec(base_url="http://127.0.0.1:9/v1", api_key_secret="openai"),
            "missing_secret",
        ),
        (  # a secret never goes to a URL the batch chose unless the service allows that URL
            JudgeRegistry(chat=ChatClient(), secrets=SecretStore(environ={"EVALBUS_SECRET_OPENAI": "sk-x"})),
            model_spec(base_url="http://attacker.invalid/v1", api_key_secret="openai"),
            "policy_skip",
        ),
        (
            JudgeRegistry(
                chat=ChatClient(),
                secrets=SecretStore(environ={}),
                model_defaults=ModelDefaults(base_url="http://127.0.0.1:9/v1", api_key_secret="openai"),
            ),
            model_spec(),
            "missing_secret",
        ),
    ],
)
async def test_model_judge_that_cannot_run(registry: JudgeRegistry, judge_spec: ModelJudge, reason: str) -> None:
    (entry,) = registry.resolve([judge_spec]).judges
    assert not entry.resolved
    score = await entry.judge.judge(ctx())
    assert isinstance(score, Unmeasured)
    assert score.reason == reason


def test_resolution_is_cached_per_batch() -> None:
    built: list[str] = []

    def counting(spec: RegisteredJudge) -> Judge:
        built.append(spec.id)
        return LengthJudge(spec)

    registry = JudgeRegistry(cache_size=2)
    registry.register("length", counting)
    specs: list[JudgeSpec] = [RegisteredJudge(id="a", name="length")]
    first = registry.resolve(specs, batch_id="b1")
    assert registry.resolve(specs, batch_id="b1") is first
    assert built == ["a"]
    registry.resolve(specs, batch_id="b2")
    registry.resolve(specs, batch_id="b3")  # evicts b1 (least recently used)
    assert registry.resolve(specs, batch_id="b3") is not first
    assert len(built) == 3
    registry.resolve(specs, batch_id="b1")
    assert len(built) == 4
    registry.resolve([RegisteredJudge(id="other", name="length")], batch_id="b1")  # another plan, same id
    assert len(built) == 5
    registry.resolve(specs)  # no batch id: never cached
    registry.resolve(specs)
    assert len(built) == 7
    registry.register("length", counting, replace=True)  # new registrations invalidate the cache
    registry.resolve(specs, batch_id="b1")
    assert len(built) == 8
