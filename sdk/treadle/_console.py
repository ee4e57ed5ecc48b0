"""Entry point of the `treadle` console script.

The command needs typer and rich, which the library does not: they come with the `cli` extra.
Without them the command says what to install, in one line, instead of a traceback.
"""

from __future__ import annotations

import importlib.util
import sys

CLI_PACKAGES = ("typer", "rich")


def main() -> None:
    """Run the `treadle` command, or exit with status 1 naming the extra to install."""
    missing = [name for name in CLI_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"treadle: the command needs {' and '.join(missing)}, which the base install leaves "
            "out: pip install 'treadle[cli]'",
            file=sys.stderr,
        )
        raise SystemExit(1)
    from treadle.cli import main as run

    run()
