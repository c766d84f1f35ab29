"""Entry point: `python -m evalbus_dispatcher` (or `evalbus-dispatcher`)."""

from evalbus_dispatcher.backends import orphans
from evalbus_dispatcher.service import DispatcherSettings, build_dispatcher
from evalbus_runtime import Service, load_settings, run_service


def main() -> None:
    """Run the dispatcher until SIGTERM."""
    settings = load_settings(DispatcherSettings, "dispatcher")
    # The daemons harnesses fork become this process's children, killed with their sandboxes
    # (`orphans`). Process-wide, so only here: a dispatcher built inside another program (a
    # test) leaves that program's orphans alone.
    orphans.become_subreaper()

    def build(service: Service) -> None:
        build_dispatcher(service, settings)

    run_service(settings, build)


if __name__ == "__main__":
    main()
