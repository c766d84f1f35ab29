"""The secret store: specs name secrets, values are resolved here at use and never published,
logged or stored.

A secret named `mlflow-token` is read from the environment variable `EVALBUS_SECRET_MLFLOW_TOKEN`
(upper-cased, every non-alphanumeric character replaced by `_`) or, failing that, from the file
`$EVALBUS_SECRETS_DIR/mlflow-token` (trailing newline stripped).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

_NON_ALNUM = re.compile(r"[^A-Za-z0-9]")


class MissingSecretError(LookupError):
    """A secret the spec names is not in the store; its value is never guessed or left empty."""

    def __init__(self, name: str) -> None:
        super().__init__(f"secret {name!r} is not set (env {env_name(name)} or a file in EVALBUS_SECRETS_DIR)")
        self.name = name


class SecretValue:
    """A resolved secret: `str()` and `repr()` never show the value; `.reveal()` does."""

    __slots__ = ("_value", "name")

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self._value = value

    def reveal(self) -> str:
        """The value, for the one place that sends it (a header, a child's environment)."""
        return self._value

    def __repr__(self) -> str:
        return f"SecretValue({self.name!r}, '**********')"

    __str__ = __repr__


def env_name(name: str) -> str:
    """Environment variable that holds secret `name`."""
    return "EVALBUS_SECRET_" + _NON_ALNUM.sub("_", name).upper()


class SecretStore:
    """Resolves secret names from an environment mapping and an optional directory of files."""

    def __init__(self, environ: Mapping[str, str] | None = None, directory: Path | None = None) -> None:
        self._environ = os.environ if environ is None else environ
        if directory is None and self._environ.get("EVALBUS_SECRETS_DIR"):
            directory = Path(self._environ["EVALBUS_SECRETS_DIR"])
        self._directory = directory

    def get(self, name: str) -> SecretValue | None:
        """The secret, or None when it is not set."""
        value = self._environ.get(env_name(name))
        if value is None and self._directory is not None:
            path = self._directory / name
            if "/" not in name and path.is_file():
                value = path.read_text().rstrip("\n")
        return None if value is None else SecretValue(name, value)

    def require(self, name: str) -> SecretValue:
        """The secret, or `MissingSecretError`."""
        found = self.get(name)
        if found is None:
            raise MissingSecretError(name)
        return found
