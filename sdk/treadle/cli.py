"""The `treadle` command: look at your training runs and checkpoints, download checkpoints.

The server and key come from `--base-url` / `--api-key` or `TREADLE_BASE_URL` /
`TREADLE_API_KEY`. Errors print the server's message and exit with status 1.

This module is the only one that imports typer and rich; the library itself never does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

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

from treadle.client.rest import RestClient
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

BaseUrl = Annotated[
    str | None, typer.Option("--base-url", envvar="TREADLE_BASE_URL", help="The Treadle server.")
]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="TREADLE_API_KEY", help="Your API key (tml-...)."),
]


@contextmanager
def _rest(base_url: str | None, api_key: str | None) -> Iterator[RestClient]:
    try:
        with RestClient(base_url=base_url, api_key=api_key) as rest:
            yield rest
    except TreadleError as exc:
        errors.print(Text.assemble(("error: ", "red"), str(exc)))
        raise typer.Exit(1) from exc


def _cells(*values: str) -> list[Text]:
    return [Text(value) for value in values]


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
) -> None:
    """List your training runs, newest first."""
    with _rest(base_url, api_key) as rest:
        listing = rest.list_training_runs(limit=limit, offset=offset)
    table = Table(title=f"training runs ({listing.cursor.total_count} in all)")
    for column in ("run id", "base model", "rank", "last request", "last checkpoint"):
        table.add_column(column, overflow="fold")
    for run in listing.training_runs:
        last = run.last_checkpoint or run.last_sampler_checkpoint
        table.add_row(
            *_cells(
                run.training_run_id,
                run.base_model,
                str(run.lora_rank or "-"),
                _when(run.last_request_time),
                last.tinker_path if last else "-",
            )
        )
    console.print(table)


@app.command()
def checkpoints(
    run: Annotated[
        str | None, typer.Option("--run", help="Only this training run's checkpoints.")
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    limit: Annotated[int, typer.Option(help="How many checkpoints to show.")] = 100,
) -> None:
    """List your checkpoints (all runs, or one with --run), newest first."""
    with _rest(base_url, api_key) as rest:
        if run is not None:
            found: list[Checkpoint] = rest.list_checkpoints(run).checkpoints
        else:
            found = rest.list_user_checkpoints(limit=limit).checkpoints
    table = Table(title="checkpoints")
    for column in ("path", "type", "saved", "size", "expires", "public"):
        table.add_column(column, overflow="fold")
    for checkpoint in found:
        table.add_row(
            *_cells(
                checkpoint.tinker_path,
                checkpoint.checkpoint_type,
                _when(checkpoint.time),
                _size(checkpoint.size_bytes),
                _when(checkpoint.expires_at),
                "yes" if checkpoint.public else "no",
            )
        )
    console.print(table)


@app.command()
def download(
    path: Annotated[str, typer.Argument(help="The checkpoint, e.g. tinker://RUN/weights/NAME.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Destination folder (default: ./<checkpoint name>)."),
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Download every file of a checkpoint, with a progress bar."""
    destination = out or Path(path.rstrip("/").rsplit("/", 1)[-1])
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
            folder = rest.download_checkpoint(path, destination, on_progress)
        except ValueError as exc:
            errors.print(Text.assemble(("error: ", "red"), str(exc)))
            raise typer.Exit(2) from exc
    console.print(Text(f"downloaded {len(tasks)} files to {folder}"))


@app.command()
def usage(
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    since: Annotated[
        datetime | None, typer.Option(help="Only usage from this UTC time on (e.g. 2026-11-01).")
    ] = None,
) -> None:
    """Show the tokens and saves billed to your account, per base model."""
    start = since.replace(tzinfo=UTC) if since is not None and since.tzinfo is None else since
    with _rest(base_url, api_key) as rest:
        report = rest.get_usage(since=start)
    title = "usage" + (f" since {start.isoformat(timespec='minutes')}" if start else "")
    table = Table(title=title)
    for column in ("base model", "kind", "quantity"):
        table.add_column(column, overflow="fold")
    for line in report.lines:
        table.add_row(*_cells(line.base_model, line.kind, f"{line.quantity:,}"))
    console.print(table)


def main() -> None:
    """Entry point of the `treadle` console script."""
    app()
