"""Entry point: `python -m evalbus_exporter` (or `evalbus-exporter`)."""

from evalbus_exporter.service import ExporterSettings, build_exporter
from evalbus_runtime import Service, load_settings, run_service


def main() -> None:
    """Run the exporter until SIGTERM."""
    settings = load_settings(ExporterSettings, "exporter")

    def build(service: Service) -> None:
        build_exporter(service, settings)

    run_service(settings, build)


if __name__ == "__main__":
    main()
