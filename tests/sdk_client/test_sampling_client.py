"""SamplingClient: parallel samples, compute_logprobs, and pickling for worker processes."""

from __future__ import annotations

import pickle

import pytest

import treadle
from tests.sdk_client.fake_server import FakeServer
from treadle import types
from treadle._http import RetryPolicy

pytestmark = pytest.mark.unit

FAST = RetryPolicy(initial_backoff_seconds=0.001, max_backoff_seconds=0.01, max_elapsed_seconds=5)


def test_samples_run_in_parallel_with_unique_seq_ids() -> None:
    server = FakeServer(faults={"/asample": ["reset-after", "503"]})
    with treadle.ServiceClient(
        base_url="http://fake", api_key="tml-x", transport=server.transport(), retry=FAST
    ) as service:
        sampler = service.create_sampling_client(base_model="tiny")
        prompt = types.ModelInput.from_ints([1, 2, 3])
        futures = [sampler.sample(prompt, 2, types.SamplingParams(max_tokens=2)) for _ in range(20)]
        results = [f.result(timeout=10) for f in futures]
        logprobs = sampler.compute_logprobs(prompt).result(timeout=10)
    assert all(len(r.sequences) == 2 and r.sequences[0].sequence_id for r in results)
    seqs = server.executed_seq_ids(sampler.sampling_session_id)
    assert sorted(seqs) == list(range(21))  # 0..19 samples + compute_logprobs; none twice
    assert logprobs == [None, -1.0, -1.0]


def test_sampling_client_pickles_without_its_connection() -> None:
    server = FakeServer()
    with treadle.ServiceClient(
        base_url="http://fake", api_key="tml-x", transport=server.transport(), retry=FAST
    ) as service:
        sampler = service.create_sampling_client(base_model="tiny")
        clone = pickle.loads(pickle.dumps(sampler))
    assert type(clone) is treadle.SamplingClient
    assert clone.sampling_session_id == sampler.sampling_session_id and clone.base_model == "tiny"
    # A clone numbers its requests in its own range, so they never collide with the original's.
    assert clone._next_seq >= 1_000_000_000 and clone._next_seq % 1_000_000_000 == 0
    assert clone._conn is not sampler._conn and clone._conn.api_key == "tml-x"
    clone._conn.close()
