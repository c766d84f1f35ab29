"""The in-job runner: what a case image runs on a cluster backend (`python -m evalbus.runner`).

The image contract (docs/backends.md): the image has Python 3.11 with the `evalbus` package (or
only `evalbus-contracts` and this package), `/bin/sh`, and the harness's own program. The
dispatcher starts one job per case attempt with the job spec (`evalbus_contracts.runner.RunnerJob`)
in `EVALBUS_JOB` or a `--job` file; the runner writes the harness files into its workdir, runs the
harness (input on stdin and in `EVALBUS_INPUT_FILE`, killed past its timeout), tees its output to
the job log as record lines (`evalbus_contracts.runner`), runs the compute graders' commands in the
same workdir, records the workdir's git changes, and exits — the job ends at the last instruction
that needs it. When the job spec asks (`hold_s`, Kubernetes) and the harness declared artifact
files, it first holds the job alive (a `holding` record) until the dispatcher has read them. With
`live` in the job spec it publishes the live log and trace straight to NATS as well (`live.py`).
"""

from evalbus.runner.run import run_job

__all__ = ["run_job"]
