"""The shell blocks of the operator docs run as written: what they show works.

Every fenced ```bash, ```sh or ```console block of the documents below runs, in the order the
document has them, unless the line just before its fence says why it cannot run here:

    <!-- docs-test: skip (needs docker) -->

A block runs in its own `bash -e` in a temporary folder (also `HOME`), with `treadle-server` on
`PATH`, a fresh data folder and, for a document about distributed mode, a fresh SQLite
database named by `TREADLE_DATABASE_URL`; what one block writes there the next one sees, as a
reader following the document would. In a ```console block only the lines starting with `$ `
run. Once a block ended, the `TREADLE_*` settings it left in its shell must be valid settings.

A block that would start a server, need privileges, containers, a cluster or a GPU, or run the
test suite (see UNSAFE) must carry a skip marker; the test refuses to run it otherwise, rather
than leave a server behind. docs/testing.md describes the rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Document → whether its blocks run against a database named by TREADLE_DATABASE_URL (migrated by
# the document's own `treadle-server migrate`) rather than embedded mode's own SQLite file.
DOCUMENTS = {"docs/operations.md": True, "README.md": False}
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
SHELL = {"bash", "sh", "console"}
MARKER = re.compile(r"<!--\s*docs-test:(?P<directive>.*?)-->")
SKIP = re.compile(r"^\s*skip\s*\((?P<reason>[^)]+)\)\s*$")
UNSAFE = re.compile(
    r"(^|[\s;(|&'\"=])(sudo|docker|helm|kubectl|systemctl|journalctl|nvidia-smi)\s"
    r"|(?<!&)&\s*$"  # a process left running in the background
    r"|\btreadle-server\s+(serve|api|worker|beat)\b(?!.*--help)"  # a server in the foreground
    r"|\./scripts/"  # installs, servers and the test suite
)
BLOCK_SECONDS = 120


@dataclasses.dataclass(frozen=True)
class Block:
    document: str
    line: int
    """Line of the first line inside the fence (1-based)."""
    lang: str
    text: str
    skip: str | None
    """Why it cannot run here, from its marker; None: it runs."""

    def script(self) -> str:
        if self.lang != "console":
            return self.text
        # Output lines would not run; keep the numbering so errors name the document's line.
        return "\n".join(
            line[2:] if line.startswith("$ ") else "" for line in self.text.split("\n")
        )

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def shell_blocks(document: str, text: str) -> list[Block]:
    """The shell blocks of a Markdown document, each with the reason its marker gives to skip
    it. A docs-test comment that is not `skip (reason)`, or that no shell fence follows, is an
    error: a marker that does nothing must not look as if it did."""
    blocks: list[Block] = []
    lines = text.split("\n")
    marker: tuple[int, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        found = MARKER.search(line)
        if found:
            skip = SKIP.match(found.group("directive"))
            if skip is None:
                raise ValueError(
                    f"{document}:{i + 1}: {found.group(0)!r} is not a docs-test marker; write "
                    "<!-- docs-test: skip (why it cannot run here) -->"
                )
            marker = (i + 1, skip.group("reason").strip())
            i += 1
            continue
        fence = FENCE.match(line)
        if fence is None:
            if line.strip() and marker is not None:
                raise ValueError(
                    f"{document}:{marker[0]}: a docs-test marker must be the line just before a "
                    "shell block's fence"
                )
            i += 1
            continue
        indent, lang = fence.group("indent"), fence.group("lang")
        end = i + 1
        while end < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[end]):
            end += 1
        body = "\n".join(text_line.removeprefix(indent) for text_line in lines[i + 1 : end])
        if lang in SHELL:
            skip_reason = marker[1] if marker is not None else None
            blocks.append(Block(document, i + 2, lang, body, skip_reason))
        elif marker is not None:
            raise ValueError(
                f"{document}:{marker[0]}: a docs-test marker must precede a bash, sh or console "
                f"block, not {lang or 'an untyped'} one"
            )
        marker = None
        i = end + 1
    return blocks


def _unsafe_lines(block: Block) -> list[str]:
    return [
        f"{block.document}:{block.line + n}: {line.strip()}"
        for n, line in enumerate(block.script().split("\n"))
        if UNSAFE.search(re.sub(r"\s#.*$", "", line))
    ]


def _environment(tmp_path: Path, explicit_database: bool) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_", "AWS_", "VIRTUAL_ENV"))
    }
    home = tmp_path / "home"
    home.mkdir()
    env.update(
        HOME=str(home),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        COLUMNS="200",
        TREADLE_DATA_DIR=str(tmp_path / "data"),
    )
    if explicit_database:
        env["TREADLE_DATABASE_URL"] = f"sqlite:///{tmp_path / 'treadle.db'}"
    return env


# The script around a block: stop at the first failing command and say which line it was;
# then check the settings the block left in its environment.
PROLOGUE = """set -eE -o pipefail
trap 'echo "docs-test: the command at block line $LINENO failed" >&2' ERR
"""
EPILOGUE = """
{python} -c 'from core.settings import Settings; Settings()' \\
  || {{ echo "docs-test: the TREADLE_* settings this block leaves are not valid" >&2; exit 1; }}
