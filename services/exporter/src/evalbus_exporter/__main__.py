"""Entry point: python -m evalbus_exporter."""


def main() -> None:
    raise SystemExit(0)
