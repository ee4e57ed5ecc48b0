"""Beat warns once per target it cannot place, not on every tick, and again after the target
was placed and became unplaceable once more; its memory of reported targets is bounded."""

from __future__ import annotations

import logging

import pytest

from scheduler.beat import UnplacedTargets

pytestmark = pytest.mark.unit

WHY = "no live worker serves some/model"


def _warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_target_is_warned_about_once_until_placed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="scheduler.beat")
    unplaced = UnplacedTargets()
    for _ in range(5):  # five ticks
        unplaced.warn("run-a", WHY)
        unplaced.warn("run-b", WHY)
    assert _warned(caplog) == [
        f"cannot place run-a: {WHY}; its queued ops wait until one registers",
        f"cannot place run-b: {WHY}; its queued ops wait until one registers",
    ]
    caplog.clear()
    unplaced.placed("run-a")
    unplaced.warn("run-a", WHY)
    unplaced.warn("run-b", WHY)
    assert _warned(caplog) == [
        f"cannot place run-a: {WHY}; its queued ops wait until one registers"
    ]


def test_a_target_reported_elsewhere_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="scheduler.beat")
    unplaced = UnplacedTargets()
    assert unplaced.mark("run-a") and not unplaced.mark("run-a")
    unplaced.warn("run-a", WHY)
    assert not _warned(caplog)


def test_the_memory_is_bounded_forgetting_the_oldest(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="scheduler.beat")
    unplaced = UnplacedTargets(limit=2)
    for target in ("run-a", "run-b", "run-c"):
        unplaced.warn(target, WHY)
    caplog.clear()
    for target in ("run-b", "run-c", "run-a"):
        unplaced.warn(target, WHY)
    assert _warned(caplog) == [
        f"cannot place run-a: {WHY}; its queued ops wait until one registers"
    ]
