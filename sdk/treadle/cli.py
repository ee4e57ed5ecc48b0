"""The `treadle` command: look at your training runs and checkpoints, download checkpoints.

The server and key come from `--base-url` / `--api-key` (before the command, as in
`treadle --base-url URL runs`, or after it) or `TREADLE_BASE_URL` / `TREADLE_API_KEY`. Every
listing prints a table, or with `--json` one JSON document, or with `--plain` one
tab-separated line per item (no header, never wrapped). Errors print the server's message and
exit with status 1.

This module is the only one that imports typer and rich; the library itself never does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from treadle._connection import Connection
from treadle.client.rest import RestClient
from treadle.client.service import resolve_base_url, resolve_credentials
from treadle.errors import TreadleError
from treadle.types import Checkpoint

app = typer.Typer(
    name="treadle",
    help="Look at your Treadle training runs and checkpoints, and download checkpoints.",
    no_args_is_help=True,
    add_completion=False,
)
# Ids contain ":train:" and the like: no emoji codes, no markup from data.
console = Console(emoji=False, highlight=False)
errors = Console(stderr=True, emoji=False, highlight=False)

# The environment is read by the options before the command, so that one given there is not
# overridden by a variable read here.
BaseUrl = Annotated[
    str | None,
    typer.Option("--base-url", help="The Treadle server (default: $TREADLE_BASE_URL)."),
]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", help="Your API key, tml-... (default: $TREADLE_API_KEY)."),
]


AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a table.")]
Plain = Annotated[
    bool,
    typer.Option(
        "--plain",
        help="Print one tab-separated line per item (no header, never wrapped), for scripts.",
    ),
]


# The options given before the command; read by `_rest` when the command has none of its own.
_before_command: dict[str, str | None] = {}


@app.callback()
def _global_options(
    base_url: Annotated[
        str | None,
        typer.Option("--base-url", envvar="TREADLE_BASE_URL", help="The Treadle server."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="TREADLE_API_KEY", help="Your API key (tml-...)."),
    ] = None,
) -> None:
    """Look at your Treadle training runs and checkpoints, and download checkpoints.

    --base-url and --api-key may come before the command (`treadle --base-url URL runs`)
    or after it; after it wins.
    """
    _before_command.clear()
    _before_command.update(base_url=base_url, api_key=api_key)


@contextmanager
def _rest(base_url: str | None, api_key: str | None) -> Iterator[RestClient]:
    base_url = base_url if base_url is not None else _before_command.get("base_url")
    api_key = api_key if api_key is not None else _before_command.get("api_key")
    try:
        url, key = resolve_credentials(base_url, api_key)
        try:
            connection = Connection(url, key, url_source=_url_source(base_url))
        except ValueError as exc:  # a malformed TREADLE_CONNECT_TIMEOUT
            errors.print(Text.assemble(("error: ", "red"), str(exc)))
            raise typer.Exit(2) from exc
        try:
            yield RestClient(connection)
        finally:
            connection.close()
    except TreadleError as exc:
        errors.print(Text.assemble(("error: ", "red"), str(exc)))
        raise typer.Exit(1) from exc


def _url_source(base_url: str | None) -> str:
    """What set the server URL, for the error when it cannot be reached."""
    if base_url is None:
        return resolve_base_url(None)[1]
    if base_url == os.environ.get("TREADLE_BASE_URL"):
        return "TREADLE_BASE_URL"
    return "--base-url"


def _cells(*values: str) -> list[Text]:
    return [Text(value) for value in values]


def _show(
    table: Table,
    rows: Sequence[Sequence[str]],
    plain_rows: Sequence[Sequence[str]],
    document: Any,
    *,
    as_json: bool,
    plain: bool,
) -> None:
    """Print a listing as a table, one JSON document (`--json`) or tab-separated lines."""
    if as_json and plain:
        errors.print(Text.assemble(("error: ", "red"), "pass --json or --plain, not both"))
        raise typer.Exit(2)
    if as_json:
        typer.echo(json.dumps(document, indent=2, default=str))
    elif plain:
        for row in plain_rows:
            typer.echo("\t".join(" ".join(cell.split()) or "-" for cell in row))
    else:
        for row in rows:
            table.add_row(*_cells(*row))
        console.print(table)


def _iso(moment: datetime | None) -> str:
    return moment.isoformat() if moment else "-"


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S") if moment else "-"


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    size = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


@app.command()
def runs(
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    limit: Annotated[int, typer.Option(help="How many runs to show.")] = 20,
    offset: Annotated[int, typer.Option(help="Skip this many of the newest runs.")] = 0,
    as_json: AsJson = False,
    plain: Plain = False,
) -> None:
    """List your training runs, newest first.

    --plain columns: run id, base model, rank, last request (ISO 8601), last checkpoint.
    """
    with _rest(base_url, api_key) as rest:
        listing = rest.list_training_runs(limit=limit, offset=offset).result()
    table = Table(title=f"training runs ({listing.cursor.total_count} in all)")
    for column in ("run id", "base model", "rank", "last request", "last checkpoint"):
        table.add_column(column, overflow="fold")
    rows, plain_rows = [], []
    for run in listing.training_runs:
        last = run.last_checkpoint or run.last_sampler_checkpoint
        cells = [run.training_run_id, run.base_model, str(run.lora_rank or "-")]
        last_path = last.tinker_path if last else "-"
        rows.append([*cells, _when(run.last_request_time), last_path])
        plain_rows.append([*cells, _iso(run.last_request_time), last_path])
    _show(
        table,
        rows,
        plain_rows,
        listing.model_dump(mode="json"),
        as_json=as_json,
        plain=plain,
    )


@app.command()
def checkpoints(
    run: Annotated[
        str | None, typer.Option("--run", help="Only this training run's checkpoints.")
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    limit: Annotated[int, typer.Option(help="How many checkpoints to show.")] = 100,
    offset: Annotated[int, typer.Option(help="Skip this many of the newest checkpoints.")] = 0,
    as_json: AsJson = False,
    plain: Plain = False,
) -> None:
    """List your checkpoints (all runs, or one with --run), newest first.

    --plain columns: path, type, saved (ISO 8601), size in bytes, expires, public (yes/no).
    """
    with _rest(base_url, api_key) as rest:
        if run is not None:
            found: list[Checkpoint] = rest.list_checkpoints(run).result().checkpoints
            found = found[offset : offset + limit]
        else:
            found = rest.list_user_checkpoints(limit=limit, offset=offset).result().checkpoints
    table = Table(title="checkpoints")
    for column in ("path", "type", "saved", "size", "expires", "public"):
        table.add_column(column, overflow="fold")
    rows, plain_rows = [], []
    for checkpoint in found:
        public = "yes" if checkpoint.public else "no"
        head = [checkpoint.tinker_path, checkpoint.checkpoint_type]
        rows.append(
            [
                *head,
                _when(checkpoint.time),
                _size(checkpoint.size_bytes),
                _when(checkpoint.expires_at),
                public,
            ]
        )
        size = "-" if checkpoint.size_bytes is None else str(checkpoint.size_bytes)
        plain_rows.append([*head, _iso(checkpoint.time), size, _iso(checkpoint.expires_at), public])
    document = {"checkpoints": [c.model_dump(mode="json") for c in found]}
    _show(table, rows, plain_rows, document, as_json=as_json, plain=plain)


@app.command()
def download(
    path: Annotated[
        str,
        typer.Argument(
            help="The version: a tinker path (tinker://RUN/weights/NAME) or a registry "
            "reference (PACKAGE@ALIAS, PACKAGE:VERSION)."
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Destination folder (default: ./<checkpoint name> or ./<package>-<version>).",
        ),
    ] = None,
    archive: Annotated[
        bool,
        typer.Option("--archive", help="Download one tar archive of the version instead."),
    ] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Download every file of a version, with a progress bar; run it again to resume."""
    if out is not None:
        destination = out
    elif path.startswith("tinker://"):
        destination = Path(path.rstrip("/").rsplit("/", 1)[-1])
    else:  # a registry reference: package@alias or package:version
        destination = Path(re.sub(r"[@:/]", "-", path))
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
    )
    tasks: dict[str, TaskID] = {}

    def on_progress(relpath: str, received: int, total: int | None) -> None:
        if relpath not in tasks:
            tasks[relpath] = progress.add_task(relpath, total=total)
        progress.update(tasks[relpath], completed=received)

    with _rest(base_url, api_key) as rest, progress:
        try:
            saved = rest.download_checkpoint(
                path, destination, on_progress, archive=archive
            ).result()
        except ValueError as exc:
            errors.print(Text.assemble(("error: ", "red"), str(exc)))
            raise typer.Exit(2) from exc
    if archive:
        console.print(Text(f"downloaded {saved}"))
    else:
        console.print(Text(f"downloaded {len(tasks)} files to {saved}"))


