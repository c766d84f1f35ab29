"""A harness that forks a daemon (fork, setsid, fork, exit) through the real dispatcher service:
the run succeeds, and once its sandbox is released the daemon is gone — the dispatcher's entry
point makes it the daemon's subreaper, so it finds and kills it."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from evalbus.testing.pipeline import Pipeline, eventually, open_pipeline
from evalbus.testing.reliability import lost_and_duplicated, report, row
from evalbus_contracts import AnswerMatchGrader, BatchSpec, CaseSpec, CommandHarness, SuiteSpec, batch_run_id

STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")

pytestmark = pytest.mark.e2e

AGENT = """\
import os, sys, time
pidfile = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.chdir("/")
        with open(pidfile + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pidfile + ".tmp", pidfile)
        time.sleep(300)
        os._exit(0)
    os._exit(0)
os.wait()
while not os.path.exists(pidfile):
    time.sleep(0.01)
print("forked")
"""


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    async with open_pipeline(pg_admin_url, tmp_path_factory.mktemp("daemon")) as p:
        yield p


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def test_a_daemon_forked_by_a_harness_does_not_outlive_its_run(pipeline: Pipeline, tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    spec = BatchSpec(
        suite=SuiteSpec(
            id="daemon",
            cases=(CaseSpec(id="c1", input="go", expected="forked", graders=(AnswerMatchGrader(id="answer"),)),),
        ),
        harness=CommandHarness(
            id="daemonizer", command=(sys.executable, "agent.py", str(pidfile)), files={"agent.py": AGENT}
        ),
    )
    view = await pipeline.finalized(await pipeline.submit(spec))
    assert view.status == "succeeded"
    assert view.summary is not None
    assert view.summary.verdicts.passed == 1
    pid = int(pidfile.read_text())
    await eventually(lambda: not running(pid), timeout_s=10, what=f"the daemon {pid} to be killed")
    run = batch_run_id(view.batch_id, "c1")
    want: Counter[tuple[str | None, str]] = Counter({(run, kind): 1 for kind in STAGES})
    store = Counter({k: n for k, n in (await pipeline.store_counts(view.batch_id)).items() if k[1] in STAGES})
    lost, duplicated = lost_and_duplicated(want, store)
    report(
        row(
            "a harness that forks a daemon and exits: the daemon killed with its sandbox",
            load="1 case",
            faults=1,
            lost=lost,
            duplicated=duplicated,
            passed=store == want,
        )
    )
    assert store == want
