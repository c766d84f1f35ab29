"""`evalbus run <suite.yaml>`: submit a suite through the gateway, show a progress bar per stage
from the batch's event stream, then print the scorecard (`--json`: one JSON line instead). A suite
whose cases are too large to ride in the batch is uploaded as a dataset first (`evalbus.cli.upload`).

Exit codes: 0 the batch finalized `succeeded` (whatever the verdicts), 1 it failed or was
cancelled (or the gateway could not be reached), 2 bad input (the suite file or the spec, each
problem printed with its field path; a `--gate` that does not parse), 3 the batch succeeded and a
gate failed (`evalbus.cli.gates`), 4 with `--fail-on-run-errors`: a run failed to execute for a
reason that is not the agent's. Before submitting it warns (stderr) when the harness's program or
script looks missing (`harness_warnings`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from evalbus.cli.connection import GatewayTarget, add_gateway_options
from evalbus.cli.follow import (
    EXIT_BAD_INPUT,
    EXIT_FINALIZED,
    EXIT_NOT_SUCCEEDED,
    api_failure,
    error_line,
    follow,
    progress_display,
    report_spec_problems,
    resolve_target,
)
from evalbus.cli.gates import (
    EXIT_GATE_FAILED,
    GateOptionError,
    ReportFiles,
    add_gate_options,
    report_outcome,
    with_gate_options,
)
from evalbus.cli.progress import BatchProgress
from evalbus.cli.scorecard import json_line
from evalbus.cli.suite_file import SpecFileError, harness_warnings, load_suite
from evalbus.cli.upload import (
    DEFAULT_INLINE_LIMIT,
    UploadProgress,
    UploadSettingError,
    inline_limit,
    needs_upload,
    offload_cases,
)
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_api.views import RunView
from evalbus_contracts import BatchSpec, expected_runs

EXIT_RUN_ERRORS = 4
"""`--fail-on-run-errors`: a run failed to execute (the batch may have succeeded)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C: the batch goes on; only following it stopped."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `run` parser."""
    parser = commands.add_parser(
        "run",
        help="run a suite: submit, follow its progress, print the scorecard",
        description="Submit a suite file (YAML) as a batch through the gateway, draw a progress bar per stage "
        "from its event stream, then print the scorecard and the gates. Exit 0 when the batch finalized (whatever "
        "the verdicts) and every gate passed, 1 when it failed or was cancelled, 2 on bad input, 3 when a gate "
        "failed, 4 with --fail-on-run-errors when a run failed to execute.",
    )
    parser.add_argument("suite", type=Path, help="the suite file (YAML: suite, harness, judges, sinks, policy)")
    parser.add_argument(
        "--json", action="store_true", help='print only {"batch_id", "status", "summary"} as one JSON line'
    )
    parser.add_argument("--no-wait", action="store_true", help="submit and print the batch id; do not follow it")
    parser.add_argument(
        "--fail-on-run-errors",
        action="store_true",
        help="exit 4 when any run failed to execute for a reason that is not the agent's (a missing program, a spec "
        "error, the platform: failure class infra, config or harness), even if the batch succeeded",
    )
    add_gate_options(parser)
    add_gateway_options(parser)
    parser.set_defaults(run=run)


async def submit_and_follow(
    spec: BatchSpec,
    target: GatewayTarget,
    *,
    json_output: bool,
    no_wait: bool,
    files: ReportFiles = ReportFiles(),  # noqa: B008 - frozen, never mutated
    inline_max_bytes: int = DEFAULT_INLINE_LIMIT,
    fail_on_run_errors: bool = False,
) -> int:
    """Submit `spec`, follow it and print the outcome; the exit code. Cases that encode to more
    than `inline_max_bytes` bytes are uploaded as a dataset first (`evalbus.cli.upload`);
    `fail_on_run_errors`: 4 when a run failed to execute (`run_errors`), whatever the batch did."""
    async with GatewayClient(target.url, target.token) as client:
        try:
            submitted = spec
            if needs_upload(spec, inline_max_bytes):
                progress_bar = UploadProgress(len(spec.suite.cases), quiet=json_output)
                submitted = await offload_cases(client, spec, progress_bar)
            accepted = await client.submit(submitted)
        except ApiRequestError as e:
            code, message = api_failure(e, "submitting the batch failed")
            error_line(message)
            return code
        batch_id = accepted.batch_id
        total = expected_runs(spec)
        if no_wait:
            if json_output:
                print(json.dumps(json_line(batch_id, accepted.status, None)))
            else:
                print(f"batch {batch_id} submitted ({total} runs); follow it with: evalbus tail {batch_id}")
            return EXIT_FINALIZED
        if not json_output:
            print(f"batch {batch_id}: {spec.suite.id}, {total} runs  (evalbus tail {batch_id})", flush=True)
        progress = BatchProgress(batch_id, total)
        for case in spec.suite.cases:
            progress.expected.setdefault(case.id, case.expected)
        try:
            outcome = await follow(client, progress, progress_display(json_output))
        except ApiRequestError as e:
            error_line(api_failure(e, f"following batch {batch_id} failed")[1])
            error_line(f"the batch goes on: evalbus tail {batch_id}")
            return EXIT_NOT_SUCCEEDED
        except asyncio.CancelledError:  # Ctrl-C
            error_line(f"\nstopped following; batch {batch_id} goes on: evalbus tail {batch_id}")
            raise
        code = await report_outcome(client, outcome, spec.gates, json_output=json_output, out=sys.stdout, files=files)
        errors = run_errors(outcome.runs)
        if fail_on_run_errors and errors and code in (EXIT_FINALIZED, EXIT_GATE_FAILED):
            error_line(
                f"evalbus run: {len(errors)} of {len(outcome.runs)} runs failed to execute ({run_error_codes(errors)})"
            )
            return EXIT_RUN_ERRORS
        return code


def run_errors(runs: Sequence[RunView]) -> list[RunView]:
    """The runs that failed to execute for a reason that is not the agent's (`CaseFailure.run_error`)."""
    return [r for r in runs if r.failure is not None and r.failure.run_error()]


def run_error_codes(runs: Sequence[RunView]) -> str:
    """`spawn_failed × 3, provision_failed × 1`: what the run errors were, most frequent first."""
    counted = Counter(r.failure.code for r in runs if r.failure is not None)
    return ", ".join(f"{code} × {n}" for code, n in counted.most_common())


def run(args: argparse.Namespace) -> int:
    """Load the suite, submit it, follow it; the exit code."""
    try:
        spec = load_suite(args.suite)
    except SpecFileError as e:
        report_spec_problems("run", "suite", e.source, e.problems)
        return EXIT_BAD_INPUT
    try:
        spec = with_gate_options(spec, args.gate)
    except GateOptionError as e:
        error_line(f"evalbus run: --gate {e.expression!r} is not a valid gate: {e.message}")
        return EXIT_BAD_INPUT
    try:
        limit = inline_limit()
    except UploadSettingError as e:
        error_line(f"evalbus run: {e}")
        return EXIT_BAD_INPUT
    for warning in harness_warnings(spec):
        error_line(f"evalbus run: warning: {warning}; its runs will fail unless the dispatcher's machine has it")
    target = resolve_target("run", args.dir, args.gateway, args.token)
    if target is None:
        return EXIT_NOT_SUCCEEDED
    try:
        files = ReportFiles.of(args)
        return asyncio.run(
            submit_and_follow(
                spec,
                target,
                json_output=args.json,
                no_wait=args.no_wait,
                files=files,
                inline_max_bytes=limit,
                fail_on_run_errors=args.fail_on_run_errors,
            )
        )
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
