"""The model judge: one chat-completions call that grades the answer against a rubric.

The prompt carries the rubric, the task input, the expected answer (when there is one), the
answer and a compact trace; the model must reply with the JSON object
`{"score": 0..1, "pass": bool, "reasoning": str}` (a fenced block is tolerated). The pure parts —
building the request, reading the verdict — are separate from the HTTP call in `chat.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from evalbus_contracts import (
    Artifact,
    EnvAction,
    Error,
    Infra,
    JudgeUsage,
    LlmCall,
    Log,
    Message,
    ModelJudge,
    ModelPrice,
    Score,
    Span,
    ToolCall,
    ToolResult,
    TraceEvent,
)
from evalbus_judge.chat import ChatClient, ChatFailure, redact
from evalbus_judge.context import JudgeContext, clip, invalid, measured, unmeasured
from evalbus_judge.jsontext import find_json_object
from evalbus_runtime.secrets import SecretStore

TEXT_LIMIT = 16_000
"""Characters of the input, expected value or answer put into the prompt."""
TRACE_LIMIT = 8_000
"""Characters of compact trace put into the prompt."""
EVENT_LIMIT = 400
"""Characters of one trace event in the compact trace."""

SYSTEM_PROMPT = (
    "You are a strict, impartial evaluation judge. Grade the AI agent's answer against the rubric, "
    "using the task, the expected answer when one is given, and the agent's trace as evidence. "
    'Reply with one JSON object and nothing else: {"score": <number from 0 to 1>, "pass": <true or false>, '
    '"reasoning": "<one short paragraph>"}.'
)
"""The judge's instructions; it names JSON, as the `json_object` response format requires."""


@dataclass(frozen=True, slots=True)
class ModelVerdict:
    """What the model said, validated."""

    score: float
    """Score in [0, 1]."""
    passed: bool | None
    """The model's own pass, when it gave a boolean."""
    reasoning: str | None
    """The model's explanation."""


def describe_event(event: TraceEvent) -> str:
    """One line for a trace event in the compact trace."""
    match event:
        case Message():
            text = f"{event.role}: {event.text}"
        case LlmCall():
            text = f"llm_call {event.model} (in={event.input_tokens}, out={event.output_tokens})"
        case ToolCall():
            text = f"tool_call {event.name} {msgspec.json.encode(event.args).decode()}"
        case ToolResult():
            text = f"tool_result {'ok' if event.ok else 'failed'}: {event.output}"
        case EnvAction():
            text = f"env_action {event.action}" + (f": {event.detail}" if event.detail else "")
        case Error():
            text = f"error: {event.message}"
        case Log():
            text = f"{event.stream}: {event.text}"
        case Artifact():
            text = f"artifact {event.name}" + (f" ({event.media_type})" if event.media_type else "")
        case Span():
            text = f"span {event.name}"
        case Infra():
            text = f"infra {event.event or ''}: {event.message}"
    return clip(f"[{event.t:g}s] " + " ".join(text.split()), EVENT_LIMIT)


def compact_trace(trace: tuple[TraceEvent, ...], limit: int = TRACE_LIMIT) -> str:
    """The trace as one line per event within `limit` characters: when it is longer, the first
    third and the last two thirds of the budget are kept (the end of a run is where answers are)."""
    lines = [describe_event(e) for e in trace]
    if sum(len(line) + 1 for line in lines) <= limit:
        return "\n".join(lines) if lines else "(empty)"
    head: list[str] = []
    used = 0
    for line in lines:
        if used + len(line) + 1 > limit // 3:
            break
        head.append(line)
        used += len(line) + 1
    tail: list[str] = []
    used = 0
    for line in reversed(lines[len(head) :]):
        if used + len(line) + 1 > limit - limit // 3:
            break
        tail.append(line)
        used += len(line) + 1
    omitted = len(lines) - len(head) - len(tail)
    return "\n".join([*head, f"… {omitted} events omitted …", *reversed(tail)])


def build_messages(spec: ModelJudge, ctx: JudgeContext) -> list[dict[str, str]]:
    """The chat messages for judging `ctx` with `spec`'s rubric."""
    sections = [
        f"## Rubric\n{spec.rubric}",
        f"## Task given to the agent\n{clip(ctx.case_input, TEXT_LIMIT) if ctx.case_input else '(not available)'}",
    ]
    if ctx.expected is not None:
        sections.append(f"## Expected answer\n{clip(ctx.expected, TEXT_LIMIT)}")
    sections.append(f"## Agent's answer\n{clip(ctx.answer, TEXT_LIMIT) if ctx.answer else '(no answer)'}")
    sections.append(f"## Agent's trace\n{compact_trace(ctx.trace)}")
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "\n\n".join(sections)},
    ]


