"""The judge registry: which implementation serves each `JudgeSpec`, resolved once per batch.

A judge the service cannot run — an unknown registered name, an `embedding` judge without an
endpoint or a local embedding model, a `model` judge with no base URL anywhere — is still
resolved, to a placeholder that scores every case `unmeasured: unsupported` (never a failure). A `model` judge whose named
API-key secret is missing resolves to `unmeasured: missing_secret`, so no unauthenticated call is
ever made.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from evalbus_contracts import (
    ContainsJudge,
    EmbeddingJudge,
    ExactJudge,
    JsonSchemaJudge,
    JudgeSpec,
    ModelJudge,
    NumericJudge,
    RegexJudge,
    RegisteredJudge,
    Score,
    UnmeasuredReason,
)
from evalbus_judge.chat import ChatClient
from evalbus_judge.context import Judge, JudgeContext, unmeasured
from evalbus_judge.embedding import Embedder, EmbeddingSimilarity, EndpointEmbeddingSimilarity
from evalbus_judge.model import ChatModelJudge
from evalbus_judge.rules import ContainsRule, ExactRule, JsonSchemaRule, NumericRule, RegexRule
from evalbus_runtime.secrets import SecretStore

JudgeFactory = Callable[[RegisteredJudge], Judge]
"""Builds a custom judge from its `registered` spec (name and params)."""


@dataclass(frozen=True, slots=True)
class ModelDefaults:
    """Service-wide settings for `model` judges whose spec leaves them unset."""

    base_url: str | None = None
    """Default chat-completions base URL (…/v1)."""
    api_key_secret: str | None = None
    """Secret *name* of the API key for `base_url`; sent only to that URL, never to one a spec names."""
    allowed_base_urls: tuple[str, ...] = ()
    """Other base URLs a spec may send a named secret to (`*`: any). A secret goes nowhere else, so a
    batch cannot ship a key it names to an endpoint of its own choosing."""


class UnavailableJudge:
    """Stands in for a judge the service cannot run: every case gets the same `unmeasured` score."""

    def __init__(self, judge_id: str, reason: UnmeasuredReason, detail: str) -> None:
        self.judge_id = judge_id
        self.reason: UnmeasuredReason = reason
        self.detail = detail

    async def judge(self, ctx: JudgeContext) -> Score:
        """The placeholder score."""
        return unmeasured(self.judge_id, self.reason, self.detail, retryable=False)


@dataclass(frozen=True, slots=True)
class ResolvedJudge:
    """One judge of a batch, ready to run."""

    judge_id: str
    """The spec's id (its metric is `judge:<id>`)."""
    kind: str
    """The spec's kind (`exact`, `model`…)."""
    judge: Judge
    """The implementation (an `UnavailableJudge` when unresolved)."""

    @property
    def resolved(self) -> bool:
        """Whether a real implementation serves this judge."""
        return not isinstance(self.judge, UnavailableJudge)


@dataclass(frozen=True, slots=True)
class ResolvedJudges:
    """A batch's judges in selection order."""

    judges: tuple[ResolvedJudge, ...]
    """In selection order (the order their scores are appended)."""

    @property
    def unresolved(self) -> tuple[ResolvedJudge, ...]:
        """Judges that will score every case `unmeasured` (for logs and metrics)."""
        return tuple(j for j in self.judges if not j.resolved)