"""


def _run(block: Block, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    script = PROLOGUE + block.script() + EPILOGUE.format(python=shlex.quote(sys.executable))
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=BLOCK_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n(killed after {BLOCK_SECONDS} s)"
    finally:
        # Whatever the block started and left behind goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def _failed_line(block: Block, output: str) -> int:
    """The document's line of the command that failed, from the ERR trap's message."""
    found = re.findall(r"docs-test: the command at block line (\d+) failed", output)
    if not found:
        return block.line
    # The prologue's lines come first in the script.
    return block.line + int(found[-1]) - PROLOGUE.count("\n") - 1


@pytest.mark.e2e
@pytest.mark.parametrize("document", list(DOCUMENTS))
def test_the_shell_blocks_of_the_docs_run(document: str, tmp_path: Path) -> None:
    blocks = shell_blocks(document, (ROOT / document).read_text())
    unmarked = [line for b in blocks if b.skip is None for line in _unsafe_lines(b)]
    assert not unmarked, (
        "these lines cannot run in a test (servers, privileges, containers, GPUs, the suite); "
        "put <!-- docs-test: skip (why) --> on the line before their block's fence:\n"
        + "\n".join(unmarked)
    )
    env = _environment(tmp_path, DOCUMENTS[document])
    work = tmp_path / "work"
    work.mkdir()
    for block in blocks:
        if block.skip is not None:
            continue
        done = _run(block, env, work)
        assert done.returncode == 0, (
            f"{block.document}:{_failed_line(block, done.stdout)}: a command of the block at "
            f"line {block.line} failed (exit {done.returncode}):\n{block.text}\n--- output ---\n"
            f"{done.stdout}"
        )


@pytest.mark.unit
def test_blocks_are_found_with_their_lines_and_markers() -> None:
    text = "\n".join(
        [
            "# Title",  # 1
            "```bash",  # 2
            "treadle-server migrate",  # 3
            "```",  # 4
            "<!-- docs-test: skip (needs docker) -->",  # 5
            "```sh",  # 6
            "docker compose up",  # 7
            "```",  # 8
            "- a list item:",  # 9
            "  ```console",  # 10
            "  $ treadle-server --help",  # 11
            "  Usage: ...",  # 12
            "  ```",  # 13
            "```python",  # 14
            "print('not shell')",  # 15
            "```",  # 16
        ]
    )
    blocks = shell_blocks("doc.md", text)
    assert [(b.line, b.lang, b.skip) for b in blocks] == [
        (3, "bash", None),
        (7, "sh", "needs docker"),
        (11, "console", None),
    ]
    assert blocks[2].script() == "treadle-server --help\n"
    assert _unsafe_lines(blocks[0]) == []
    assert _unsafe_lines(blocks[1]) == ["doc.md:7: docker compose up"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<!-- docs-test: skip -->\n```bash\nls\n```", "is not a docs-test marker"),
        ("<!-- docs-test: run -->\n```bash\nls\n```", "is not a docs-test marker"),
        ("<!-- docs-test: skip (x) -->\ntext\n```bash\nls\n```", "the line just before"),
        ("<!-- docs-test: skip (x) -->\n```python\n1\n```", "must precede a bash"),
    ],
)
def test_a_marker_that_would_do_nothing_is_an_error(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        shell_blocks("doc.md", text)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("line", "unsafe"),
    [
        ("treadle-server worker --device cuda:0 --worker-id w0 &", True),
        ("treadle-server api --host 0.0.0.0 --port 8000", True),
        ("treadle-server worker --help", False),
        ("sudo -u postgres createdb treadle", True),
        ("dc exec api-0 treadle-server admin tenants create acme", False),
        ("docker build -f infra/docker/api.Dockerfile .", True),
        ("./scripts/serve.sh --port 9000     # arguments go to serve", True),
        ("treadle-server admin tenants update acme --max-queued-ops default", False),
        ("treadle-server migrate   # the schema & nothing else", False),
    ],
)
def test_lines_that_need_a_skip_marker(line: str, unsafe: bool) -> None:
    block = Block("doc.md", 1, "bash", line, None)
    assert bool(_unsafe_lines(block)) is unsafe
