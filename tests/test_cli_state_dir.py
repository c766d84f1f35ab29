"""Which stack a command talks to when `--dir` is not given: `$EVALBUS_DIR`, else the `.evalbus`
of the working directory or of the nearest folder above it that holds a stack's endpoints (as git
finds `.git`), so `evalbus init my-eval && cd my-eval && evalbus run suite.yaml` reaches the stack
`evalbus up` started one folder up. `evalbus up` itself starts one in the working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalbus.cli import build_parser
from evalbus.cli.connection import TargetError, gateway_target
from evalbus.cli.options import default_state_dir, find_state_dir
from evalbus.infra.endpoints import Endpoints, save_endpoints


def stack_at(folder: Path, gateway: str) -> Path:
    """A `.evalbus` in `folder` as `evalbus up` leaves it: endpoints naming the gateway, a token."""
    state = folder / ".evalbus"
    state.mkdir(parents=True)
    (state / "token").write_text(f"token-of-{gateway}\n")
    save_endpoints(state, Endpoints(gateway=gateway, token_file=str(state / "token")))
    return state


@pytest.fixture(autouse=True)
def no_env_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EVALBUS_DIR", raising=False)


def parsed_dir(*argv: str) -> Path:
    args = build_parser().parse_args(list(argv))
    assert isinstance(args.dir, Path)
    return args.dir


def test_a_command_in_a_subfolder_talks_to_the_stack_of_the_folder_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = stack_at(tmp_path, "http://127.0.0.1:1")
    inner = tmp_path / "my-eval" / "data"
    inner.mkdir(parents=True)
    monkeypatch.chdir(inner)
    for argv in (("run", "suite.yaml"), ("status",), ("down",), ("tail", "b1")):
        assert parsed_dir(*argv) == state, argv
    target = gateway_target(parsed_dir("run", "suite.yaml"), None, None)
    assert (target.url, target.token) == ("http://127.0.0.1:1", "token-of-http://127.0.0.1:1")
    # `up` starts (or finds) a stack of this folder, never a parent's
    assert parsed_dir("up") == Path(".evalbus")


def test_the_nearest_stack_wins_and_the_working_directory_s_own_stays_relative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack_at(tmp_path, "http://127.0.0.1:1")
    nearer = stack_at(tmp_path / "team", "http://127.0.0.1:2")
    (tmp_path / "team" / "suite").mkdir()
    monkeypatch.chdir(tmp_path / "team" / "suite")
    assert parsed_dir("status") == nearer
    monkeypatch.chdir(tmp_path / "team")
    assert parsed_dir("status") == Path(".evalbus")
    assert find_state_dir(tmp_path / "team" / "suite") == nearer


def test_a_folder_without_endpoints_is_not_a_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = stack_at(tmp_path, "http://127.0.0.1:1")
    (tmp_path / "sub" / ".evalbus").mkdir(parents=True)  # a folder of that name, no stack in it
    monkeypatch.chdir(tmp_path / "sub")
    assert parsed_dir("status") == state


def test_evalbus_dir_and_dir_come_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stack_at(tmp_path, "http://127.0.0.1:1")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("EVALBUS_DIR", str(elsewhere))
    assert parsed_dir("status") == elsewhere
    assert default_state_dir() == elsewhere
    assert parsed_dir("status", "--dir", "x") == Path("x")


def test_no_stack_here_or_above_leaves_the_working_directory_s_and_says_how_to_point_at_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    assert find_state_dir() is None
    assert parsed_dir("status") == Path(".evalbus")
    with pytest.raises(TargetError, match=r"evalbus is not up in \.evalbus: point at the folder of a running stack"):
        gateway_target(parsed_dir("run", "suite.yaml"), None, None)
