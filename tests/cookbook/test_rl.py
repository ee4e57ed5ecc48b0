"""Unit tests of the cookbook's RL components: no server, each in milliseconds.

Numbers are checked against references written here in plain torch; the clients are small
fakes that record what the components send, since what is under test is the arithmetic and
the scheduling, not the server (tests/cookbook/test_math_grpo.py runs them against one).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from treadle import types
from treadle.futures import APIFuture
from treadle_cookbook import arith
from treadle_cookbook.recipes import math_grpo
from treadle_cookbook.rl.datums import datum, group_data, sampler_trainer_kl
from treadle_cookbook.rl.groups import Group, Sample, advantages, drop_constant, drop_stale
from treadle_cookbook.rl.rollouts import (
    OverlappedRollouts,
    RolloutSpec,
    SyncRollouts,
    greedy_accuracy,
)
from treadle_cookbook.rl.train import split, train_step

pytestmark = pytest.mark.unit


def sample(reward: float, tokens: list[int] | None = None, lp: float = -0.5) -> Sample:
    tokens = tokens or [4, 5, 12]
    return Sample([1, 2, 3], tokens, [lp] * len(tokens), reward)


# -- advantages and dropping ------------------------------------------------------------------


def test_advantages_match_a_torch_reference() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    r = torch.tensor(rewards, dtype=torch.float64)
    expected = (r - r.mean()) / (r.std(unbiased=False) + 1e-4)
    assert advantages(rewards) == pytest.approx(expected.tolist(), rel=1e-12)
    assert sum(advantages(rewards)) == pytest.approx(0.0, abs=1e-12)


def test_a_constant_group_has_zero_advantages_and_is_dropped() -> None:
    assert advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    mixed = Group([sample(1.0), sample(0.0)], sampler_step=0)
    all_right = Group([sample(1.0), sample(1.0)], sampler_step=0)
    all_wrong = Group([sample(0.0), sample(0.0)], sampler_step=0)
    assert drop_constant([all_right, mixed, all_wrong]) == [mixed]


def test_groups_older_than_max_staleness_are_dropped() -> None:
    groups = [Group([sample(1.0)], sampler_step=s) for s in (2, 3, 4, 5, 6)]
    kept = drop_stale(groups, trainer_step=6, max_staleness=3)
    assert [g.sampler_step for g in kept] == [3, 4, 5, 6]


# -- datums and KL -------------------------------------------------------------------------------


def test_datum_shifts_the_sequence_and_masks_the_prompt_with_zero_advantage() -> None:
    d = datum(Sample([1, 2, 3], [4, 5, 12], [-0.1, -0.2, -0.3], 1.0), advantage=0.5)
    assert d.model_input.to_ints() == [1, 2, 3, 4, 5]
    inputs = {k: v.tolist() for k, v in d.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [2, 3, 4, 5, 12]
    assert inputs["logprobs"] == pytest.approx([0.0, 0.0, -0.1, -0.2, -0.3])
    assert inputs["advantages"] == pytest.approx([0.0, 0.0, 0.5, 0.5, 0.5])


def test_group_data_gives_each_sample_its_group_advantage() -> None:
    groups = [
        Group([sample(1.0), sample(0.0)], 0),
        Group([sample(0.0), sample(0.0), sample(1.0)], 0),
    ]
    data, samples = group_data(groups)
    assert len(data) == len(samples) == 5
    last_advantage = [d.loss_fn_inputs["advantages"].tolist()[-1] for d in data]
    expected = advantages([1.0, 0.0]) + advantages([0.0, 0.0, 1.0])
    assert last_advantage == pytest.approx(expected, rel=1e-6)


def test_sampler_trainer_kl_is_the_mean_gap_over_sampled_tokens_only() -> None:
    samples = [sample(1.0, [4, 12], lp=-1.0), sample(0.0, [4, 5, 12], lp=-2.0)]
    # Per position of each datum (prompt positions first, which must be ignored).
    trainer = [[-9.0, -9.0, -1.5, -0.5], [-9.0, -9.0, -2.0, -2.5, -1.0]]
    gaps = [-1.0 + 1.5, -1.0 + 0.5, -2.0 + 2.0, -2.0 + 2.5, -2.0 + 1.0]
    assert sampler_trainer_kl(samples, trainer) == pytest.approx(sum(gaps) / len(gaps))


def test_tokens_the_policy_did_not_sample_are_neither_trained_nor_in_the_kl() -> None:
    # Two turns with two tool tokens between them (logprob 0.0, not sampled).
    mask = [True, False, False, True]
    two_turns = Sample([1, 2], [4, 7, 8, 5], [-1.0, 0.0, 0.0, -2.0], 1.0, mask=mask)
    d = datum(two_turns, advantage=-0.5)
    assert d.model_input.to_ints() == [1, 2, 4, 7, 8]
    advantages_per_position = d.loss_fn_inputs["advantages"].tolist()
    assert advantages_per_position == pytest.approx([0.0, -0.5, 0.0, 0.0, -0.5])
    trainer = [[-9.0, -1.5, -9.0, -9.0, -1.0]]
    expected = ((-1.0 + 1.5) + (-2.0 + 1.0)) / 2
    assert sampler_trainer_kl([two_turns], trainer) == pytest.approx(expected)


# -- one training step in sub-batches -----------------------------------------------------------


class RecordingTrainer:
    """Answers its n-th forward_backward call (from 1) with logprobs 0.1·n above the sampler's,
    so a metric shows which calls it came from, and records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.passes = 0

    async def forward_backward_async(
        self, data: list[types.Datum], loss_fn: str
    ) -> APIFuture[types.ForwardBackwardOutput]:
        self.calls.append((loss_fn, len(data)))
        self.passes += 1
        gap = 0.1 * self.passes
        outputs = [
            {
                "logprobs": types.TensorData.from_list(
                    [x + gap for x in d.loss_fn_inputs["logprobs"].tolist()], "float32"
                )
            }
            for d in data
        ]
        output = types.ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": 1.0})
        return APIFuture.completed(output)

    async def optim_step_async(self, adam: types.AdamParams) -> APIFuture[types.OptimStepResponse]:
        self.calls.append(("optim_step", 0))
        return APIFuture.completed(types.OptimStepResponse(metrics={"grad_norm:mean": 2.0}))


