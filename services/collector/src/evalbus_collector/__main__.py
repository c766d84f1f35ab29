"""Entry point: `python -m evalbus_collector` (or `evalbus-collector`)."""

from evalbus_collector.service import CollectorSettings, build_collector
from evalbus_runtime import Service, load_settings, run_service


def main() -> None:
    """Run the collector until SIGTERM."""
    settings = load_settings(CollectorSettings, "collector")

    def build(service: Service) -> None:
        build_collector(service, settings)

    run_service(settings, build)


if __name__ == "__main__":
    main()
