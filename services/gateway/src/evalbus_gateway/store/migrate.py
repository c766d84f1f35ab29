"""Schema migrations: versioned SQL files applied once, safely from several replicas at once.

Files live in `store/migrations/` as `NNNN_name.sql` and are applied in version order. Each applied
version is recorded in `schema_migrations` with the SHA-256 of its text; a file that changed after
it was applied is an error, never silently re-run. Everything happens in one transaction holding
`pg_advisory_xact_lock(MIGRATION_LOCK)`, so gateway replicas starting together serialise here: the
first applies, the others wait, then find nothing to do.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from evalbus_gateway.store.connections import acquire
from evalbus_gateway.store.errors import MigrationError

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Database

MIGRATION_LOCK = 0x65766C_6D696772  # "evl" "migr": the advisory lock key of migrations
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    """One SQL file."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """SHA-256 of the file's text."""
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


def load_migrations() -> list[Migration]:
    """The migrations shipped with the package, in version order."""
    found: list[Migration] = []
    for entry in resources.files("evalbus_gateway.store.migrations").iterdir():
        match = _FILE.match(entry.name)
        if match is None:
            continue
        found.append(Migration(version=int(match[1]), name=match[2], sql=entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a version: {versions}")
    return found


async def migrate(db: Database) -> list[int]:
    """Bring the schema up to date; return the versions applied by this call (empty when current)."""
    migrations = load_migrations()
    applied_now: list[int] = []
    async with acquire(db) as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        await conn.execute(
            """
            CREATE TABLE IF NOT EXISTS schema_migrations (
                version    integer PRIMARY KEY,
                name       text        NOT NULL,
                checksum   text        NOT NULL,
                applied_at timestamptz NOT NULL DEFAULT now()
            )
            """
        )
        rows = await conn.fetch("SELECT version, checksum FROM schema_migrations")
        done: dict[int, str] = {int(r["version"]): str(r["checksum"]) for r in rows}
        for migration in migrations:
            previous = done.get(migration.version)
            if previous is not None:
                if previous != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.version:04d}_{migration.name} changed after it was applied"
                    )
                continue
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                migration.version,
                migration.name,
                migration.checksum,
            )
            applied_now.append(migration.version)
    return applied_now
