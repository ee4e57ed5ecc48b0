"""What every `treadle-server` admin command shares: where it prints, how it fails, and which
database it works on.

Admin commands talk to the database directly, so the one mistake they must not make is to work
on a database other than the operator's: with no `TREADLE_DATABASE_URL` they would quietly open
the embedded SQLite file under the data directory. They refuse that whenever distributed
settings show a shared database is meant, and each command that writes names its database on
stderr before it writes.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from sqlalchemy.engine import make_url

from core.db import Database
from core.settings import Settings

# No emoji codes: ids such as `<session>:train:0` hold them (`:train:`).
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)


def fail(message: str) -> typer.Exit:
    """Print `message` as an error; the caller raises what this returns (exit code 2)."""
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code=2)


def print_table(table: Table) -> None:
    """Print a table at its natural width even where the terminal is narrower: the terminal then
    wraps its lines, but no cell is cut, folded or ellipsized (`admin keys revoke` and `admin
    tenants update` need ids and names whole). Rich would shrink the widest columns first, ids
    and timestamps included, whatever their shortest width."""
    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    (console if needed <= console.width else Console(width=needed, emoji=False)).print(table)


def database_name(settings: Settings) -> str:
    """The settings' database as an operator recognises it: a SQLite file's path, or the URL
    with its password masked."""
    url = make_url(settings.resolved_database_url)
    if url.get_backend_name() == "sqlite":
        embedded = " (embedded)" if settings.database_url is None else ""
        return f"SQLite file {url.database}{embedded}"
    return url.render_as_string(hide_password=True)


def require_database_url(settings: Settings) -> None:
    """Refuse the embedded SQLite file when distributed settings are present: the operator
    meant the shared database and forgot `TREADLE_DATABASE_URL`."""
    if settings.database_url is not None:
        return
    present = [
        name
        for name, value in (
            ("TREADLE_REDIS_URL", settings.redis_url),
            ("TREADLE_SERVER_SECRET", settings.server_secret),
        )
        if value is not None
    ]
    if present:
        raise fail(
            f"{' and '.join(present)} {'is' if len(present) == 1 else 'are'} set but "
            "TREADLE_DATABASE_URL is not: set TREADLE_DATABASE_URL to the database the API uses. "
            "Admin commands do not fall back to the embedded SQLite file "
            f"{make_url(settings.resolved_database_url).database} while distributed settings are "
            "present; unset them to administer embedded mode"
        )


def announce_writes(settings: Settings) -> None:
    """Before a command writes: refuse a fallback to the embedded file, then name the database
    on stderr (one line)."""
    require_database_url(settings)
    err_console.print(f"database: {database_name(settings)}", markup=False, soft_wrap=True)


def open_database(settings: Settings, *, writes: bool = False) -> Database:
    """The database an admin command works on, ready for use; a command that `writes` first
    names it (`announce_writes`)."""
    from api import dbschema

    if writes:
        announce_writes(settings)
    else:
        require_database_url(settings)
    return dbschema.open_database(settings)
