"""Checks on op inputs, done before anything touches a run, with messages that say what to change.

Everything here is pure numpy over `protocol` types: a rejected op raises `UserInputError`
and has not changed any state. It does not know about torch, models or adapters beyond the
two numbers a model contributes (vocabulary size and context length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpu_worker.losses import (
    CLIP_KEYS,
    LOSS_CONFIG_DEFAULTS,
    LOSS_CONFIG_REQUIRED,
    LOSS_INPUTS,
    LOSS_OPTIONAL_INPUTS,
)
from gpu_worker.protocol import (
    LOSS_FNS,
    AdamParams,
    Datum,
    LoraSpec,
    SamplingParams,
    UnsupportedInput,
    UserInputError,
)

FLOAT_KEYS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")


@dataclass
class CheckedDatum:
    tokens: np.ndarray  # (N,) int64
    inputs: dict[str, np.ndarray]  # target_tokens int64, float keys float32


@dataclass
class CheckedOp:
    """One forward or forward_backward op after validation: its checked datums and loss
    config, with the run named by id. It holds numpy arrays and no torch objects, so a worker
    group's rank 0 can validate an op once and send each rank a slice of its datums (the
    engine's `execute_checked` runs it wherever a replica of the run lives)."""

    run_id: str
    loss_fn: str
    config: dict[str, float]
    datums: list[CheckedDatum]
    forward_only: bool = False


