"""Entry point: `python -m evalbus_gateway` (or `evalbus-gateway`)."""

from evalbus_gateway.api.auth import TokenTable
from evalbus_gateway.errors import GatewayError
from evalbus_gateway.service import GatewaySettings, build_gateway
from evalbus_runtime import Service, SettingsError, load_settings, run_service


def main() -> None:
    """Run the gateway (HTTP API, recorder, finalisation) until SIGTERM."""
    try:
        settings = load_settings(GatewaySettings, "gateway")
        tokens = TokenTable.from_settings(settings.admin_token, settings.tokens_file)
        if not settings.database_url:
            raise GatewayError("the gateway needs a database: set GATEWAY_DATABASE_URL or DATABASE_URL")
    except (SettingsError, GatewayError) as e:
        raise SystemExit(f"evalbus-gateway: {e}") from None

    def build(service: Service) -> None:
        build_gateway(service, settings, tokens=tokens)

    run_service(settings, build)


if __name__ == "__main__":
    main()
