"""`evalbus online …`: online suites from the command line, over the gateway's API.

    evalbus online apply FILE…     define (or replace) the suites in YAML/JSON files
    evalbus online ls              every suite
    evalbus online show ID         a suite: rolling scores, fate counts, recent judged observations
    evalbus online rm ID           stop sampling for a suite
    evalbus online stats [--suite ID]
    evalbus online why TRACE_ID    every fate of a trace, per suite, with its reason

A file holds one suite, a list of suites, or `{suites: [...]}`. The gateway validates each suite;
a refused one is printed with its file and the offending field, and the command exits 2. `--json`
prints the API's answer as JSON. Exit codes: 0 done, 1 the gateway failed or a suite is unknown,
2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import yaml

from evalbus.cli.connection import GatewayTarget, add_gateway_options
from evalbus.cli.follow import (
    EXIT_BAD_INPUT,
    EXIT_FINALIZED,
    EXIT_NOT_SUCCEEDED,
    api_failure,
    error_line,
    resolve_target,
)
from evalbus.cli.suite_file import SpecFileError, convert_as
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_contracts import OnlineSuiteSpec, to_builtins


class SuiteFileError(Exception):
    """A suites file that cannot be read as suites."""


def load_suites(path: Path) -> list[OnlineSuiteSpec]:
    """The suites in a YAML or JSON file."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise SuiteFileError(f"{path}: cannot read it: {e}") from None
    if isinstance(doc, dict) and "suite" in doc and "harness" in doc:
        raise SuiteFileError(
            f"{path}: this is a batch suite (suite:, harness:) for `evalbus run`; an online suite names "
            "id:, target: and judges: (docs/online.md)"
        )
    items: Any = doc.get("suites", doc) if isinstance(doc, dict) else doc
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        raise SuiteFileError(f"{path}: expected a suite, a list of suites or {{suites: [...]}}")
    suites = []
    for i, item in enumerate(items):
        root = f"$[{i}]" if len(items) > 1 else "$"
        try:
            suites.append(convert_as(item, OnlineSuiteSpec, str(path), root))
        except SpecFileError as e:  # every unknown key with its nearest known one, else the first bad field
            details = "; ".join(f"{field}: {message}" for field, message in e.problems)
            raise SuiteFileError(f"{path}: {details}") from None
    return suites


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `online` parser and its subcommands."""
    parser = commands.add_parser(
        "online",
        help="online suites: judge a sample of production traces",
        description="Define, list and read online suites, and ask why a trace was (not) judged.",
    )
    sub = parser.add_subparsers(dest="online_command", required=True, metavar="SUBCOMMAND")
    apply = sub.add_parser("apply", help="define (or replace) the suites in YAML/JSON files")
    apply.add_argument("files", nargs="+", type=Path, metavar="FILE")
    sub.add_parser("ls", help="every online suite")
    show = sub.add_parser("show", help="a suite: rolling scores, fate counts, recent judged observations")
    show.add_argument("suite")
    rm = sub.add_parser("rm", help="stop sampling for a suite")
    rm.add_argument("suite")
    stats = sub.add_parser("stats", help="observations per suite, fate and reason")
    stats.add_argument("--suite", default=None)
    why = sub.add_parser("why", help="every fate of a trace, per suite, with its reason")
    why.add_argument("trace_id")
    for each in (apply, *(sub.choices[name] for name in ("ls", "show", "rm", "stats", "why"))):
        each.add_argument("--json", action="store_true", help="print the API's answer as JSON")
        add_gateway_options(each)
        each.set_defaults(run=run)


def _print_json(value: Any) -> None:
    print(json.dumps(to_builtins(value), indent=2, default=str))


def _fmt(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if percent else f"{value:.3g}"


async def _call(target: GatewayTarget, args: argparse.Namespace) -> int:
    async with GatewayClient(target.url, target.token) as gw:
        command = args.online_command
        if command == "apply":
            return await _apply(gw, args.files, json_output=args.json)
        if command == "ls":
            listed = await gw.online_suites()
            if args.json:
                _print_json(listed)
                return EXIT_FINALIZED
            if not listed.items:
                print("no online suite")
            for item in listed.items:
                s = item.suite
                target_text = ", ".join(
                    f"{k}={v}"
                    for k, v in (
                        ("service", s.target.service),
                        ("agent", s.target.agent),
                        ("workflow", s.target.workflow),
                    )
                    if v
                )
                attrs = "".join(f" {k}={v}" for k, v in sorted(s.target.attributes.items()))
                judges = ", ".join(j.id for j in s.judges)
                print(f"{s.id:<24} ratio {s.sample_ratio:<6g} {target_text}{attrs}  judges: {judges}")
            return EXIT_FINALIZED
        if command == "show":
            detail = await gw.online_suite(args.suite)
            if args.json:
                _print_json(detail)
                return EXIT_FINALIZED
            print(
                f"online suite {detail.suite.id}  ratio {detail.suite.sample_ratio:g}  applied by {detail.applied_by}"
            )
            print(f"\n{'METRIC':<24} {'WINDOW':<6} {'COUNT':>6}  {'MEAN':<8} PASS RATE")
            for m in detail.metrics:
                print(f"{m.metric:<24} {m.window:<6} {m.count:>6}  {_fmt(m.mean):<8} {_fmt(m.pass_rate, True)}")
            print("\nfates")
            for c in detail.fates:
                print(f"  {c.fate:<14} {c.reason:<18} {c.count}")
            print("\nrecently judged")
            for r in detail.recent:
                print(f"  {r.observation_id}  {r.judged_at}  {r.trajectory}")
            return EXIT_FINALIZED
        if command == "rm":
            deleted = await gw.delete_online_suite(args.suite)
            if args.json:
                _print_json(deleted)
            else:
                print(f"online suite {deleted.suite_id} deleted")
            return EXIT_FINALIZED
        if command == "stats":
            stats = await gw.online_stats(args.suite)
            if args.json:
                _print_json(stats)
                return EXIT_FINALIZED
            print(f"{'SUITE':<24} {'FATE':<14} {'REASON':<18} COUNT")
            for c in stats.counts:
                print(f"{c.suite_id or '-':<24} {c.fate:<14} {c.reason:<18} {c.count}")
            return EXIT_FINALIZED
        answer = await gw.observation_fates(args.trace_id)
        if args.json:
            _print_json(answer)
            return EXIT_FINALIZED
        if answer.status == "unknown":
            print(f"trace {answer.trace_id}: unknown — evalbus never received it")
            return EXIT_NOT_SUCCEEDED
        for f in answer.fates:
            detail_text = f" ({f.detail})" if f.detail else ""
            print(f"{f.at}  {f.suite_id or '-':<24} {f.fate:<14} {f.reason}{detail_text}")
        return EXIT_FINALIZED


async def _apply(gw: GatewayClient, files: list[Path], *, json_output: bool) -> int:
    loaded: list[tuple[Path, OnlineSuiteSpec]] = []
    for path in files:
        try:
            loaded.extend((path, suite) for suite in load_suites(path))
        except SuiteFileError as e:
            error_line(f"evalbus online apply: {e}")
            return EXIT_BAD_INPUT
    code = EXIT_FINALIZED
    for path, suite in loaded:
        try:
            view = await gw.apply_online_suite(suite)
        except ApiRequestError as e:
            failure, message = api_failure(e, f"{path}: suite {suite.id!r} refused")
            error_line(message)
            code = max(code, failure)
            continue
        if json_output:
            _print_json(view)
        else:
            print(f"online suite {view.suite.id} applied (ratio {view.suite.sample_ratio:g})")
    return code


def run(args: argparse.Namespace) -> int:
    """Run one `online` subcommand; the exit code."""
    target = resolve_target(f"online {args.online_command}", args.dir, args.gateway, args.token)
    if target is None:
        return EXIT_NOT_SUCCEEDED
    try:
        return asyncio.run(_call(target, args))
    except ApiRequestError as e:
        code, message = api_failure(e, f"evalbus online {args.online_command}")
        error_line(message)
        return code