def check_tokens(tokens: object, vocab_size: int, max_context: int, what: str) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0:
        raise UserInputError(
            f"{what} must be a non-empty 1-D list of token ids, got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise UserInputError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
        raise UserInputError(
            f"{what} contains token id {bad} outside this model's vocabulary "
            f"[0, {vocab_size}); use ids from the model's tokenizer"
        )
    if arr.size > max_context:
        raise UserInputError(
            f"{what} has {arr.size} tokens, more than the model's context "
            f"length {max_context}; truncate or split the sequence"
        )
    return arr.astype(np.int64)


def check_loss_config(loss_fn: str, config: dict[str, float] | None) -> dict[str, float]:
    if loss_fn == "stable_reinforce":
        raise UnsupportedInput(
            "loss_fn 'stable_reinforce' needs per-sequence stability info recorded at "
            "sampling time, which this server does not record; use loss_fn='ppo' (clipped, "
            "robust off-policy) or 'importance_sampling' with the sampler's logprobs instead"
        )
    if loss_fn not in LOSS_INPUTS:
        raise UnsupportedInput(f"unknown loss_fn {loss_fn!r}; use one of {list(LOSS_FNS)}")
    merged = dict(LOSS_CONFIG_DEFAULTS[loss_fn])
    allowed = set(merged) | set(LOSS_CONFIG_REQUIRED.get(loss_fn, ()))
    for key, value in (config or {}).items():
        if key not in allowed:
            hint = sorted(allowed) or "no keys"
            raise UserInputError(
                f"loss_fn_config key {key!r} is not used by {loss_fn}; it accepts {hint}"
            )
        if not isinstance(value, int | float) or not math.isfinite(float(value)):
            raise UserInputError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        merged[key] = float(value)
    for key in LOSS_CONFIG_REQUIRED.get(loss_fn, ()):
        if key not in merged:
            raise UserInputError(
                f"loss_fn {loss_fn} needs loss_fn_config[{key!r}]; "
                f"pass e.g. loss_fn_config={{'{key}': 0.05}}"
            )
    if "clip_low_threshold" in merged and not (
        0 <= merged["clip_low_threshold"] <= 1 <= merged["clip_high_threshold"]
    ):
        raise UserInputError(
            "clip thresholds are ratios: need 0 ≤ clip_low_threshold ≤ 1 ≤ "
            f"clip_high_threshold, got {merged['clip_low_threshold']} and "
            f"{merged['clip_high_threshold']}"
        )
    return merged


def _check_thresholds(
    i: int, datum: Datum, n: int, config: dict[str, float]
) -> dict[str, np.ndarray]:
    """A datum's clip thresholds, one per token: its own where sent, else the config's.

    A threshold input is per datum (shape () or (1,)) or per token ((N,)).
    """
    out: dict[str, np.ndarray] = {}
    for key in CLIP_KEYS:
        if key not in datum.loss_fn_inputs:
            out[key] = np.full(n, config[key], dtype=np.float32)
            continue
        arr = np.asarray(datum.loss_fn_inputs[key])
        if arr.shape not in ((), (1,), (n,)):
            raise UserInputError(
                f"datum {i}: {key} has shape {arr.shape}; send one value for "
                f"the datum (shape (1,)) or one per token ({(n,)})"
            )
        if not np.issubdtype(arr.dtype, np.number) or not np.all(np.isfinite(arr)):
            raise UserInputError(
                f"datum {i}: {key} must hold finite numbers "
                "(no NaN or inf); fix the values before sending"
            )
        out[key] = np.broadcast_to(arr.astype(np.float32).reshape(-1), (n,)).copy()
    lo, hi = out["clip_low_threshold"], out["clip_high_threshold"]
    if not (np.all(lo >= 0) and np.all(lo <= 1) and np.all(hi >= 1)):
        raise UserInputError(
            f"datum {i}: clip thresholds are ratios: need 0 ≤ "
            "clip_low_threshold ≤ 1 ≤ clip_high_threshold at every token, got "
            f"[{lo.min():g}, {lo.max():g}] and [{hi.min():g}, {hi.max():g}]"
        )
    return out


def check_datums(
    data: list[Datum],
    loss_fn: str,
    vocab_size: int,
    max_context: int,
    config: dict[str, float] | None = None,
) -> list[CheckedDatum]:
    """Check and densify one call's datums; `config` is the checked loss_fn_config.

    Optional inputs: clip thresholds (ppo, cispo, gspo) — when any datum sends one, every
    datum gets both, one per token, from its own inputs or from `config`; and gspo's
    `sequence_ratio_mask`, which defaults to the datum's positions with nonzero advantages.
    """
    if not data:
        raise UserInputError("forward_backward needs at least one datum")
    required = LOSS_INPUTS[loss_fn]
    optional = LOSS_OPTIONAL_INPUTS.get(loss_fn, ())
    if loss_fn == "gspo":
        required = tuple(k for k in required if k != "sequence_ratio_mask")
        optional = (*optional, "sequence_ratio_mask")
    with_clip = any(k in d.loss_fn_inputs for d in data for k in CLIP_KEYS if k in optional)
    merged = check_loss_config(loss_fn, config) if with_clip else {}
    checked: list[CheckedDatum] = []
    widths: set[int] = set()
    for i, datum in enumerate(data):
        tokens = check_tokens(datum.tokens, vocab_size, max_context, f"datum {i} model_input")
        n = tokens.size
        keys = set(datum.loss_fn_inputs)
        missing = [k for k in required if k not in keys]
        if missing:
            raise UserInputError(
                f"datum {i}: loss_fn {loss_fn} needs loss_fn_inputs "
                f"{list(required)}; missing {missing}"
            )
        extra = sorted(keys - set(required) - set(optional))
        if extra:
            hint = f" (optional: {list(optional)})" if optional else ""
            raise UserInputError(
                f"datum {i}: loss_fn_inputs keys {extra} are not used by "
                f"{loss_fn}; send only {list(required)}{hint}"
            )
        inputs: dict[str, np.ndarray] = {}
        target = np.asarray(datum.loss_fn_inputs["target_tokens"])
        two_d = loss_fn == "cross_entropy" and target.ndim == 2
        if (
            target.ndim not in ((1, 2) if loss_fn == "cross_entropy" else (1,))
            or target.shape[0] != n
        ):
            want = "(N,) or (N, K)" if loss_fn == "cross_entropy" else "(N,)"
            raise UserInputError(
                f"datum {i}: target_tokens has shape {target.shape} but "
                f"model_input has N={n} tokens; target_tokens must be {want}"
            )
        inputs["target_tokens"] = check_tokens(
            target.reshape(-1), vocab_size, 1 << 62, f"datum {i} target_tokens"
        ).reshape(target.shape)
        if two_d:
            widths.add(target.shape[1])
        else:
            widths.add(0)
        vector_keys = [*required[1:]]
        if "sequence_ratio_mask" in keys and loss_fn == "gspo":
            vector_keys.append("sequence_ratio_mask")
        for key in vector_keys:
            arr = np.asarray(datum.loss_fn_inputs[key])
            want_shape = target.shape if key == "weights" else (n,)
            if arr.shape != want_shape:
                raise UserInputError(
                    f"datum {i}: {key} has shape {arr.shape} but must be "
                    f"{want_shape} to match target_tokens/model_input"
                )
            if not np.issubdtype(arr.dtype, np.number) or not np.all(np.isfinite(arr)):
                raise UserInputError(
                    f"datum {i}: {key} must hold finite numbers "
                    "(no NaN or inf); fix the values before sending"
                )
            inputs[key] = arr.astype(np.float32)
        if loss_fn == "gspo" and "sequence_ratio_mask" not in inputs:
            inputs["sequence_ratio_mask"] = (inputs["advantages"] != 0).astype(np.float32)
        if with_clip:
            inputs.update(_check_thresholds(i, datum, n, merged))
        checked.append(CheckedDatum(tokens=tokens, inputs=inputs))
    if len(widths) > 1:
        raise UserInputError(
            "all datums of one call must use the same target_tokens shape "
            "kind ((N,) or (N, K) with one K); split the call"
        )
    return checked


MAX_LEARNING_RATE = 1e3  # as the API's bound (treadle.types.bounds), for ops that skip it


def check_adam(params: AdamParams) -> None:
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(params, name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise UserInputError(f"adam_params.{name} must be a finite number ≥ 0, got {value!r}")
    if params.learning_rate > MAX_LEARNING_RATE:
        raise UserInputError(
            f"adam_params.learning_rate {params.learning_rate:g} exceeds {MAX_LEARNING_RATE:g}; "
            "pass a learning rate in [0, 1000]"
        )
    if not (params.beta1 < 1 and params.beta2 < 1):
        raise UserInputError("adam_params beta1 and beta2 must be < 1 (e.g. 0.9 and 0.95)")
    if params.eps <= 0:
        raise UserInputError("adam_params.eps must be > 0 (e.g. 1e-12): AdamW divides by it")


def check_sampling(
    params: SamplingParams, prompt_len: int, max_context: int, num_samples: int
) -> None:
    if num_samples < 1:
        raise UserInputError(f"num_samples must be ≥ 1, got {num_samples}")
    if params.max_tokens < 1:
        raise UserInputError(f"max_tokens must be ≥ 1, got {params.max_tokens}")
    if prompt_len + params.max_tokens > max_context:
        raise UserInputError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds the model's context length {max_context}; lower "
            "max_tokens or shorten the prompt"
        )
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise UserInputError(f"temperature must be ≥ 0, got {params.temperature}")
    if not (0 < params.top_p <= 1):
        raise UserInputError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise UserInputError(f"top_k must be -1 (no limit) or ≥ 1, got {params.top_k}")


def check_lora_spec(lora: LoraSpec, max_rank: int) -> None:
    if not 1 <= lora.rank <= max_rank:
        raise UserInputError(
            f"lora rank {lora.rank} is outside 1..{max_rank}; pass rank ≤ {max_rank}"
        )
    if not lora.alpha > 0:
        raise UserInputError(f"lora alpha must be > 0, got {lora.alpha}")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise UserInputError("set at least one of train_attn, train_mlp, train_unembed")
