"""Entry point: `python -m evalbus_judge` (or `evalbus-judge`)."""

from evalbus_judge.service import JudgeSettings, build_judge
from evalbus_runtime import Service, load_settings, run_service


def main() -> None:
    """Run the judge service until SIGTERM."""
    settings = load_settings(JudgeSettings, "judge")

    def build(service: Service) -> None:
        build_judge(service, settings)

    run_service(settings, build)


if __name__ == "__main__":
    main()
