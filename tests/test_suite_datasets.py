"""Suite files whose cases come from a dataset file (JSONL, CSV, a JSON array; Parquet where
pyarrow is importable): the field mapping and its defaults, suite-wide graders, object inputs,
`sample` / `shuffle` / `limit` with a seed, and every problem named by the file, the line (or
element, or row) and the field — `evalbus run` exits 2 on them, as on a misspelt key."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from evalbus.cli import main
from evalbus.cli.dataset import DatasetSpec, select
from evalbus.cli.suite_file import SpecFileError, load_judges, load_suite
from evalbus_contracts import AnswerMatchGrader, BatchSpec, CaseSpec, StepsGrader, TextMetricGrader, encode
from evalbus_gateway.api.validation import parse_json

pytestmark = pytest.mark.unit

HARNESS = "harness: {kind: command, id: agent, command: [python3, agent.py]}\n"


def suite_file(folder: Path, suite: str, name: str = "suite.yaml") -> Path:
    path = folder / name
    path.write_text(f"suite:\n{suite}\n{HARNESS}")
    return path


def jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def problems_of(path: Path) -> list[tuple[str, str]]:
    with pytest.raises(SpecFileError) as info:
        load_suite(path)
    return info.value.problems


QA_ROWS = [
    {"qid": "q1", "question": "What is 17 * 23?", "answer": 391, "level": "easy"},
    {"qid": "q2", "question": {"text": "Capital of France?", "choices": ["Paris", "Lyon"]}, "answer": "Paris"},
    {"qid": "q3", "question": "Reverse 'abc'", "checks": [{"kind": "steps", "id": "steps", "max_steps": 2}]},
]


# ---------------------------------------------------------------- reading


def test_the_issues_example_jsonl_with_a_mapping_and_suite_graders(tmp_path: Path) -> None:
    jsonl(tmp_path / "cases.jsonl", QA_ROWS)
    path = suite_file(
        tmp_path,
        "  id: qa\n"
        "  dataset: {path: cases.jsonl, fields: {id: qid, input: question, expected: answer, graders: checks}}\n"
        "  graders: [{kind: answer-match, id: answer}]",
    )
    spec = load_suite(path)
    answer = AnswerMatchGrader(id="answer")
    assert spec.suite.cases == (
        CaseSpec(id="q1", input="What is 17 * 23?", expected="391", graders=(answer,)),
        CaseSpec(
            id="q2",
            input='{"text":"Capital of France?","choices":["Paris","Lyon"]}',
            expected="Paris",
            graders=(answer,),
        ),
        CaseSpec(id="q3", input="Reverse 'abc'", graders=(answer, StepsGrader(id="steps", max_steps=2))),
    )


def test_inline_cases_come_first_and_may_have_object_inputs(tmp_path: Path) -> None:
    jsonl(tmp_path / "more.jsonl", [{"input": "from the file"}, {"input": "second"}])
    path = suite_file(
        tmp_path,
        "  id: mixed\n  cases:\n  - {id: inline, input: {task: add, args: [1, 2]}}\n  dataset: {path: more.jsonl}",
    )
    cases = load_suite(path).suite.cases
    assert [(c.id, c.input) for c in cases] == [
        ("inline", '{"task":"add","args":[1,2]}'),
        ("row-1", "from the file"),
        ("row-2", "second"),
    ]


def test_csv_with_quoted_lines_tags_metadata_columns_graders_and_defaults(tmp_path: Path) -> None:
    (tmp_path / "cases.csv").write_text(
        "id,question,answer,tags,timeout_s,source,difficulty,graders\n"
        '1,"What is\ntwo plus two?",4,"math, easy",5,book,1,\n'
        '2,Name a colour,,,,web,,"[{""kind"":""text-metric"",""id"":""n"",""pattern"":""(\\\\d+)""}]"\n'
    )
    path = suite_file(
        tmp_path,
        "  id: csv\n"
        "  dataset:\n"
        "    path: cases.csv\n"
        "    fields: {input: question, expected: answer, metadata: [source, difficulty]}\n"
        "    defaults: {expected: red, tags: [default], metadata: {origin: csv}, timeout_s: 9,\n"
        "               graders: [{kind: steps, id: steps}]}",
    )
    first, second = load_suite(path).suite.cases
    assert first == CaseSpec(
        id="1",
        input="What is\ntwo plus two?",
        expected="4",
        tags=("math", "easy"),
        timeout_s=5.0,
        metadata={"origin": "csv", "source": "book", "difficulty": "1"},
        graders=(StepsGrader(id="steps"),),
    )
    assert second == CaseSpec(
        id="2",
        input="Name a colour",
        expected="red",
        tags=("default",),
        timeout_s=9.0,
        metadata={"origin": "csv", "source": "web"},
        graders=(TextMetricGrader(id="n", pattern="(\\d+)"),),
    )


def test_json_array_with_a_metadata_object_and_generated_ids(tmp_path: Path) -> None:
    rows = [
        {"input": "a", "metadata": {"source": "x", "weight": 2}, "tags": ["t"]},
        {"input": "b", "expected": True},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(rows))
    cases = load_suite(suite_file(tmp_path, "  id: arr\n  dataset: {path: cases.json}")).suite.cases
    assert cases == (
        CaseSpec(id="row-1", input="a", tags=("t",), metadata={"source": "x", "weight": "2"}),
        CaseSpec(id="row-2", input="b", expected="true"),
    )


def test_format_can_be_named_when_the_suffix_does_not_tell(tmp_path: Path) -> None:
    jsonl(tmp_path / "cases.txt", [{"input": "x"}])
    path = suite_file(tmp_path, "  id: fmt\n  dataset: {path: cases.txt, format: jsonl}")
    assert [c.id for c in load_suite(path).suite.cases] == ["row-1"]


def test_paths_are_relative_to_the_suite_file_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "suites" / "data"
    data.mkdir(parents=True)
    jsonl(data / "cases.jsonl", [{"input": "x"}])
    path = suite_file(tmp_path / "suites", "  id: rel\n  dataset: {path: data/cases.jsonl}")
    monkeypatch.chdir(tmp_path)
    assert len(load_suite(path).suite.cases) == 1


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow is not installed")
def test_parquet_where_pyarrow_is_importable(tmp_path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-not-found,unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found,unused-ignore]

    pq.write_table(pa.Table.from_pylist([{"id": "p1", "input": "x", "expected": "y"}]), tmp_path / "cases.parquet")
    cases = load_suite(suite_file(tmp_path, "  id: pq\n  dataset: {path: cases.parquet}")).suite.cases
    assert cases == (CaseSpec(id="p1", input="x", expected="y"),)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "cases.parquet").write_bytes(b"PAR1")
    [(field, message)] = problems_of(suite_file(tmp_path, "  id: pq\n  dataset: {path: cases.parquet}"))
    assert field == "$.suite.dataset.format"
    assert "pyarrow" in message


def test_the_expanded_spec_is_what_the_gateway_accepts(tmp_path: Path) -> None:
    jsonl(tmp_path / "cases.jsonl", QA_ROWS)
    path = suite_file(
        tmp_path,
        "  id: qa\n"
        "  dataset: {path: cases.jsonl, fields: {id: qid, input: question, expected: answer, graders: checks}}\n"
        "  graders: [{kind: answer-match, id: answer}]",
    )
    spec = load_suite(path)
    assert parse_json(encode(spec), BatchSpec) == spec  # strict: nothing the gateway does not know


def test_the_example_suites_load() -> None:
    examples = Path(__file__).parents[1] / "examples"
    assert len(load_suite(examples / "suite.yaml").suite.cases) == 30
    first, *rest = load_suite(examples / "dataset.yaml").suite.cases
    assert len(rest) == 9
    assert (first.id, first.input, first.expected, first.tags) == ("row-1", "What is 6 * 7?", "42", ("math",))
    assert [g.id for g in first.graders] == ["answer", "steps", "cost", "latency"]


# ---------------------------------------------------------------- sample, shuffle, limit


def ids_for(tmp_path: Path, options: str, count: int = 20) -> list[str]:
    jsonl(tmp_path / "n.jsonl", [{"id": f"c{i:02d}", "input": str(i)} for i in range(count)])
    path = suite_file(tmp_path, f"  id: sel\n  dataset: {{path: n.jsonl, {options}}}")
    return [c.id for c in load_suite(path).suite.cases]


def test_sample_draws_a_seeded_subset_in_file_order(tmp_path: Path) -> None:
    picked = ids_for(tmp_path, "sample: 5, seed: 7")
    assert len(picked) == 5
    assert picked == sorted(picked)
    assert ids_for(tmp_path, "sample: 5, seed: 7") == picked
    assert ids_for(tmp_path, "sample: 5, seed: 8") != picked
    assert ids_for(tmp_path, "sample: 50") == [f"c{i:02d}" for i in range(20)]


def test_shuffle_reorders_with_its_seed_and_limit_cuts_after_it(tmp_path: Path) -> None:
    shuffled = ids_for(tmp_path, "shuffle: true, seed: 3")
    assert sorted(shuffled) == [f"c{i:02d}" for i in range(20)]
    assert shuffled != sorted(shuffled)
    assert ids_for(tmp_path, "shuffle: true, seed: 3") == shuffled
    assert ids_for(tmp_path, "shuffle: true, seed: 3, limit: 4") == shuffled[:4]
    assert ids_for(tmp_path, "limit: 3") == ["c00", "c01", "c02"]


def test_selection_order_is_sample_then_shuffle_then_limit() -> None:
    spec = DatasetSpec(path="x", sample=6, shuffle=True, limit=3, seed=1)
    items = list(range(30))
    out = select(items, spec)
    assert len(out) == 3
    assert set(out) <= set(select(items, DatasetSpec(path="x", sample=6, seed=1)))


# ---------------------------------------------------------------- problems, by file, line and field


def test_rows_that_are_not_json_objects_are_named_by_line(tmp_path: Path) -> None:
    (tmp_path / "cases.jsonl").write_text('{"input": "ok"}\n\nnot json\n[1, 2]\n{"input": "ok too"}\n{"input": 5}\n')
    problems = problems_of(suite_file(tmp_path, "  id: bad\n  dataset: {path: cases.jsonl}"))
    # the rows that could be read are checked too: every problem at once, in line order
    assert [f for f, _ in problems] == ["cases.jsonl line 3", "cases.jsonl line 4", "cases.jsonl line 6, field input"]
    assert "not valid JSON" in problems[0][1]
    assert problems[1][1] == "expected a JSON object, got list"


def test_bad_values_are_named_by_line_and_column(tmp_path: Path) -> None:
    jsonl(
        tmp_path / "cases.jsonl",
        [
            {"qid": "a", "question": "x", "tags": ["ok", 2]},
            {"qid": "b", "question": 7},
            {"qid": "a", "question": "dup"},
            {"question": "no id"},
            {"qid": "c", "question": "x", "checks": [{"kind": "command", "id": "g", "comand": "true"}]},
            {"qid": "d", "question": "x", "checks": [{"kind": "command", "id": "g"}]},
            {"qid": ["e"], "question": "x"},
        ],
    )
    path = suite_file(
        tmp_path, "  id: bad\n  dataset: {path: cases.jsonl, fields: {id: qid, input: question, graders: checks}}"
    )
    assert problems_of(path) == [
        ("cases.jsonl line 1, field tags", "tags must be a list of strings (or comma-separated text)"),
        ("cases.jsonl line 2, field question", "an input must be a string or a JSON object, got int"),
        ("cases.jsonl line 3, field qid", "duplicate case id 'a' (first at cases.jsonl line 1)"),
        ("cases.jsonl line 4, field qid", "missing (it holds the case id)"),
        ("cases.jsonl line 5, field checks[0].comand", "unknown field; did you mean `command`?"),
        ("cases.jsonl line 6, field checks[0].command", "Object missing required field `command`"),
        ("cases.jsonl line 7, field qid", "a case id must be a string or an integer, got list"),
    ]


def test_a_column_no_row_has_is_named_once_with_the_nearest_column(tmp_path: Path) -> None:
    jsonl(tmp_path / "cases.jsonl", [{"question": "x", "answer": "y"}] * 3)
    path = suite_file(tmp_path, "  id: cols\n  dataset: {path: cases.jsonl, fields: {expected: answr}}")
    assert problems_of(path) == [
        ("$.suite.dataset.fields.input", "column 'input' is in no row (or empty in all) (columns: answer, question)"),
        ("$.suite.dataset.fields.expected", "column 'answr' is in no row (or empty in all); did you mean 'answer'?"),
    ]


def test_csv_and_json_problems_name_their_line_or_element(tmp_path: Path) -> None:
    (tmp_path / "cases.csv").write_text('id,input,timeout_s\n1,x,soon\n2,"multi\nline",1,extra\n3,y,1\n')
    assert problems_of(suite_file(tmp_path, "  id: c\n  dataset: {path: cases.csv}")) == [
        ("cases.csv line 2, field timeout_s", "expected a number of seconds, got 'soon'"),  # all at once
        ("cases.csv line 3", "more values than the 3 header columns"),
    ]
    (tmp_path / "cases.csv").write_text('id,input\n1,x\n2,"What is 3 + 5?\n')
    assert problems_of(suite_file(tmp_path, "  id: c\n  dataset: {path: cases.csv}")) == [
        ("cases.csv line 3", "a quoted cell that starts on this line is never closed"),
    ]
    (tmp_path / "cases.csv").write_text("id,input,timeout_s\n1,x,soon\n")
    assert problems_of(suite_file(tmp_path, "  id: c\n  dataset: {path: cases.csv}")) == [
        ("cases.csv line 2, field timeout_s", "expected a number of seconds, got 'soon'"),
    ]
    (tmp_path / "cases.json").write_text('[{"input": "x"}, "y", {"input": 1}]')
    problems = problems_of(suite_file(tmp_path, "  id: j\n  dataset: {path: cases.json}"))
    assert problems == [
        ("cases.json [1]", "expected a JSON object, got str"),
        ("cases.json [2], field input", "an input must be a string or a JSON object, got int"),
    ]
    (tmp_path / "cases.json").write_text('[{"input": "x"},\n {"input": }]')
    [(field, message)] = problems_of(suite_file(tmp_path, "  id: j\n  dataset: {path: cases.json}"))
    assert field == "cases.json"
    assert "line 2" in message


def test_rules_broken_by_dataset_cases_point_at_their_row_and_suite_graders_once(tmp_path: Path) -> None:
    jsonl(
        tmp_path / "cases.jsonl",
        [
            {"id": "a", "input": "x", "timeout_s": -1},
            {"id": "b", "input": "y", "graders": [{"kind": "cost", "id": "n"}]},
        ],
    )
    path = suite_file(
        tmp_path,
        "  id: rules\n"
        "  graders: [{kind: text-metric, id: n, pattern: '('}]\n"
        "  cases: [{id: a, input: inline}]\n"
        "  dataset: {path: cases.jsonl}",
    )
    assert problems_of(path) == [
        ("$.suite.graders[0].pattern", "regex does not compile: missing ), unterminated subpattern at position 0"),
        ("cases.jsonl line 1, field id", "duplicate case id 'a'"),
        ("cases.jsonl line 1, field timeout_s", "must be greater than 0"),
        ("cases.jsonl line 2, field graders[0].id", "duplicate grader id 'n' in case 'b'"),
    ]


def test_rows_that_cannot_be_read_do_not_hide_the_rules_the_others_break(tmp_path: Path) -> None:
    (tmp_path / "cases.jsonl").write_text(
        '{"id": "a", "input": "x", "timeout_s": -1}\nnot json\n'
        '{"id": "c", "input": "y", "graders": [{"kind": "command", "id": "g", "comand": "true"}]}\n'
    )
    assert problems_of(suite_file(tmp_path, "  id: rules\n  dataset: {path: cases.jsonl}")) == [
        ("cases.jsonl line 2", "not valid JSON: JSON is malformed: invalid character (byte 4)"),
        ("cases.jsonl line 3, field graders[0].comand", "unknown field; did you mean `command`?"),
        ("cases.jsonl line 1, field timeout_s", "must be greater than 0"),  # a rule, checked on the readable rows
    ]
    (tmp_path / "cases.jsonl").write_text('{"input": "x"}\n{"input": "y", "answer": \n')
    # the column may be in the row that could not be read: not called missing
    fields = "  id: cols\n  dataset: {path: cases.jsonl, fields: {expected: answer}}"
    assert [f for f, _ in problems_of(suite_file(tmp_path, fields))] == ["cases.jsonl line 2"]
    (tmp_path / "cases.jsonl").write_text("not json\n")  # no readable row: no rule about having none
    assert [f for f, _ in problems_of(suite_file(tmp_path, "  id: rules\n  dataset: {path: cases.jsonl}"))] == [
        "cases.jsonl line 1"
    ]


def test_where_the_dataset_is_or_what_it_holds_is_named_in_the_suite(tmp_path: Path) -> None:
    assert problems_of(suite_file(tmp_path, "  id: x\n  dataset: {path: absent.jsonl}")) == [
        ("$.suite.dataset.path", f"no such file: {tmp_path / 'absent.jsonl'}"),
    ]
    (tmp_path / "cases.xlsx").write_text("")
    [(field, message)] = problems_of(suite_file(tmp_path, "  id: x\n  dataset: {path: cases.xlsx}"))
    assert field == "$.suite.dataset.format"
    assert "csv, json, jsonl, parquet" in message
    (tmp_path / "empty.jsonl").write_text("\n")
    assert problems_of(suite_file(tmp_path, "  id: x\n  dataset: {path: empty.jsonl}")) == [
        ("$.suite.dataset.path", "empty.jsonl holds no rows"),
    ]
    [(field, message)] = problems_of(suite_file(tmp_path, "  id: x\n  dataset: {path: empty.jsonl, sample: 0}"))
    assert field == "$.suite.dataset.sample"
    [(field, message)] = problems_of(suite_file(tmp_path, "  id: x\n  dataset: {path: e.jsonl, shufle: true}"))
    assert (field, message) == ("$.suite.dataset.shufle", "unknown field; did you mean `shuffle`?")


# ---------------------------------------------------------------- evalbus run


def test_run_exits_2_on_a_misspelt_key_naming_it_and_the_intended_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = suite_file(tmp_path, "  id: typo\n  cases: [{id: c1, input: x}]\npolicy: {trails: 3}")
    assert main(["run", str(path), "--gateway", "http://127.0.0.1:9", "--token", "t"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path} is not a valid suite" in err
    assert "$.policy.trails: unknown field; did you mean `trials`?" in err


def test_run_exits_2_on_a_dataset_problem_naming_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl(tmp_path / "cases.jsonl", [{"input": "x"}] + [{"input": 1}] * 25)
    path = suite_file(tmp_path, "  id: ds\n  dataset: {path: cases.jsonl}")
    assert main(["run", str(path), "--gateway", "http://127.0.0.1:9", "--token", "t"]) == 2
    err = capsys.readouterr().err
    assert "cases.jsonl line 2, field input: an input must be a string or a JSON object, got int" in err
    assert "cases.jsonl line 21, field input" in err
    assert "cases.jsonl line 22" not in err  # 20 problems shown, then a count
    assert "… and 5 more" in err


def test_judges_given_on_the_command_line_are_read_strictly_too() -> None:
    with pytest.raises(SpecFileError) as info:
        load_judges('[{"kind": "regex", "id": "r", "patern": "x"}]')
    assert info.value.problems == [("$[0].patern", "unknown field; did you mean `pattern`?")]
