"""Options several subcommands share."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from evalbus.infra.endpoints import endpoints_path

DEFAULT_DIR = ".evalbus"
"""State folder of the local stack, relative to the working directory."""

DIR_ENV = "EVALBUS_DIR"
"""The state folder when `--dir` is not given."""


def find_state_dir(start: Path | None = None) -> Path | None:
    """The `.evalbus` of the nearest folder, from `start` (the working directory) up to the root,
    that holds a stack's endpoints — as git finds `.git`: a command run in a subfolder of the one
    `evalbus up` ran in (the folder `evalbus init` wrote) talks to that stack. None when no folder
    does. The working directory's own is returned as the relative `.evalbus`."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / DEFAULT_DIR
        if endpoints_path(candidate).is_file():
            return Path(DEFAULT_DIR) if folder == here and start is None else candidate
    return None


def default_state_dir(*, search_parents: bool = True) -> Path:
    """`$EVALBUS_DIR`; else (with `search_parents`) the nearest folder's stack (`find_state_dir`);
    else `.evalbus` in the working directory."""
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit)
    found = find_state_dir() if search_parents else None
    return found if found is not None else Path(DEFAULT_DIR)


def add_dir_option(parser: argparse.ArgumentParser, *, search_parents: bool = True) -> None:
    """`--dir`: the state folder (`EVALBUS_DIR`; else the `.evalbus` of the working directory or,
    with `search_parents`, of the nearest folder above it that holds a stack's endpoints, running
    or stopped; `evalbus up` starts one here instead)."""
    where = "$EVALBUS_DIR, else the nearest .evalbus here or above" if search_parents else "$EVALBUS_DIR or .evalbus"
    parser.add_argument(
        "--dir",
        type=Path,
        default=default_state_dir(search_parents=search_parents),
        help=f"state folder of the local stack (default: {where})",
    )
