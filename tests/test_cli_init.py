"""`evalbus init`: the starter evaluation it writes is a valid suite whose harness is present, its
agent answers the arithmetic cases and prints well-formed trace events, and existing files are
left alone. Run end to end through the stack in tests/test_cli_run.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest

from evalbus.cli import main
from evalbus.cli.init import FILES
from evalbus.cli.suite_file import harness_warnings, load_suite
from evalbus_contracts import TraceEvent

pytestmark = [pytest.mark.unit]


def test_init_writes_a_valid_suite_whose_agent_answers_its_cases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "first"
    assert main(["init", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)
    assert "evalbus run suite.yaml" in capsys.readouterr().out
    spec = load_suite(folder / "suite.yaml")  # strict: every key known, the dataset read
    assert harness_warnings(spec) == []
    assert [c.id for c in spec.suite.cases] == ["add-1", "add-2", "mul-1", "sub-1", "capital"]
    decoder = msgspec.json.Decoder(TraceEvent)
    answers = {}
    for case in spec.suite.cases:
        done = subprocess.run(
            list(spec.harness.command),
            input=case.input,
            capture_output=True,
            text=True,
            cwd=folder,
            check=True,
            timeout=30,
        )
        lines = done.stdout.splitlines()
        for line in lines[:-1]:
            assert line.startswith("EVALBUS_EVENT ")
            decoder.decode(line.removeprefix("EVALBUS_EVENT "))
        answers[case.id] = lines[-1]
    assert answers == {"add-1": "4", "add-2": "8", "mul-1": "42", "sub-1": "6", "capital": "I don't know"}
    assert {c.id: c.expected for c in spec.suite.cases}["capital"] == "Canberra"  # one case to fail, on purpose


def test_init_leaves_existing_files_alone_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "suite.yaml").write_text("mine\n")
    assert main(["init", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"evalbus init: {tmp_path} has an evaluation already (suite.yaml exists); nothing written: "
        "run it (evalbus run), init another folder, or --force to overwrite\n"
    )
    assert (tmp_path / "suite.yaml").read_text() == "mine\n"
    assert not (tmp_path / "agent.py").exists()
    assert main(["init", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "suite.yaml").read_text() == FILES["suite.yaml"]
    (tmp_path / "file").write_text("x")
    assert main(["init", str(tmp_path / "file")]) == 2


def test_a_missing_harness_program_or_script_is_warned_of(tmp_path: Path) -> None:
    assert main(["init", str(tmp_path)]) == 0
    spec = load_suite(tmp_path / "suite.yaml")
    assert harness_warnings(spec) == []
    assert harness_warnings(spec, path="/nonexistent") == ["the harness program 'python3' is not on PATH"]
    (tmp_path / "agent.py").unlink()
    gone = load_suite(tmp_path / "suite.yaml")
    assert harness_warnings(gone) == ["the harness's 'agent.py' is neither next to the suite file nor in harness.files"]
    missing = msgspec.structs.replace(gone, harness=msgspec.structs.replace(gone.harness, command=("no-such-agent-x",)))
    assert harness_warnings(missing) == ["the harness program 'no-such-agent-x' is not on PATH"]
    absent = msgspec.structs.replace(gone, harness=msgspec.structs.replace(gone.harness, command=("/no/such/agent",)))
    assert harness_warnings(absent) == ["the harness program '/no/such/agent' does not exist"]
    inline = msgspec.structs.replace(
        gone, harness=msgspec.structs.replace(gone.harness, command=("sh", "run.sh"), files={"run.sh": "echo 4"})
    )
    assert harness_warnings(inline) == []  # written into the workdir
