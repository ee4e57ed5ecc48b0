"""The engine's op inputs and outputs: plain dataclasses over numpy arrays.

The scheduler builds these from wire requests and reads results back out of them, so this
module imports only numpy and the standard library — never torch. It deliberately does not
know the wire encoding (protobuf, JSON, TensorData): callers decode `loss_fn_inputs` into
dense numpy arrays first (the scheduler does so with `TensorData.to_numpy()`, which also
decodes the sparse CSR form the tinker SDK sends for 2-D `target_tokens`/`weights`); the engine
itself only accepts dense arrays.

`UserInputError` marks bad input (the message says what to change), `UnsupportedInput` input
asking for what the engine does not offer; any other exception raised by the engine is a
server error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

LOSS_FNS = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
)

StopReason = Literal["stop", "length"]


class UserInputError(ValueError):
    """The request is malformed; the message says what the caller should change."""


class UnsupportedInput(UserInputError):
    """The request asks for something this engine does not offer (a loss, a sampling option);
    the message names what to use instead."""


@dataclass(frozen=True)
class LoraSpec:
    """One run's adapter: which projections get LoRA, and its rank, alpha and init seed."""

    rank: int = 32
    alpha: float = 32.0
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass
class Datum:
    """One sequence: `tokens` (N,) and token-aligned `loss_fn_inputs`, dense numpy arrays.

    Position i of `tokens` predicts `loss_fn_inputs["target_tokens"][i]`.
    """

    tokens: np.ndarray | list[int]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    """Token counts of real (unpadded) work done by one op."""

    trained_tokens: int = 0
    prefill_tokens: int = 0
    sampled_tokens: int = 0


@dataclass
class ForwardBackwardResult:
    """Per-datum outputs (always including `logprobs`), `name:reduction` metrics, usage."""

    loss_fn_outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
    usage: Usage


@dataclass
class ForwardBackwardOp:
    """One run's forward_backward request, for `Engine.forward_backward_batch`."""

    run_id: str
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    forward_only: bool = False


@dataclass
class OpError:
    """Why one op of a batch failed; `category` is "user" for bad input, else "server", and
    `unsupported` marks input that asks for what the engine does not offer. `interrupted`
    marks a job dropped because the decode loop it shared failed: the fault may be any of the
    loop's jobs, so it is no answer to this one's request, which may be tried again."""

    category: Literal["user", "server"]
    message: str
    unsupported: bool = False
    interrupted: bool = False

    @classmethod
    def of_input(cls, exc: UserInputError) -> OpError:
        return cls("user", str(exc), unsupported=isinstance(exc, UnsupportedInput))


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyper-parameters for one optim_step (defaults as the tinker SDK's)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


@dataclass
class OptimStepResult:
    metrics: dict[str, float]


@dataclass(frozen=True)
class SamplingParams:
    """`stop=None` stops at EOS only; `stop=[]` disables stopping; strings and ids both work."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | list[int] | str | None = None


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass
class SampleRequest:
    """One prompt to sample from with one run's adapter (or the base model when run_id is None)."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    run_id: str | None = None
    base_model: str | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


@dataclass
class SampleResult:
    """`prompt_logprobs[0]` is NaN; `topk_prompt_logprobs` is (ids (P,k), logprobs (P,k))."""

    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None
    topk_prompt_logprobs: tuple[np.ndarray, np.ndarray] | None
    usage: Usage


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context_length: int
    vocab_size: int
    tokenizer_dir: str
    architecture: str
    num_parameters: int | None = None
    aliases: tuple[str, ...] = ()