def test_split_makes_near_equal_contiguous_chunks() -> None:
    assert split(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split([1, 2], 5) == [[1], [2]]
    with pytest.raises(ValueError, match="parts must be at least 1, got 0"):
        split([1], 0)


def test_no_sub_batches_is_refused_before_anything_is_sent() -> None:
    trainer = RecordingTrainer()
    step = train_step(
        trainer,  # type: ignore[arg-type]
        [Group([sample(1.0), sample(0.0)], 0)],
        loss_fn="ppo",
        adam=types.AdamParams(learning_rate=1e-4),
        sub_batches=0,
    )
    with pytest.raises(ValueError, match="sub_batches must be at least 1, got 0"):
        asyncio.run(step)
    assert trainer.calls == []


@pytest.mark.parametrize("field", ["minibatches", "sub_batches"])
def test_math_grpo_refuses_fewer_than_one_minibatch_or_sub_batch(field: str) -> None:
    with pytest.raises(SystemExit, match=f"--{field}: Input should be greater than or equal to 1"):
        math_grpo.Config.from_cli(["--log_dir=unused", f"--{field}=0"])


def test_train_step_sends_every_sub_batch_before_one_optim_step() -> None:
    groups = [Group([sample(1.0), sample(0.0), sample(0.0)], 0) for _ in range(3)]
    trainer = RecordingTrainer()
    metrics = asyncio.run(
        train_step(
            trainer,  # type: ignore[arg-type]
            groups,
            loss_fn="ppo",
            adam=types.AdamParams(learning_rate=1e-4),
            sub_batches=4,
        )
    )
    assert trainer.calls == [("ppo", 3), ("ppo", 2), ("ppo", 2), ("ppo", 2), ("optim_step", 0)]
    assert metrics["datums"] == 9 and metrics["sub_batches"] == 4
    assert metrics["loss"] == pytest.approx(4.0)
    assert metrics["grad_norm"] == 2.0
    assert metrics["advantage_abs_mean"] == pytest.approx(
        sum(abs(a) for a in advantages([1.0, 0.0, 0.0])) / 3
    )
    # The KL is the mean over every call's tokens (3 per datum): 0.1 to 0.4 above the sampler.
    gaps = [0.1] * 3 + [0.2] * 2 + [0.3] * 2 + [0.4] * 2
    assert metrics["kl_sampler_trainer"] == pytest.approx(-sum(gaps) / len(gaps), abs=1e-6)


def test_math_grpo_trains_a_batch_in_one_optim_step_per_minibatch() -> None:
    groups = [Group([sample(1.0), sample(0.0)], 0) for _ in range(5)]
    cfg = math_grpo.Config(log_dir="unused", minibatches=2, sub_batches=2, loss_fn="cispo")
    trainer = RecordingTrainer()
    adam = types.AdamParams(learning_rate=1e-3)
    metrics = asyncio.run(math_grpo.train_minibatches(trainer, groups, cfg, adam))  # type: ignore[arg-type]
    # Groups 0-2 then 3-4, each minibatch in two forward_backward calls before its optim_step.
    assert trainer.calls == [
        ("cispo", 3), ("cispo", 3), ("optim_step", 0), ("cispo", 2), ("cispo", 2), ("optim_step", 0)
    ]  # fmt: skip
    assert metrics["minibatches"] == 2 and metrics["datums"] == 10 and metrics["loss"] == 4.0
    # Calls 1-2 (3 datums each) trained the first minibatch, calls 3-4 (2 each) the last.
    assert metrics["kl_sampler_trainer"] == pytest.approx(-(3 * 0.1 + 3 * 0.2) / 6, abs=1e-6)
    assert metrics["kl_last_minibatch"] == pytest.approx(-(2 * 0.3 + 2 * 0.4) / 4, abs=1e-6)


# -- rollouts --------------------------------------------------------------------------------------


class CharCodec:
    """The arithmetic vocabulary as a tokenizer, end-of-sequence at its index."""

    eos_token_id = arith.VOCAB.index(arith.EOS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return arith.encode(text)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(arith.VOCAB[t] for t in token_ids)


class AnsweringSampler:
    """Answers every prompt correctly in its first sample and wrongly in the others."""

    def __init__(self) -> None:
        self.requests = 0

    async def sample_async(
        self, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams
    ) -> types.SampleResponse:
        self.requests += 1
        await asyncio.sleep(0)
        text = CharCodec().decode(prompt.to_ints())
        a, b = int(text[:3]), int(text[4:7])
        right = [*arith.encode(f"{a + b:04d}"), CharCodec.eos_token_id]
        wrong = [*arith.encode(f"{(a + b + 1) % 10000:04d}"), CharCodec.eos_token_id]
        sequences = [
            types.SampledSequence(
                stop_reason="stop", tokens=right if i == 0 else wrong, logprobs=[-0.5] * 5
            )
            for i in range(num_samples)
        ]
        return types.SampleResponse(sequences=sequences)


def spec() -> RolloutSpec:
    return RolloutSpec(CharCodec(), arith.exact_match, group_size=4, max_tokens=5)


def problems() -> Iterator[arith.Problem]:
    return arith.training_problems(seed=1)


def test_sync_rollouts_grade_groups_with_the_published_weights() -> None:
    async def run() -> Any:
        rollouts = SyncRollouts(problems(), spec(), groups_per_step=3, seed=0)
        rollouts.publish(AnsweringSampler(), step=7)  # type: ignore[arg-type]
        return await rollouts.next_batch(trainer_step=7)

    batch = asyncio.run(run())
    assert len(batch.groups) == 3 and batch.stale_dropped == 0 and batch.staleness == [0, 0, 0]
    assert all(g.rewards == [1.0, 0.0, 0.0, 0.0] for g in batch.groups)
    assert all(g.sampler_step == 7 for g in batch.groups)


def test_overlapped_rollouts_sample_ahead_and_drop_stale_groups() -> None:
    async def run() -> tuple[Any, Any, int]:
        sampler = AnsweringSampler()
        rollouts = OverlappedRollouts(problems(), spec(), groups_per_step=2, max_staleness=3)
        rollouts.publish(sampler, step=0)  # type: ignore[arg-type]
        rollouts.start()
        # The tasks sample while nobody asks: the queue fills, one step ahead.
        for _ in range(20):
            await asyncio.sleep(0)
        ahead = sampler.requests
        first = await rollouts.next_batch(trainer_step=1)  # staleness 1 <= 3: kept
        # The trainer moves on to step 5 (weights published), so what the tasks sampled
        # with step-0 weights in the meantime is 5 steps old: dropped.
        rollouts.publish(sampler, step=5)  # type: ignore[arg-type]
        second = await rollouts.next_batch(trainer_step=5)
        await rollouts.close()
        return first, second, ahead

    first, second, ahead = asyncio.run(run())
    assert ahead >= 2
    assert first.stale_dropped == 0 and first.staleness == [1, 1]
    assert second.stale_dropped >= 2
    assert all(g.sampler_step == 5 for g in second.groups) and second.staleness == [0, 0]


def test_overlapped_rollouts_raise_what_sampling_raised() -> None:
    class Failing:
        async def sample_async(self, *args: Any) -> types.SampleResponse:
            raise RuntimeError("sampler went away")

    async def run() -> None:
        rollouts = OverlappedRollouts(problems(), spec(), groups_per_step=2)
        rollouts.publish(Failing(), step=0)  # type: ignore[arg-type]
        rollouts.start()
        try:
            await rollouts.next_batch(trainer_step=0)
        finally:
            await rollouts.close()

    with pytest.raises(RuntimeError, match="sampler went away"):
        asyncio.run(run())


def test_greedy_accuracy_samples_at_temperature_0_and_grades_with_the_spec() -> None:
    class EvenRight(AnsweringSampler):
        """Answers right when the first operand is even, else wrong; records the params."""

        def __init__(self) -> None:
            super().__init__()
            self.params: list[types.SamplingParams] = []

        async def sample_async(
            self, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams
        ) -> types.SampleResponse:
            self.params.append(params)
            response = await super().sample_async(prompt, 2, params)
            even = int(CharCodec().decode(prompt.to_ints())[:3]) % 2 == 0
            return types.SampleResponse(sequences=[response.sequences[0 if even else 1]])

    held_out = list(itertools.islice(problems(), 20))
    sampler = EvenRight()
    accuracy = asyncio.run(greedy_accuracy(sampler, held_out, spec()))  # type: ignore[arg-type]
    assert accuracy == sum(int(p.prompt[:3]) % 2 == 0 for p in held_out) / 20
    assert 0 < accuracy < 1
    assert {(p.temperature, p.max_tokens) for p in sampler.params} == {(0.0, 5)}


def test_training_problems_never_include_held_out_ones() -> None:
    held_out = {p.prompt for p in arith.held_out()}
    assert len(held_out) == arith.HELD_OUT_SIZE
    drawn = [p.prompt for p in itertools.islice(arith.training_problems(seed=3), 20_000)]
    assert not held_out.intersection(drawn)
