"""Entry point: python -m evalbus_gateway."""


def main() -> None:
    raise SystemExit(0)
