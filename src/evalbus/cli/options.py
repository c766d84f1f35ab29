"""Options several subcommands share."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_DIR = ".evalbus"
"""State folder of the local stack, relative to the working directory."""


def add_dir_option(parser: argparse.ArgumentParser) -> None:
    """`--dir`: the state folder (`EVALBUS_DIR`, else `.evalbus`)."""
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("EVALBUS_DIR", DEFAULT_DIR)),
        help="state folder of the local stack (default: $EVALBUS_DIR or .evalbus)",
    )