def build_request(spec: ModelJudge, ctx: JudgeContext) -> dict[str, Any]:
    """The chat-completions request body."""
    return {
        "model": spec.model,
        "messages": build_messages(spec, ctx),
        "response_format": {"type": "json_object"},
        "temperature": 0,
    }


def read_verdict(body: Any) -> ModelVerdict | str:
    """The verdict in a chat-completions response body, or why it breaks the contract."""
    try:
        message = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return "response has no choices[0].message"
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str) or not content.strip():
        refusal = message.get("refusal") if isinstance(message, dict) else None
        return f"model refused: {refusal}" if isinstance(refusal, str) else "assistant message has no content"
    found = find_json_object(content)
    if found is None:
        return f"assistant content is not a JSON object: {clip(content, 200)!r}"
    score = found.get("score")
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        return f"score must be a number, got {score!r}"
    if not 0.0 <= score <= 1.0:
        return f"score {score} is outside 0..1"
    passed = found.get("pass")
    reasoning = found.get("reasoning")
    return ModelVerdict(
        score=float(score),
        passed=passed if isinstance(passed, bool) else None,
        reasoning=reasoning if isinstance(reasoning, str) else None,
    )


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def read_usage(body: Any, *, model: str, price: ModelPrice | None) -> JudgeUsage:
    """The usage of one billed call from its response's `usage` object (`prompt_tokens`,
    `completion_tokens`, and `cost` where the provider reports one). The cost comes from `price`
    when the spec gives one and both token counts are known, else from the provider's `cost`, else
    it is unmeasured (None, never 0)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    input_tokens = _count(usage.get("prompt_tokens"))
    output_tokens = _count(usage.get("completion_tokens"))
    if price is not None and input_tokens is not None and output_tokens is not None:
        cost = (input_tokens * price.input_per_mtok + output_tokens * price.output_per_mtok) / 1_000_000
        return JudgeUsage(
            model=model, input_tokens=input_tokens, output_tokens=output_tokens, cost_usd=cost, cost_source="price"
        )
    reported = usage.get("cost")
    if (
        isinstance(reported, int | float)
        and not isinstance(reported, bool)
        and math.isfinite(reported)
        and reported >= 0
    ):
        return JudgeUsage(
            model=model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cost_usd=float(reported),
            cost_source="provider",
        )
    return JudgeUsage(model=model, input_tokens=input_tokens, output_tokens=output_tokens)


class ChatModelJudge:
    """A `model` judge bound to its endpoint, API-key secret name and the process's chat client."""

    spends = True
    """Its calls cost money: held to an online suite's daily budget."""

    def __init__(
        self,
        spec: ModelJudge,
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
        """Ask the model; map its reply or the transport's failure onto a score."""
        judge_id = self.spec.id
        api_key = None
        if self.api_key_secret is not None:
            api_key = self.secrets.get(self.api_key_secret)
            if api_key is None:
                return unmeasured(judge_id, "missing_secret", f"secret {self.api_key_secret!r} is not set")
        outcome = await self.chat.complete(
            base_url=self.base_url,
            payload=build_request(self.spec, ctx),
            api_key=api_key,
            timeout_s=self.spec.timeout_s,
            max_retries=max(0, self.spec.max_retries),
        )
        if isinstance(outcome, ChatFailure):
            return failure_score(judge_id, outcome)
        # a 2xx is billed whatever it says, so even a verdict that breaks the contract carries its usage
        usage = read_usage(outcome.body, model=self.spec.model, price=self.spec.price)
        found = read_verdict(outcome.body)
        if isinstance(found, str):
            return msgspec.structs.replace(invalid(judge_id, redact(found, api_key)), usage=usage)
        passed = found.passed if found.passed is not None else found.score >= self.spec.pass_threshold
        detail = redact(found.reasoning, api_key) if found.reasoning else None
        return msgspec.structs.replace(measured(judge_id, found.score, passed=passed, detail=detail), usage=usage)


def failure_score(judge_id: str, failure: ChatFailure) -> Score:
    """A transport failure as a score: `invalid` for a reply that breaks the protocol, else
    `unmeasured` (timeout or error, retryable when a later attempt could succeed)."""
    attempts = f" after {failure.attempts} attempt{'s' if failure.attempts != 1 else ''}"
    if failure.kind == "protocol":
        return invalid(judge_id, failure.detail)
    if failure.kind == "timeout":
        return unmeasured(
            judge_id, "grader_timeout", failure.detail + attempts, retryable=True, attempts=failure.attempts
        )
    return unmeasured(
        judge_id, "grader_error", failure.detail + attempts, retryable=failure.retryable, attempts=failure.attempts
    )
