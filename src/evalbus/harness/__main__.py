"""`python -m evalbus.harness module:function`: serve a harness function over the worker protocol
on stdin/stdout until stdin ends."""

from __future__ import annotations

import sys

from evalbus.harness.sdk import load_target, serve


def main(argv: list[str]) -> int:
    """Load the target named in `argv` and serve it; 2 when it cannot be loaded."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m evalbus.harness module:function (or /path/to/file.py:function)\n")
        return 2
    try:
        target = load_target(argv[0])
    except (ValueError, TypeError, ImportError) as e:
        sys.stderr.write(f"evalbus.harness: cannot load {argv[0]}: {e}\n")
        return 2
    return serve(target)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