@app.command()
def usage(
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    since: Annotated[
        datetime | None, typer.Option(help="Only usage from this UTC time on (e.g. 2026-11-01).")
    ] = None,
    until: Annotated[
        datetime | None,
        typer.Option(help="Only usage before this UTC time (e.g. 2026-12-01)."),
    ] = None,
    as_json: AsJson = False,
    plain: Plain = False,
) -> None:
    """Show the tokens, saves and storage billed to your account, per base model, with what
    they cost and the total.

    --plain columns: base model, kind, quantity, cost (a decimal amount of the currency).
    """
    start, end = _utc(since), _utc(until)
    with _rest(base_url, api_key) as rest:
        report = rest.get_usage(since=start, until=end).result()
    title = "usage" + (f" since {start.isoformat(timespec='minutes')}" if start else "")
    title += f" until {end.isoformat(timespec='minutes')}" if end else ""
    table = Table(title=title, caption=f"total cost {report.total}")
    for column in ("base model", "kind", "quantity", "cost"):
        table.add_column(column, overflow="fold", justify="right" if column == "cost" else "left")
    rows = [
        [line.base_model, line.kind, f"{line.quantity:,}", line.amount] for line in report.lines
    ]
    plain_rows = [
        [line.base_model, line.kind, str(line.quantity), line.amount] for line in report.lines
    ]
    _show(
        table,
        rows,
        plain_rows,
        report.model_dump(mode="json"),
        as_json=as_json,
        plain=plain,
    )


