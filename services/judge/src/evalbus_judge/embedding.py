"""The embedding judge: cosine similarity between the answer and `expected` on a local embedding
model, passing at or above the spec's threshold.

It exists only where `sentence_transformers` is importable (it is not a dependency of evalbus):
`local_embedder()` returns None otherwise and the registry resolves `embedding` judges as
`unsupported`. The model is loaded lazily, once, and encoding runs in a worker thread so the
event loop keeps serving other cases.
"""

from __future__ import annotations

import asyncio
import importlib
import math
from collections.abc import Sequence
from typing import Any, Protocol

from evalbus_contracts import EmbeddingJudge, Score
from evalbus_judge.context import JudgeContext, measured, unmeasured

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
