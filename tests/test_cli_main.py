"""`evalbus.cli.main`: what every command shares — a mistyped flag answered by the command's own
parser (its usage, not the top level's), and a reader that leaves early (`evalbus status | head -3`)
ending the command quietly, with no traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from evalbus.cli import EXIT_BROKEN_PIPE, main

pytestmark = pytest.mark.unit


def test_a_mistyped_flag_shows_the_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "suite.yaml", "--jsn"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: evalbus run ")
    assert "evalbus run: error: unrecognized arguments: --jsn" in err
    with pytest.raises(SystemExit):
        main(["baseline", "show", "s1", "--nope"])
    assert capsys.readouterr().err.startswith("usage: evalbus baseline show ")


def test_a_reader_that_leaves_early_ends_the_command_quietly() -> None:
    script = textwrap.dedent(
        """
        import argparse, sys
        import evalbus.cli as cli

        def chatty(_: argparse.Namespace) -> int:
            for i in range(200_000):
                print("line", i)
            return 0

        def parser() -> argparse.ArgumentParser:
            top = argparse.ArgumentParser(prog="evalbus")
            commands = top.add_subparsers(dest="command", required=True)
            commands.add_parser("chatty").set_defaults(run=chatty)
            return top

        cli.build_parser = parser
        sys.exit(cli.main(["chatty"]))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "line 0\n"
    proc.stdout.close()  # as `head -1` does
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert err == ""
    assert proc.returncode == EXIT_BROKEN_PIPE == 141