class JudgeRegistry:
    """Maps judge specs to implementations; caches each batch's resolution (bounded LRU)."""

    def __init__(
        self,
        *,
        chat: ChatClient | None = None,
        model_defaults: ModelDefaults | None = None,
        secrets: SecretStore | None = None,
        embedder: Embedder | None = None,
        cache_size: int = 256,
    ) -> None:
        """`chat` is the process's started client (model judges are unsupported without one);
        `embedder` is `local_embedder()` or None (embedding judges are then unsupported)."""
        self.chat = chat
        self.model_defaults = model_defaults or ModelDefaults()
        self.secrets = secrets or SecretStore()
        self.embedder = embedder
        self.cache_size = max(1, cache_size)
        self._factories: dict[str, JudgeFactory] = {}
        self._cache: OrderedDict[tuple[str, bytes], ResolvedJudges] = OrderedDict()

    def register(self, name: str, factory: JudgeFactory, *, replace: bool = False) -> None:
        """Serve `registered` judges named `name` with `factory`. Clears the batch cache."""
        if not name:
            raise ValueError("a judge name must not be empty")
        if name in self._factories and not replace:
            raise ValueError(f"a judge named {name!r} is already registered")
        self._factories[name] = factory
        self._cache.clear()

    @property
    def names(self) -> tuple[str, ...]:
        """Registered custom judge names."""
        return tuple(sorted(self._factories))

    def resolve(self, specs: Sequence[JudgeSpec], *, batch_id: str | None = None) -> ResolvedJudges:
        """The implementations for `specs`, in order; cached per batch id (and spec list) when given."""
        # The spec bytes are part of the key so an online suite whose judges were reconfigured, or
        # a re-judge reusing a batch id, never gets a stale resolution; encoding them costs
        # microseconds next to any judging.
        key = None if batch_id is None else (batch_id, msgspec.json.encode(tuple(specs)))
        if key is not None:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        resolved = ResolvedJudges(tuple(self._resolve_one(spec) for spec in specs))
        if key is not None:
            self._cache[key] = resolved
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return resolved

    def _resolve_one(self, spec: JudgeSpec) -> ResolvedJudge:
        kind = str(type(spec).__struct_config__.tag)
        return ResolvedJudge(judge_id=spec.id, kind=kind, judge=self._build(spec))

    def _build(self, spec: JudgeSpec) -> Judge:
        match spec:
            case ExactJudge():
                return ExactRule(spec)
            case ContainsJudge():
                return ContainsRule(spec)
            case RegexJudge():
                return RegexRule(spec)
            case JsonSchemaJudge():
                return JsonSchemaRule(spec)
            case NumericJudge():
                return NumericRule(spec)
            case ModelJudge():
                return self._model_judge(spec)
            case EmbeddingJudge():
                return self._embedding_judge(spec)
            case RegisteredJudge():
                factory = self._factories.get(spec.name)
                if factory is None:
                    return UnavailableJudge(spec.id, "unsupported", f"no judge is registered as {spec.name!r}")
                try:
                    return factory(spec)
                except Exception as e:
                    return UnavailableJudge(
                        spec.id, "grader_error", f"judge {spec.name!r} could not be built: {type(e).__name__}: {e}"
                    )

    def _embedding_judge(self, spec: EmbeddingJudge) -> Judge:
        """The spec's endpoint; else a local model; else the service's default endpoint."""
        if spec.base_url is None and self.embedder is not None:
            return EmbeddingSimilarity(spec, self.embedder)
        endpoint = self._endpoint(spec.id, spec.base_url, spec.api_key_secret)
        if isinstance(endpoint, UnavailableJudge):
            if endpoint.reason == "unsupported":
                return UnavailableJudge(
                    spec.id,
                    "unsupported",
                    "no embeddings base URL is configured and no local embedding model is available",
                )
            return endpoint
        assert self.chat is not None
        base_url, secret_name = endpoint
        return EndpointEmbeddingSimilarity(
            spec, chat=self.chat, base_url=base_url, api_key_secret=secret_name, secrets=self.secrets
        )

    def _model_judge(self, spec: ModelJudge) -> Judge:
        endpoint = self._endpoint(spec.id, spec.base_url, spec.api_key_secret)
        if isinstance(endpoint, UnavailableJudge):
            return endpoint
        assert self.chat is not None
        base_url, secret_name = endpoint
        return ChatModelJudge(spec, chat=self.chat, base_url=base_url, api_key_secret=secret_name, secrets=self.secrets)

    def _endpoint(
        self, judge_id: str, spec_base_url: str | None, spec_secret: str | None
    ) -> tuple[str, str | None] | UnavailableJudge:
        """The base URL and API-key secret name a judge of an OpenAI-compatible endpoint may use,
        or the placeholder that says why it may not."""
        base_url = spec_base_url or self.model_defaults.base_url
        if not base_url:
            return UnavailableJudge(judge_id, "unsupported", "no model base URL is configured")
        if self.chat is None:
            return UnavailableJudge(judge_id, "unsupported", "the judge service has no chat client")
        secret_name = spec_secret
        if secret_name is None and base_url == self.model_defaults.base_url:
            # The service's own key goes only to the service's own endpoint, never to a URL a batch chose.
            secret_name = self.model_defaults.api_key_secret
        trusted = {u.rstrip("/") for u in (self.model_defaults.base_url, *self.model_defaults.allowed_base_urls) if u}
        if secret_name is not None and "*" not in trusted and base_url.rstrip("/") not in trusted:
            return UnavailableJudge(
                judge_id,
                "policy_skip",
                f"base URL {base_url} may not receive secrets (add it to JUDGE_ALLOWED_BASE_URLS)",
            )
        if secret_name is not None and self.secrets.get(secret_name) is None:
            return UnavailableJudge(judge_id, "missing_secret", f"secret {secret_name!r} is not set")
        return base_url, secret_name
