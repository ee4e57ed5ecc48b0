"""Fixtures the cookbook's recipe tests share."""

from __future__ import annotations

import pytest

import treadle


@pytest.fixture
def sampler_saves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per sampler snapshot a recipe saves
    (`TrainingClient.save_weights_and_get_sampling_client_async`) while the test runs."""
    saves: list[int] = []
    save = treadle.TrainingClient.save_weights_and_get_sampling_client_async

    async def counted(self: treadle.TrainingClient) -> treadle.SamplingClient:
        saves.append(1)
        return await save(self)

    monkeypatch.setattr(
        treadle.TrainingClient, "save_weights_and_get_sampling_client_async", counted
    )
    return saves
