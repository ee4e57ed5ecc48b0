"""Distillation targets: a teacher's top-K next-token distribution as soft cross-entropy targets.

The teacher is any sampling client (a base model, or sampler weights of a trained run). Asked
for `topk_prompt_logprobs=K` on a whole sequence, the server returns its K likeliest tokens and
their logprobs at every position. Renormalised over those K tokens, they become the 2-D
`target_tokens` and `weights` (shape `(N, K)`) that Treadle's `cross_entropy` accepts, so
the student's update is `-sum_k p_k log q_k` per trained position, computed on the server.
The student's logprobs of the same K tokens come back from that pass, which gives the KL from
the teacher's renormalised top-K distribution to the student's without another request. The
top-K KL leaves out the teacher's tail, so it is a measure of progress, not the full KL.

Teacher and student must share a tokenizer: the targets are token ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from treadle import SamplingClient
from treadle.types import Datum, ForwardBackwardOutput, ModelInput, SamplingParams, TensorData


@dataclass(frozen=True)
class TeacherTargets:
    """The teacher's top-K at each target position of one datum: `tokens_NK` ids and
    `probs_NK`, renormalised to sum to 1 per position."""

    tokens_NK: list[list[int]]
    probs_NK: list[list[float]]


def teacher_targets(teacher: SamplingClient, data: Sequence[Datum], k: int) -> list[TeacherTargets]:
    """The teacher's top-`k` at every target position of each datum (requests sent together).

    Raises:
        ValueError: the server reported no top-k entries for some position.
    """
    futures = []
    for datum in data:
        targets = datum.loss_fn_inputs["target_tokens"].tolist()
        tokens = ModelInput.from_ints([*datum.model_input.to_ints(), targets[-1]])
        futures.append(
            teacher.sample(tokens, 1, SamplingParams(max_tokens=1), topk_prompt_logprobs=k)
        )
    out = []
    for i, future in enumerate(futures):
        # Entry j + 1 is the distribution of token j + 1, i.e. of target position j.
        per_position = (future.result().topk_prompt_logprobs or [])[1:]
        if len(per_position) != len(data[i].loss_fn_inputs["target_tokens"].tolist()):
            raise ValueError(f"the teacher returned no top-{k} logprobs for datum {i}")
        tokens_NK, probs_NK = [], []
        for position, entries in enumerate(per_position):
            if not entries:
                raise ValueError(f"datum {i} position {position}: the teacher returned no top-k")
            padded = [*entries, *[(0, -math.inf)] * (k - len(entries))][:k]
            total = sum(math.exp(logprob) for _, logprob in padded)
            tokens_NK.append([token for token, _ in padded])
            probs_NK.append([math.exp(logprob) / total for _, logprob in padded])
        out.append(TeacherTargets(tokens_NK, probs_NK))
    return out


def distill_datum(datum: Datum, teacher: TeacherTargets) -> Datum:
    """`datum` with 2-D targets: the teacher's top-K tokens, weighted by their probability
    times the datum's own weight (so prompt positions stay untrained)."""
    mask = datum.loss_fn_inputs["weights"].tolist()
    weights_NK = [[m * p for p in probs] for m, probs in zip(mask, teacher.probs_NK, strict=True)]
    return Datum(
        model_input=datum.model_input,
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(teacher.tokens_NK, "int64"),
            "weights": TensorData.from_list(weights_NK, "float32"),
        },
    )


def kl_to_teacher(
    data: Sequence[Datum], teachers: Sequence[TeacherTargets], output: ForwardBackwardOutput
) -> float:
    """Mean top-K KL(teacher || student) per trained position, from a pass on distill datums
    (whose logprobs are the student's at the teacher's top-K tokens).

    Raises:
        ValueError: no position is trained.
    """
    total = positions = 0.0
    for datum, teacher, out in zip(data, teachers, output.loss_fn_outputs, strict=True):
        weights_NK = datum.loss_fn_inputs["weights"].tolist()
        student_NK = out["logprobs"].tolist()
        for weights, probs, student in zip(weights_NK, teacher.probs_NK, student_NK, strict=True):
            if sum(weights) == 0:
                continue
            total += sum(p * (math.log(p) - q) for p, q in zip(probs, student, strict=True) if p)
            positions += 1
    if not positions:
        raise ValueError("no trained positions: the data has no assistant tokens")
    return total / positions
