"""Entry point: `python -m evalbus_dispatcher` (or `evalbus-dispatcher`)."""

from evalbus_runtime import Service, ServiceSettings, load_settings, run_service


def main() -> None:
    """Run the dispatcher until SIGTERM."""
    settings = load_settings(ServiceSettings, "dispatcher")

    def build(service: Service) -> None:
        del service  # stage wiring lands with the pipeline

    run_service(settings, build)


if __name__ == "__main__":
    main()
