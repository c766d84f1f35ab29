"""The embedding judge: cosine similarity between the answer and `expected`, passing at or above
the spec's threshold, with the vectors from

- an OpenAI-compatible `POST {base_url}/embeddings` (`EndpointEmbeddingSimilarity`: the spec's
  `base_url`, else — when no local model is importable — the service's default endpoint), over the
  shared chat client (its retries, `Retry-After` and the provider's adaptive limit), its usage
  accounted like a model judge's; or
- a local sentence-transformers model where `sentence_transformers` is importable (it is not a
  dependency of evalbus): `local_embedder()` returns None otherwise. The model is loaded lazily,
  once, and encoding runs in a worker thread so the event loop keeps serving other cases.

With neither the registry resolves `embedding` judges as `unsupported`.
"""

from __future__ import annotations

import asyncio
import importlib
import math
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from evalbus_contracts import EmbeddingJudge, JudgeUsage, Score
from evalbus_judge.chat import ChatClient, ChatFailure, redact
from evalbus_judge.context import JudgeContext, invalid, measured, unmeasured
from evalbus_judge.model import failure_score
from evalbus_runtime.secrets import SecretStore

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
"""Embedding model used when the service configures none."""


class Embedder(Protocol):
    """Turns texts into vectors."""

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text, in order."""
        ...


class SentenceTransformerEmbedder:
    """An `Embedder` over a local sentence-transformers model, loaded on first use."""

    def __init__(self, module: Any, model_name: str = DEFAULT_MODEL) -> None:
        self._module = module
        self.model_name = model_name
        self._model: Any = None
        self._lock = asyncio.Lock()

    async def _loaded(self) -> Any:
        async with self._lock:
            if self._model is None:
                self._model = await asyncio.to_thread(self._module.SentenceTransformer, self.model_name)
            return self._model

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Encode `texts` in a worker thread."""
        model = await self._loaded()
        vectors = await asyncio.to_thread(model.encode, list(texts))
        return [[float(x) for x in v] for v in vectors]


def local_embedder(model_name: str = DEFAULT_MODEL) -> Embedder | None:
    """The local embedder when `sentence_transformers` can be imported, else None."""
    try:
        module = importlib.import_module("sentence_transformers")
    except ImportError:
        return None
    return SentenceTransformerEmbedder(module, model_name)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors; 0.0 when either is zero or they differ in length."""
    if len(a) != len(b):
        return 0.0
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    if norm == 0.0:
        return 0.0
    return max(-1.0, min(1.0, sum(x * y for x, y in zip(a, b, strict=True)) / norm))


class EmbeddingSimilarity:
    """An `embedding` judge: value = cosine(answer, expected), pass when ≥ threshold."""

    def __init__(self, spec: EmbeddingJudge, embedder: Embedder) -> None:
        self.spec = spec
        self.embedder = embedder

    async def judge(self, ctx: JudgeContext) -> Score:
        """Embed the answer and the expected value and compare them."""
        judge_id = self.spec.id
        if ctx.expected is None or not ctx.expected.strip():
            return unmeasured(judge_id, "missing_evidence", "the case has no expected value")
        if not ctx.answer or not ctx.answer.strip():
            return measured(judge_id, 0.0, passed=False, detail="no answer")
        vectors = await self.embedder.embed([ctx.answer, ctx.expected])
        if len(vectors) != 2:
            return unmeasured(judge_id, "grader_error", f"embedder returned {len(vectors)} vectors for 2 texts")
        similarity = cosine(vectors[0], vectors[1])
        passed = similarity >= self.spec.threshold
        relation = "≥" if passed else "<"
        return measured(
            judge_id,
            similarity,
            passed=passed,
            detail=f"cosine similarity {similarity:.4f} {relation} threshold {self.spec.threshold:g}",
        )


def read_vectors(body: Any, count: int) -> list[list[float]] | str:
    """The vectors of an embeddings response in input order, or why it breaks the contract."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != count:
        return f"response has no data list of {count} embeddings"
    vectors: list[list[float] | None] = [None] * count
    for position, item in enumerate(data):
        index = item.get("index", position) if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(index, int) or not 0 <= index < count or not isinstance(vector, list):
            return f"data[{position}] is not an embedding with an index"
        if not vector or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in vector):
            return f"data[{position}].embedding is not a list of numbers"
        vectors[index] = [float(x) for x in vector]
    if any(v is None for v in vectors):
        return "the embeddings do not cover every input"
    return [v for v in vectors if v is not None]


def embedding_usage(body: Any, spec: EmbeddingJudge) -> JudgeUsage:
    """Tokens of one billed embeddings call and its cost: `price.input_per_mtok` per million prompt
    tokens, else the provider's `usage.cost`, else unmeasured."""
    usage = body.get("usage") if isinstance(body, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    tokens = usage.get("prompt_tokens")
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else None
    if spec.price is not None and tokens is not None:
        return JudgeUsage(
            model=spec.model,
            input_tokens=tokens,
            cost_usd=tokens * spec.price.input_per_mtok / 1_000_000,
            cost_source="price",
        )
    cost = usage.get("cost")
    if isinstance(cost, int | float) and not isinstance(cost, bool) and math.isfinite(cost) and cost >= 0:
        return JudgeUsage(model=spec.model, input_tokens=tokens, cost_usd=float(cost), cost_source="provider")
    return JudgeUsage(model=spec.model, input_tokens=tokens)


class EndpointEmbeddingSimilarity:
    """An `embedding` judge over an OpenAI-compatible `/embeddings` endpoint: one call embeds the
    answer and the expected value together."""

    spends = True
    """Its calls cost money: held to an online suite's daily budget."""

    def __init__(
        self,
        spec: EmbeddingJudge,
        *,
        chat: ChatClient,
        base_url: str,
        api_key_secret: str | None,
        secrets: SecretStore,
    ) -> None:
        self.spec = spec
        self.chat = chat
        self.base_url = base_url
        self.api_key_secret = api_key_secret
        self.secrets = secrets

    async def judge(self, ctx: JudgeContext) -> Score:
        """Embed both texts at the endpoint and compare them."""
        judge_id = self.spec.id
        if ctx.expected is None or not ctx.expected.strip():
            return unmeasured(judge_id, "missing_evidence", "the case has no expected value")
        if not ctx.answer or not ctx.answer.strip():
            return measured(judge_id, 0.0, passed=False, detail="no answer")
        api_key = None
        if self.api_key_secret is not None:
            api_key = self.secrets.get(self.api_key_secret)
            if api_key is None:
                return unmeasured(judge_id, "missing_secret", f"secret {self.api_key_secret!r} is not set")
        outcome = await self.chat.complete(
            base_url=self.base_url,
            payload={"model": self.spec.model, "input": [ctx.answer, ctx.expected]},
            api_key=api_key,
            timeout_s=self.spec.timeout_s,
            max_retries=3,
            path="embeddings",
        )
        if isinstance(outcome, ChatFailure):
            return failure_score(judge_id, outcome)
        usage = embedding_usage(outcome.body, self.spec)
        vectors = read_vectors(outcome.body, 2)
        if isinstance(vectors, str):
            return msgspec.structs.replace(invalid(judge_id, redact(vectors, api_key)), usage=usage)
        similarity = cosine(vectors[0], vectors[1])
        passed = similarity >= self.spec.threshold
        relation = "≥" if passed else "<"
        score = measured(
            judge_id,
            similarity,
            passed=passed,
            detail=f"cosine similarity {similarity:.4f} {relation} threshold {self.spec.threshold:g} ({self.spec.model})",
        )
        return msgspec.structs.replace(score, usage=usage)