def _utc(moment: datetime | None) -> datetime | None:
    """A naive time from the command line, read as UTC."""
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


sessions_app = typer.Typer(
    help="List your open sessions (each holds a slot of your concurrent-session quota) or end "
    "one, e.g. one left open by a process that was killed.",
    no_args_is_help=False,
)
app.add_typer(sessions_app, name="sessions")


def _ago(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    seconds = max(0, int((now - moment).total_seconds()))
    if seconds < 60:
        return f"{seconds}s ago"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s ago"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m ago"


@sessions_app.callback(invoke_without_command=True)
def sessions(
    ctx: typer.Context,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    limit: Annotated[int, typer.Option(help="How many sessions to show.")] = 100,
    as_json: AsJson = False,
    plain: Plain = False,
) -> None:
    """List your open sessions, newest first; `treadle sessions end ID` ends one.

    --plain columns: session id, opened (ISO 8601), last heartbeat (ISO 8601), training runs,
    samplers, display name.
    """
    if ctx.invoked_subcommand is not None:  # `treadle sessions --base-url URL end ID`
        for name, value in (("base_url", base_url), ("api_key", api_key)):
            if value is not None:
                _before_command[name] = value
        return
    with _rest(base_url, api_key) as rest:
        found = rest.list_open_sessions(limit=limit).result()
    now = datetime.now(UTC)
    table = Table(title=f"open sessions ({len(found)})")
    for column in ("session id", "opened", "last heartbeat", "runs", "samplers", "name"):
        table.add_column(column, overflow="fold")
    rows, plain_rows = [], []
    for info in found:
        counts = [str(len(info.training_run_ids)), str(len(info.sampler_ids))]
        name = info.display_name or "-"
        rows.append(
            [
                info.session_id,
                _ago(info.created_at, now),
                _ago(info.last_heartbeat_at, now),
                *counts,
                name,
            ]
        )
        plain_rows.append(
            [
                info.session_id,
                _iso(info.created_at),
                _iso(info.last_heartbeat_at),
                *counts,
                name,
            ]
        )
    document = {"sessions": [info.model_dump(mode="json") for info in found]}
    _show(table, rows, plain_rows, document, as_json=as_json, plain=plain)


@sessions_app.command("end")
def end_session(
    session_id: Annotated[str, typer.Argument(help="The session, as `treadle sessions` lists it.")],
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """End a session: frees its quota slot and unloads its training runs (checkpoints stay)."""
    with _rest(base_url, api_key) as rest:
        ended = rest.end_session(session_id).result()
    console.print(Text(f"session {ended.session_id} is {ended.status}"))


def main() -> None:
    """Entry point of the `treadle` console script."""
    app()


registry_app = typer.Typer(
    help="Your model registry: packages of versions, aliases, promotion and lineage. Name a "
    "version anywhere a checkpoint path goes as PACKAGE@ALIAS or PACKAGE:VERSION.",
    no_args_is_help=True,
)
app.add_typer(registry_app, name="registry")
PackageArg = Annotated[str, typer.Argument(help="The package's name.")]
VersionArg = Annotated[int, typer.Argument(help="The version's number in its package.")]


def _done(message: str) -> None:
    console.print(Text(message))


@registry_app.command("packages")
def registry_packages(
    tag: Annotated[str | None, typer.Option(help="Only packages with this tag.")] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    limit: Annotated[int, typer.Option(help="How many packages to show.")] = 100,
    offset: Annotated[int, typer.Option(help="Skip this many packages.")] = 0,
    as_json: AsJson = False,
    plain: Plain = False,
) -> None:
    """List your packages by name.

    --plain columns: name, base model, versions, latest version, tags (comma-separated), run.
    """
    with _rest(base_url, api_key) as rest:
        listing = rest.list_packages(tag=tag, limit=limit, offset=offset).result()
    table = Table(title=f"packages ({listing.cursor.total_count} in all)")
    for column in ("name", "base model", "versions", "latest", "tags", "run"):
        table.add_column(column, overflow="fold")
    rows = [
        [
            p.name,
            p.base_model,
            str(p.version_count),
            str(p.latest_version or "-"),
            ",".join(p.tags) or "-",
            p.training_run_id or "-",
        ]
        for p in listing.packages
    ]
    _show(table, rows, rows, listing.model_dump(mode="json"), as_json=as_json, plain=plain)


@registry_app.command("package")
def registry_package(
    name: PackageArg, base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False
) -> None:
    """Show one package and its aliases."""
    with _rest(base_url, api_key) as rest:
        package = rest.get_package(name).result()
        aliases = rest.list_aliases(name).result().aliases
    if as_json:
        document = package.model_dump(mode="json") | {
            "aliases": [a.model_dump(mode="json") for a in aliases]
        }
        typer.echo(json.dumps(document, indent=2))
        return
    table = Table(title=f"package {package.name}", show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")
    for field, value in (
        ("description", package.description or "-"),
        ("base model", package.base_model),
        ("tags", ", ".join(package.tags) or "-"),
        ("training run", package.training_run_id or "-"),
        ("versions", str(package.version_count)),
        ("aliases", ", ".join(f"{a.name} → {a.version}" for a in aliases) or "-"),
        ("created", _when(package.created_at)),
    ):
        table.add_row(*_cells(field, value))
    console.print(table)


@registry_app.command("create")
def registry_create(
    name: PackageArg,
    base_model: Annotated[
        str | None, typer.Option(help="Its base model (default: the --run's).")
    ] = None,
    description: Annotated[str | None, typer.Option(help="What it holds.")] = None,
    tag: Annotated[list[str] | None, typer.Option(help="A tag; repeat for more.")] = None,
    run: Annotated[
        str | None, typer.Option("--run", help="Make it the package this run saves into.")
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Create an empty package (to promote versions into, or for a run's saves)."""
    with _rest(base_url, api_key) as rest:
        rest.create_package(
            name, base_model, description=description, tags=tag or [], training_run_id=run
        ).result()
    _done(f"created package {name}")


@registry_app.command("rename")
def registry_rename(
    name: PackageArg,
    new_name: Annotated[str, typer.Argument(help="The new name.")],
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Rename a package (references with the old name stop resolving)."""
    with _rest(base_url, api_key) as rest:
        rest.update_package(name, new_name=new_name).result()
    _done(f"renamed package {name} to {new_name}")


@registry_app.command("delete")
def registry_delete(name: PackageArg, base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """Delete a package and its versions; delete its aliases first."""
    with _rest(base_url, api_key) as rest:
        rest.delete_package(name).result()
    _done(f"deleted package {name}")


@registry_app.command("versions")
def registry_versions(
    package: PackageArg,
    status: Annotated[
        str | None, typer.Option(help="Only this status: pending, ready, failed or deleted.")
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    limit: Annotated[int, typer.Option(help="How many versions to show.")] = 100,
    offset: Annotated[int, typer.Option(help="Skip this many of the newest.")] = 0,
    as_json: AsJson = False,
    plain: Plain = False,
) -> None:
    """List a package's versions, newest first.

    --plain columns: version, kind, status, created (ISO 8601), size in bytes, step, aliases,
    tinker path or source version.
    """
    with _rest(base_url, api_key) as rest:
        listing = rest.list_versions(package, status=status, limit=limit, offset=offset).result()
    table = Table(title=f"{package}: {listing.cursor.total_count} versions")
    for column in ("version", "kind", "status", "created", "size", "step", "aliases", "from"):
        table.add_column(column, overflow="fold")
    rows, plain_rows = [], []
    for v in listing.versions:
        head = [str(v.version), v.kind, v.status]
        origin = v.tinker_path or (f"promoted from {v.source_version}" if v.source_version else "-")
        tail = [str(v.step if v.step is not None else "-"), ", ".join(v.aliases) or "-", origin]
        rows.append([*head, _when(v.created_at), _size(v.size_bytes), *tail])
        size = "-" if v.size_bytes is None else str(v.size_bytes)
        plain_rows.append([*head, _iso(v.created_at), size, *tail])
    _show(table, rows, plain_rows, listing.model_dump(mode="json"), as_json=as_json, plain=plain)


@registry_app.command("version")
def registry_version(
    package: PackageArg,
    version: VersionArg,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Show one version: its lineage, files and aliases."""
    with _rest(base_url, api_key) as rest:
        found = rest.get_version(package, version).result()
    if as_json:
        typer.echo(json.dumps(found.model_dump(mode="json"), indent=2))
        return
    table = Table(title=f"{package}:{version}", show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")
    for field, value in found.model_dump(exclude={"files", "package", "version"}).items():
        table.add_row(*_cells(field.replace("_", " "), "-" if value in (None, []) else str(value)))
    for file in found.files or []:
        table.add_row(*_cells("file", f"{file.path} ({_size(file.size_bytes)}, {file.sha256})"))
    console.print(table)


@registry_app.command("promote")
def registry_promote(
    package: PackageArg,
    version: VersionArg,
    target: Annotated[str, typer.Argument(help="The package to add the version to.")],
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Add a version to another package of the same base model (its files are shared)."""
    with _rest(base_url, api_key) as rest:
        promoted = rest.promote_version(package, version, target).result()
    _done(f"promoted {package}:{version} to {target}:{promoted.version}")


@registry_app.command("alias")
def registry_alias(
    package: PackageArg,
    alias: Annotated[str, typer.Argument(help="The alias, e.g. production.")],
    version: VersionArg,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Point an alias at a ready version, creating or moving it."""
    with _rest(base_url, api_key) as rest:
        rest.set_alias(package, alias, version).result()
    _done(f"{package}@{alias} → {package}:{version}")


@registry_app.command("unalias")
def registry_unalias(
    package: PackageArg,
    alias: Annotated[str, typer.Argument(help="The alias to delete.")],
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Delete an alias (its version stays)."""
    with _rest(base_url, api_key) as rest:
        rest.delete_alias(package, alias).result()
    _done(f"deleted {package}@{alias}")


@registry_app.command("lineage")
def registry_lineage(
    package: PackageArg,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    as_json: AsJson = False,
    plain: Plain = False,
) -> None:
    """Show where a package's versions came from and went: runs that saved them, versions they
    were promoted from or into, runs loaded from them.

    --plain columns: from, relation (saved, loaded, promoted), to.
    """
    with _rest(base_url, api_key) as rest:
        graph = rest.get_lineage(package).result()
    labels = {node.id: node.label for node in graph.nodes}
    title = f"lineage of {package}" + (" (partial: too many nodes)" if graph.truncated else "")
    table = Table(title=title)
    for column in ("from", "relation", "to"):
        table.add_column(column, overflow="fold")
    rows = [[labels[e.source], e.relation, labels[e.target]] for e in graph.edges]
    _show(table, rows, rows, graph.model_dump(mode="json"), as_json=as_json, plain=plain)
