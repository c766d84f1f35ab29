"""A harness that forks a daemon and exits: the daemon escapes its process group, so killing the
group at release does not end it. With `adopt_orphans` (as the dispatcher service runs) the
dispatcher is the daemon's subreaper and kills it with the sandbox; without, it survives — the
control case, which shows the test can see a leak. Each scenario runs in a process of its own
(the subreaper flag is process-wide; pytest's process must not adopt every orphan of the suite)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DAEMONIZING_AGENT = textwrap.dedent(
    """
    import os, sys, time
    pidfile = sys.argv[1]
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.chdir("/")  # a proper daemon leaves the workdir
            with open(pidfile + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(pidfile + ".tmp", pidfile)
            time.sleep(float(sys.argv[2]))
            os._exit(0)
        os._exit(0)
    os.wait()
    while not os.path.exists(pidfile):
        time.sleep(0.01)
    print("EVALBUS_RESULT " + '{"answer": "forked"}')
    """
)

SCENARIO = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from pathlib import Path
    from evalbus_contracts import CasePlan, CaseRequested, CaseSpec, CommandHarness
    from evalbus_dispatcher.backends import orphans
    from evalbus_dispatcher.backends.local import LocalBackend

    adopt, agent, pidfile, root, daemon_s = sys.argv[1] == "1", sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]

    def alive(pid):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    async def out(stream, line):
        pass

    async def main():
        backend = LocalBackend(slots=1, root=Path(root), adopt_orphans=adopt)
        job = CaseRequested(
            batch_id="b1", case_id="c1", run_id="evb-b1-c1", case=CaseSpec(id="c1", input="go"),
            harness=CommandHarness(id="daemonizer", command=(sys.executable, agent, pidfile, daemon_s)),
            plan=CasePlan(),
        )
        sandbox = await backend.provision(job)
        run = await sandbox.run_harness(out)
        pid = int(Path(pidfile).read_text())
        adopted = pid in orphans.children()
        alive_before = alive(pid)
        result = {"exit_code": run.exit_code, "adopted": adopted, "alive_before_release": alive_before, "pid": pid}
        if float(daemon_s) < 1:  # the daemon exits on its own: reaped once it has been a zombie
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            result["zombie_seen"] = pid in orphans.children()
            while pid in orphans.children() and time.monotonic() < deadline:
                orphans.reap_exited((), grace_s=0.2)
                time.sleep(0.05)
            result["still_a_child"] = pid in orphans.children()
        await sandbox.release()
        result["alive_after_release"] = alive(pid)
        result["zombie_children"] = [c for c in orphans.children() if not alive(c)]
        print(json.dumps(result))

    asyncio.run(main())
    """
)


def run_scenario(tmp_path: Path, *, adopt: bool, daemon_s: float = 300.0) -> dict[str, object]:
    agent = tmp_path / "agent.py"
    agent.write_text(DAEMONIZING_AGENT)
    pidfile = tmp_path / "daemon.pid"
    root = tmp_path / "sandboxes"
    root.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO, "1" if adopt else "0", str(agent), str(pidfile), str(root), str(daemon_s)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_daemon_a_harness_forks_is_killed_with_its_sandbox(tmp_path: Path) -> None:
    result = run_scenario(tmp_path, adopt=True)
    assert result["exit_code"] == 0
    assert result["adopted"] is True  # re-parented to the dispatcher, not to init
    assert result["alive_before_release"] is True
    assert result["alive_after_release"] is False
    assert result["zombie_children"] == []  # killed and reaped


def test_without_adoption_the_daemon_outlives_its_sandbox(tmp_path: Path) -> None:
    result = run_scenario(tmp_path, adopt=False)
    pid = int(str(result["pid"]))
    try:
        assert result["adopted"] is False
        assert result["alive_after_release"] is True  # the leak the adoption closes
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_daemon_that_exits_on_its_own_is_reaped(tmp_path: Path) -> None:
    result = run_scenario(tmp_path, adopt=True, daemon_s=0.3)
    assert result["adopted"] is True
    assert result["zombie_seen"] is True  # exited, nobody had waited for it
    assert result["still_a_child"] is False


def test_this_test_process_never_became_a_subreaper() -> None:
    """Only the dispatcher's entry point adopts orphans: a dispatcher or backend built inside
    another program (this test run builds several) must leave that program's orphans to init,
    or every service the tests kill would leave its children as zombies here."""
    from evalbus_dispatcher.backends import orphans

    assert orphans.is_subreaper() is False


def test_importing_the_entry_point_adopts_nothing_until_it_runs() -> None:
    """The flag is set by `main()` (end to end in tests/test_pipeline_daemon_harness.py), not by an
    import; and the kernel reports it once set."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from evalbus_dispatcher.backends import orphans; import evalbus_dispatcher.__main__ as m; "
            "print(orphans.is_subreaper(), orphans.become_subreaper(), orphans.is_subreaper())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.split() == ["False", "True", "True"]
