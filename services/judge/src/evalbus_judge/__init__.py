"""The judge service's stage logic: the judge registry, rule / model / embedding judges, and
`judge_event`, which turns a ready case into its `case.judged` event. No NATS here; the service
wiring feeds events in and publishes what comes out."""

from evalbus_judge.apply import (
    DEFAULT_JUDGE_TIMEOUT_S,
    ReadyEvent,
    has_outcome,
    judge_event,
    online_batch_id,
    run_judge,
)
from evalbus_judge.chat import ChatClient, ChatFailure, ChatReply, RetryPolicy, parse_retry_after
from evalbus_judge.context import Judge, JudgeContext
from evalbus_judge.embedding import Embedder, EmbeddingSimilarity, local_embedder
from evalbus_judge.errors import JudgeMachineryError, JudgeServiceError
from evalbus_judge.model import ChatModelJudge
from evalbus_judge.registry import (
    JudgeFactory,
    JudgeRegistry,
    ModelDefaults,
    ResolvedJudge,
    ResolvedJudges,
    UnavailableJudge,
)
from evalbus_judge.rules import ContainsRule, ExactRule, JsonSchemaRule, NumericRule, RegexRule

__all__ = [
    "DEFAULT_JUDGE_TIMEOUT_S",
    "ChatClient",
    "ChatFailure",
    "ChatModelJudge",
    "ChatReply",
    "ContainsRule",
    "Embedder",
    "EmbeddingSimilarity",
    "ExactRule",
    "JsonSchemaRule",
    "Judge",
    "JudgeContext",
    "JudgeFactory",
    "JudgeMachineryError",
    "JudgeRegistry",
    "JudgeServiceError",
    "ModelDefaults",
    "NumericRule",
    "ReadyEvent",
    "RegexRule",
    "ResolvedJudge",
    "ResolvedJudges",
    "RetryPolicy",
    "UnavailableJudge",
    "has_outcome",
    "judge_event",
    "local_embedder",
    "online_batch_id",
    "parse_retry_after",
    "run_judge",
]
