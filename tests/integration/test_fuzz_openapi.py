"""Schemathesis against a live embedded server: the OpenAPI document must tell the truth.

Every operation of `/openapi.json` is fuzzed with the default tenant's real API key: boundary
values of every parameter and body field, then generated schema-valid and schema-violating
requests, and requests without the key or with methods a path does not take. The run fails on
any 5xx and on any answer the document does not describe (an undocumented status, a body or
header that does not match, a missing `Allow` on 405), on schema-violating requests that are
accepted, and on routes that answer without the API key.

Not checked: that schema-valid requests succeed. Most need ids that exist, a base model this
server serves or a `seq_id` in the run's order, and are rightly refused with a documented 4xx.

It is bounded for every CI run (a fixed seed and few examples per operation). A longer search
is one command (see docs/testing.md):

    TREADLE_FUZZ_EXAMPLES=500 ./scripts/test.sh tests/integration/test_fuzz_openapi.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.bootstrap import ensure_default_key
from core.clock import SystemClock
from core.db import Database
from tests.server import AppFactory, running_server

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("TREADLE_FUZZ_EXAMPLES", "15"))
SEED = os.environ.get("TREADLE_FUZZ_SEED", "20260101")
# About 40 s per database at 15 examples; a longer search gets the time it needs.
TIMEOUT_SECONDS = 240 + 2 * EXAMPLES
# Whether valid requests succeed is not the document's promise (see the module docstring).
EXCLUDED_CHECKS = "positive_data_acceptance"


@pytest.fixture
def server_and_key(
    app_factory: AppFactory, database_url: str, migrated: Database
) -> Iterator[tuple[str, str]]:
    # A short long-poll: retrieve_future on a pending operation holds its answer that long.
    app = app_factory(database_url, long_poll_seconds=0.2)
    key = ensure_default_key(app.state.treadle.settings, migrated, SystemClock())
    with running_server(app) as url:
        yield url, key


@pytest.mark.timeout(TIMEOUT_SECONDS + 60)
def test_every_operation_answers_as_documented(
    server_and_key: tuple[str, str], tmp_path: Path
) -> None:
    url, key = server_and_key
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--no-color",
        "run",
        f"{url}/openapi.json",
        "--header",
        f"X-API-Key: {key}",
        "--checks",
        "all",
        "--exclude-checks",
        EXCLUDED_CHECKS,
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        SEED,
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--suppress-health-check",
        "all",
    ]
    # In a scratch folder: schemathesis may leave files in its working directory.
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False
    )
    output = result.stdout + result.stderr
    print(output[-3_000:])  # the summary: operations, phases, cases generated
    assert result.returncode == 0, output[-20_000:]
    assert "Tested: " in output, output[-5_000:]
