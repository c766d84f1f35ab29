"""Entry point: python -m evalbus_dispatcher."""


def main() -> None:
    raise SystemExit(0)
