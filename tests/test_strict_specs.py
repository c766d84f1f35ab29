"""Strict reading of user-written specs (`evalbus_contracts.strict`): an unknown key at any level
is named by its path with the nearest known key, a value outside a fixed set lists the allowed
ones — while the bus's decoders keep ignoring unknown fields (an older replica must read an event
a newer one wrote).

The every-level test derives its documents from msgspec's view of the suite-file type, so a spec
struct or field added later is covered without touching this file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from evalbus.cli.dataset import CaseDefaults, DatasetFields, DatasetSpec
from evalbus.cli.suite_file import FileSuite, SuiteFile
from evalbus_contracts import BatchRequested, BatchSpec, JudgeSpec, SuiteSpec, decode_event, encode, specs, to_builtins
from evalbus_contracts.strict import StrictProblem, error_location, join_path, nearest, strict_problems
from evalbus_gateway.testing import batch_spec

pytestmark = pytest.mark.unit

Wrap = Callable[[Any], Any]


def doc(**suite: Any) -> dict[str, Any]:
    """A valid spec as plain data, its suite's fields replaced by `suite`."""
    data: dict[str, Any] = to_builtins(batch_spec(("c1",)))
    data["suite"].update(suite)
    return data


def fields_of(problems: list[StrictProblem]) -> list[str]:
    return [p.field for p in problems]


def test_a_valid_spec_has_no_problem() -> None:
    assert strict_problems(doc(), BatchSpec) == []


def test_the_issues_typos_are_named_with_the_intended_key() -> None:
    data = doc(cases=[{"id": "c1", "input": "x", "grader": [{"kind": "steps", "id": "s"}]}])
    data["policy"] = {"trails": 3}
    problems = strict_problems(data, BatchSpec)
    assert problems == [
        StrictProblem("$.suite.cases[0].grader", "unknown field; did you mean `graders`?"),
        StrictProblem("$.policy.trails", "unknown field; did you mean `trials`?"),
    ]


def test_tagged_unions_are_walked_by_their_kind() -> None:
    data = doc(
        cases=[
            {
                "id": "c1",
                "input": "x",
                "graders": [
                    {"kind": "command", "id": "g", "command": "true", "pass_patern": "ok"},
                    {"kind": "steps", "id": "s", "max_step": 3},
                ],
            }
        ]
    )
    data["judges"] = [{"kind": "model", "id": "m", "rubric": "r", "modle": "gpt"}, {"kind": "exact", "id": "e"}]
    data["sinks"] = [{"kind": "platform", "platform": "mlflow", "endpoint": "http://x", "experimnt": "e"}]
    data["harness"]["trace"] = {"kind": "otel", "colect": "job"}
    problems = strict_problems(data, BatchSpec)
    assert [(p.field, p.message.rsplit("`", 2)[1]) for p in problems] == [
        ("$.suite.cases[0].graders[0].pass_patern", "pass_pattern"),
        ("$.suite.cases[0].graders[1].max_step", "max_steps"),
        ("$.harness.trace.colect", "collect"),
        ("$.judges[0].modle", "model"),
        ("$.sinks[0].experimnt", "experiment"),
    ]


def test_a_key_of_another_kind_is_unknown_in_this_one() -> None:
    # `pattern` belongs to the regex judge, not to the exact judge it was put on.
    problems = strict_problems([{"kind": "exact", "id": "e", "pattern": "x"}], tuple[JudgeSpec, ...])
    assert fields_of(problems) == ["$[0].pattern"]
    assert problems[0].message.startswith("unknown field (known: `case_sensitive`, `id`, `kind`, `strip`)")


def test_values_outside_their_set_list_the_allowed_ones() -> None:
    data = doc(cases=[{"id": "c1", "input": "x", "graders": [{"kind": "answer-matcher", "id": "a"}]}])
    data["harness"]["kind"] = "shell"
    data["harness"]["trace"] = {"kind": "otel", "collect": "later"}
    data["judges"] = [{"kind": "exact", "id": "e"}, {"kind": "contain", "id": "c"}]
    problems = {p.field: p.message for p in strict_problems(data, BatchSpec)}
    assert problems["$.suite.cases[0].graders[0].kind"].startswith("Invalid value 'answer-matcher'; did you mean")
    assert "'answer-match'" in problems["$.suite.cases[0].graders[0].kind"]
    assert "tests-pass" in problems["$.suite.cases[0].graders[0].kind"]
    assert problems["$.harness.kind"] == "Invalid value 'shell'; expected one of: command, worker"
    assert problems["$.harness.trace.collect"] == "Invalid value 'later'; expected one of: control-plane, job"
    assert "did you mean 'contains'?" in problems["$.judges[1].kind"]
    assert len(problems) == 4


