"""Entry point: python -m evalbus_judge."""


def main() -> None:
    raise SystemExit(0)
