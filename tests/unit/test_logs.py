"""Log lines as an operator reads them: both formats, the level setting, uvicorn's access lines in
the same shape, alembic quiet unless it migrates, and a failing dependency logged per outage."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import create_engine
from typer.testing import CliRunner

from core import logs
from core.settings import Settings

pytestmark = pytest.mark.unit

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<level>[A-Z]+) (?P<rest>.*)$")
TOUCHED = ("", *logs.UVICORN_LOGGERS, logs.MIGRATION_LOGGER)


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """`logs.configure` changes process-wide state: put it back for the tests after these."""
    saved = {
        name: (list(logger.handlers), logger.propagate, logger.level)
        for name in TOUCHED
        for logger in [logging.getLogger(name)]
    }
    yield
    for name, (handlers, propagate, level) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.propagate = propagate
        logger.setLevel(level)
    logging.captureWarnings(False)


def _stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_text_lines_carry_an_iso_utc_time_the_level_and_the_logger(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure(Settings(log_format="text"))
    logging.getLogger("scheduler.beat").info("expired %d idle sessions", 3)
    (line,) = _stderr_lines(capsys)
    match = TEXT_LINE.match(line)
    assert match, line
    assert match["level"] == "INFO"
    assert match["rest"] == "scheduler.beat expired 3 idle sessions"


def test_json_lines_are_one_object_each_with_the_extra_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure(Settings(log_format="json"))
    log = logging.getLogger("api.submission")
    fields = {"request_id": "req-1", "tenant_id": "t-1", "op_kind": "forward", "duration_ms": 12}
    log.warning("op %s slow", "req-1", extra=fields)
    try:
        raise RuntimeError("engine lost")
    except RuntimeError:
        log.exception("step failed\nsecond line")
    first, second = (json.loads(line) for line in _stderr_lines(capsys))
    assert set(first) == {"ts", "level", "logger", "msg", *fields}
    assert first["level"] == "WARNING"
    assert first["logger"] == "api.submission"
    assert first["msg"] == "op req-1 slow"
    assert {name: first[name] for name in fields} == fields
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert second["level"] == "ERROR"
    assert second["msg"] == "step failed\nsecond line"
    assert "RuntimeError: engine lost" in second["exc_info"]


def test_the_level_setting_drops_lines_below_it(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(Settings(log_level="warning"))
    log = logging.getLogger("scheduler.placement")
    log.info("placed")
    log.warning("no live worker")
    (line,) = _stderr_lines(capsys)
    assert line.endswith("WARNING scheduler.placement no live worker")


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("TREADLE_LOG_LEVEL", "loud", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
        ("TREADLE_LOG_FORMAT", "xml", "text, json"),
    ],
)
def test_a_bad_log_setting_is_refused_naming_the_valid_values(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert f"{variable} {value!r}" in str(refused.value)
    assert named in str(refused.value)


def test_uvicorn_access_lines_get_the_time_and_level(capsys: pytest.CaptureFixture[str]) -> None:
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    # Uvicorn's own configuration applied earlier (its handlers, no propagation) is undone.
    logging.config.dictConfig(LOGGING_CONFIG)
    logs.configure(Settings(log_format="text"))
    # As `treadle-server api` and `serve` run it: no log_config, so uvicorn leaves logging be.
    uvicorn.Config(app=lambda: None, log_config=None).configure_logging()
    access = logging.getLogger("uvicorn.access")
    access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "GET", "/api/v1/healthz", "1.1", 200)
    (line,) = _stderr_lines(capsys)
    match = TEXT_LINE.match(line)
    assert match, line
    assert match["rest"] == 'uvicorn.access 127.0.0.1:5000 - "GET /api/v1/healthz HTTP/1.1" 200'


def test_alembic_reading_the_schema_version_logs_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from alembic.runtime.migration import MigrationContext

    logs.configure(Settings())
    with create_engine(f"sqlite:///{tmp_path / 'probe.db'}").connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() is None
    assert _stderr_lines(capsys) == []


def test_migrate_logs_alembic_only_when_it_migrates(tmp_path: Path) -> None:
    from api.cli import app

    env = {"TREADLE_DATA_DIR": str(tmp_path / "data"), "TREADLE_LOG_FORMAT": "text"}
    first = CliRunner().invoke(app, ["migrate"], env=env)
    assert first.exit_code == 0, first.output
    assert "INFO alembic.runtime.migration Context impl SQLiteImpl." in first.output
    assert "INFO alembic.runtime.migration Running upgrade  -> 0001" in first.output

    again = CliRunner().invoke(app, ["migrate"], env=env)
    assert again.exit_code == 0, again.output
    assert "database at revision" in again.output
    assert logs.MIGRATION_LOGGER not in again.output, again.output


def test_an_outage_is_one_warning_then_one_info_on_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = logs.Outage(
        logging.getLogger("scheduler.notify"), "publishing on Redis", "waiters poll instead"
    )
    caplog.set_level(logging.DEBUG, logger="scheduler.notify")
    outage.succeeded()  # working from the start: nothing to say
    for attempt in range(5):
        outage.failed(ConnectionError(f"refused #{attempt}"))
    assert outage.failing
    outage.succeeded()
    outage.succeeded()

    levels = [record.levelno for record in caplog.records]
    assert levels == [logging.WARNING, *[logging.DEBUG] * 4, logging.INFO]
    warning = caplog.records[0].getMessage()
    assert "publishing on Redis failed (ConnectionError: refused #0)" in warning
    assert "waiters poll instead" in warning
    assert caplog.records[-1].getMessage() == "publishing on Redis works again"
    assert not outage.failing

    outage.failed(ConnectionError("refused again"))
    assert caplog.records[-1].levelno == logging.WARNING  # a new outage is a new warning