def test_free_form_mappings_and_wrong_shapes_are_left_to_validation() -> None:
    data = doc(cases="not a list")
    data["labels"] = {"any key": "is fine", "trials": "too"}
    data["judges"] = [{"kind": "json-schema", "id": "j", "schema": {"type": "object", "anything": 1}}, 7]
    data["policy"] = ["not", "a", "mapping"]
    data["sinks"] = [{"id": "no kind"}]
    assert strict_problems(data, BatchSpec) == []


def test_problems_keep_document_order_and_odd_keys_are_quoted() -> None:
    spec = doc()
    data = {"zz top": 1, "suite": spec["suite"], "harness": spec["harness"], "policy": {"retry": 2, "trails": 3}}
    assert fields_of(strict_problems(data, BatchSpec)) == ['$["zz top"]', "$.policy.retry", "$.policy.trails"]


def test_nearest_and_paths() -> None:
    assert nearest("Trials", ["trials", "retries"]) == "trials"
    assert nearest("xyz", ["trials", "retries"]) is None
    assert join_path("$", "a") == "$.a"
    assert join_path("$.labels", "a.b") == '$.labels["a.b"]'
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert([{"kind": "exact"}], tuple[JudgeSpec, ...])
    assert error_location(info.value, "$.judges") == ("$.judges[0].id", "Object missing required field `id`")


def test_the_bus_keeps_reading_fields_it_does_not_know() -> None:
    """An event a newer release wrote, with new fields in its embedded spec, decodes here: only
    user input is strict."""
    event = BatchRequested(batch_id="b1", spec=batch_spec(("c1",)), submitted_by="alice")
    raw: dict[str, Any] = msgspec.json.decode(encode(event))
    raw["spec"]["policy"]["fair_share"] = 2
    raw["spec"]["suite"]["cases"][0]["weight"] = 0.5
    raw["from_the_future"] = True
    decoded = decode_event(msgspec.json.encode(raw))
    assert decoded == event
    assert strict_problems(raw["spec"], BatchSpec) != []


# ---------------------------------------------------------------- every level


def _misspelt(name: str) -> str:
    """A plausible typo: two inner letters swapped, or the last one doubled."""
    swapped = name[0] + name[2] + name[1] + name[3:] if len(name) >= 4 else name
    return swapped if swapped != name else name + name[-1]


def _under(node: Wrap, key: str) -> Wrap:
    return lambda value: node({key: value})


def _structs(t: mi.Type, path: str, wrap: Wrap, depth: int = 0) -> Iterator[tuple[str, mi.StructType, Wrap]]:
    """Every struct reachable from `t`: its path and a function building a document that holds a
    given mapping at that path."""
    if depth > 8:
        return
    if isinstance(t, mi.StructType):
        tag = {t.tag_field: t.tag} if t.tag_field else {}

        def node(value: dict[str, Any], wrap: Wrap = wrap, tag: dict[str, Any] = tag) -> Any:
            return wrap({**tag, **value})

        yield path, t, node
        for f in t.fields:
            yield from _structs(f.type, join_path(path, f.encode_name), _under(node, f.encode_name), depth + 1)
    elif isinstance(t, mi.UnionType):
        for member in t.types:
            yield from _structs(member, path, wrap, depth)
    elif isinstance(t, mi.ListType | mi.VarTupleType):
        yield from _structs(t.item_type, f"{path}[0]", lambda v: wrap([v]), depth + 1)
    elif isinstance(t, mi.DictType):
        yield from _structs(t.value_type, join_path(path, "k"), lambda v: wrap({"k": v}), depth + 1)


LEVELS = [(path, struct, build) for path, struct, build in _structs(mi.type_info(SuiteFile), "$", lambda v: v)]


def test_the_walk_reaches_every_spec_struct() -> None:
    reached = {struct.cls for _, struct, _ in LEVELS}
    batch_structs = {
        cls
        for cls in vars(specs).values()
        if isinstance(cls, type)
        and issubclass(cls, msgspec.Struct)
        and not cls.__name__.startswith(("_", "Online"))
        and cls.__module__ == specs.__name__
    }
    # The suite file's own subclasses stand for the batch spec and the suite.
    assert batch_structs - {BatchSpec, SuiteSpec} <= reached
    assert {SuiteFile, FileSuite, DatasetSpec, DatasetFields, CaseDefaults} <= reached


@pytest.mark.parametrize(("path", "struct", "build"), LEVELS, ids=[f"{p}:{s.cls.__name__}" for p, s, _ in LEVELS])
def test_a_misspelt_key_is_refused_at_every_level(path: str, struct: mi.StructType, build: Wrap) -> None:
    for f in struct.fields:
        typo = _misspelt(f.encode_name)
        problems = strict_problems(build({typo: 1}), SuiteFile)
        assert fields_of(problems) == [join_path(path, typo)], (f.encode_name, problems)
        assert problems[0].message == f"unknown field; did you mean `{f.encode_name}`?", (f.encode_name, problems)
