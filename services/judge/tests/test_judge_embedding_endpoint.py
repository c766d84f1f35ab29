"""The embedding judge against an OpenAI-compatible `/embeddings` endpoint: the local server of
`evalbus.testing.chat_server` (each text's vector is its letter counts), so the expected similarity
is computed here from the texts; the key goes only in the header; usage is accounted; a broken
answer is `invalid`, an outage `unmeasured`, and without an endpoint or a local model the judge is
`unsupported`."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest

from evalbus.testing.chat_server import ChatCompletionsServer, Reply, error_body
from evalbus_contracts import CaseResult, EmbeddingJudge, Invalid, JudgeUsage, Measured, ModelPrice, Unmeasured
from evalbus_judge import ChatClient, JudgeContext, JudgeRegistry, ModelDefaults, RetryPolicy
from evalbus_judge.embedding import EndpointEmbeddingSimilarity
from evalbus_runtime.secrets import SecretStore

pytestmark = pytest.mark.integration

API_KEY = "sk-embed-test-51c0"
SECRETS = SecretStore(environ={"EVALBUS_SECRET_EMBED_KEY": API_KEY})


@pytest.fixture
async def server() -> AsyncIterator[ChatCompletionsServer]:
    srv = ChatCompletionsServer(api_key=API_KEY)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def chat() -> AsyncIterator[ChatClient]:
    client = ChatClient(RetryPolicy(base_delay_s=0.01, max_delay_s=0.02, max_total_wait_s=1.0))
    await client.start()
    yield client
    await client.close()


def letters(text: str) -> list[float]:
    return [float(text.lower().count(c)) for c in "abcdefghijklmnopqrstuvwxyz"]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (math.hypot(*a) * math.hypot(*b))


def ctx(answer: str, expected: str | None) -> JudgeContext:
    result = CaseResult(case_id="c", run_id="evb-b-c", harness="h@1", answer=answer)
    return JudgeContext.of(result, case_input="q", expected=expected)


def resolve(chat: ChatClient, spec: EmbeddingJudge, defaults: ModelDefaults | None = None) -> object:
    registry = JudgeRegistry(
        chat=chat, model_defaults=defaults or ModelDefaults(allowed_base_urls=("*",)), secrets=SECRETS
    )
    [entry] = registry.resolve([spec]).judges
    return entry.judge


async def test_similarity_from_the_endpoint_with_its_usage(server: ChatCompletionsServer, chat: ChatClient) -> None:
    spec = EmbeddingJudge(
        id="sim",
        base_url=f"{server.root}/v1",
        model="embed-test",
        api_key_secret="embed-key",
        threshold=0.9,
        price=ModelPrice(input_per_mtok=20.0, output_per_mtok=0.0),
    )
    judge = resolve(chat, spec)
    assert isinstance(judge, EndpointEmbeddingSimilarity)
    close = await judge.judge(ctx("The capital is Paris", "Paris is the capital"))
    assert isinstance(close, Measured)
    assert close.value == pytest.approx(cosine(letters("The capital is Paris"), letters("Paris is the capital")))
    assert close.passed is True
    # 4 + 4 words: one prompt token each at $20 per million
    assert close.usage == JudgeUsage(model="embed-test", input_tokens=8, cost_usd=8 * 20 / 1e6, cost_source="price")
    far = await judge.judge(ctx("zzz", "Paris"))
    assert isinstance(far, Measured)
    assert far.passed is False
    assert far.value == pytest.approx(0.0)
    request = server.requests[0]
    assert request.path == "/v1/embeddings"
    assert request.headers["Authorization"] == f"Bearer {API_KEY}"
    assert request.body == {"model": "embed-test", "input": ["The capital is Paris", "Paris is the capital"]}
    assert server.protocol_errors == []
    # nothing to compare with: no call at all
    missing = await judge.judge(ctx("Paris", None))
    assert isinstance(missing, Unmeasured)
    assert missing.reason == "missing_evidence"
    assert len(server.requests) == 2


async def test_a_broken_answer_is_invalid_and_an_outage_unmeasured(
    server: ChatCompletionsServer, chat: ChatClient
) -> None:
    spec = EmbeddingJudge(id="sim", base_url=f"{server.root}/v1", api_key_secret="embed-key")
    judge = resolve(chat, spec)
    assert isinstance(judge, EndpointEmbeddingSimilarity)
    server.outage = Reply(body={"object": "list", "data": [{"index": 0, "embedding": [1.0]}]})
    broken = await judge.judge(ctx("a", "b"))
    assert isinstance(broken, Invalid)
    assert "2 embeddings" in (broken.detail or "")
    server.outage = Reply(status=500, body=error_body("down", "server_error"))
    down = await judge.judge(ctx("a", "b"))
    assert isinstance(down, Unmeasured)
    assert (down.reason, down.retryable) == ("grader_error", True)
    assert API_KEY not in (down.detail or "")


async def test_without_an_endpoint_or_a_local_model_it_is_unsupported(chat: ChatClient) -> None:
    judge = resolve(chat, EmbeddingJudge(id="sim"), ModelDefaults())
    score = await judge.judge(ctx("a", "b"))  # type: ignore[attr-defined]
    assert isinstance(score, Unmeasured)
    assert score.reason == "unsupported"
    # the service's default endpoint serves embedding judges that name none
    served = resolve(chat, EmbeddingJudge(id="sim"), ModelDefaults(base_url="http://127.0.0.1:9/v1"))
    assert isinstance(served, EndpointEmbeddingSimilarity)
