"""Conversions between wire types (`treadle.types`) and the engine's protocol types.

Pure functions, no I/O: decoding a request never touches a run, so a conversion error is a
user error that leaves everything as it was.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from core.errors import InvalidInput
from gpu_worker import protocol as ep
from treadle.proto import treadle_wire_pb2 as pb
from treadle.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    SampledSequence,
    SampleRequest,
    SampleResponse,
)
from treadle.wire import encode_sample_response, output_field_names, record_runs

# A CSR tensor may describe far more entries than it sends; densified, every request stays
# within this many entries (a 64 MiB dense float32 body holds 16M).
MAX_DENSE_ENTRIES = 1 << 24
# The second dimension of a 2-D loss input is a top-K width (distillation targets).
MAX_TOP_K = 1024
# Tokens generated per sequence when a sample request leaves max_tokens unset.
DEFAULT_MAX_TOKENS = 16


def lora_spec(config: dict[str, Any]) -> ep.LoraSpec:
    return ep.LoraSpec(
        rank=int(config["rank"]),
        # Unless the config names one, the engine's alpha (fixed, so that changing the rank
        # does not rescale the update).
        alpha=float(config.get("alpha", ep.LoraSpec.alpha)),
        seed=int(config.get("seed") or 0),
        train_attn=bool(config.get("train_attn", True)),
        train_mlp=bool(config.get("train_mlp", True)),
        train_unembed=bool(config.get("train_unembed", True)),
    )


def _tokens(model_input: Any, where: str) -> list[int]:
    try:
        tokens: list[int] = model_input.to_ints()
    except (ValueError, TypeError) as exc:
        raise ep.UserInputError(
            f"{where}: {exc}; send token ids (encoded_text chunks) only"
        ) from exc
    return tokens


# Loss inputs that may hold one value for the whole datum instead of one per token.
PER_DATUM_INPUTS = ("clip_low_threshold", "clip_high_threshold")


def check_shapes(request: ForwardBackwardRequest) -> None:
    """Refuse loss inputs whose shapes do not fit their datum, before anything densifies them.

    Each loss input is `(N,)` or `(N, K)` with N the datum's token count and 1 ≤ K ≤ MAX_TOP_K,
    except that a clip threshold may also be one value for the datum (`()` or `(1,)`);
    CSR tensors are checked for consistency when they are parsed, and together no request may
    expand to more than MAX_DENSE_ENTRIES entries. `scheduler.fb_proto.check_shapes` checks
    the same on a protobuf message.
    """
    entries = 0
    for i, datum in enumerate(request.data):
        n = len(_tokens(datum.model_input, f"data[{i}].model_input"))
        entries += check_datum_shapes(
            i, n, ((name, tensor.dense_shape) for name, tensor in datum.loss_fn_inputs.items())
        )
    check_total_entries(entries)


def check_datum_shapes(i: int, n: int, shapes: Iterable[tuple[str, list[int]]]) -> int:
    """Check datum i's loss-input shapes against its N=n tokens; returns their dense entries."""
    entries = 0
    for name, shape in shapes:
        where = f"data[{i}].loss_fn_inputs[{name!r}]"
        if name in PER_DATUM_INPUTS and list(shape) in ([], [1]):
            entries += 1
            continue
        if len(shape) not in (1, 2) or shape[0] != n:
            allowed = (
                "a clip threshold must be one value (1,) or one per token (N,)"
                if name in PER_DATUM_INPUTS
                else "loss inputs must be (N,) or (N, K), one row per input token"
            )
            raise ep.UserInputError(
                f"{where} has shape {_short(shape)} but the datum has N={n} tokens; {allowed}"
            )
        if len(shape) == 2 and not 1 <= shape[1] <= MAX_TOP_K:
            raise ep.UserInputError(
                f"{where} has shape {_short(shape)}; the second dimension (top-K width) "
                f"must lie in [1, {MAX_TOP_K}]"
            )
        entries += math.prod(shape)
    return entries


def check_total_entries(entries: int) -> None:
    if entries > MAX_DENSE_ENTRIES:
        raise ep.UserInputError(
            f"the loss inputs of this request hold {entries} entries in all, more than this "
            f"server's {MAX_DENSE_ENTRIES}; split the batch into smaller forward_backward requests"
        )


def check_request_shapes(request: ForwardBackwardRequest) -> None:
    """`check_shapes` for the API, where a refusal is a domain error (400)."""
    try:
        check_shapes(request)
    except ep.UserInputError as exc:
        raise InvalidInput(str(exc)) from exc


def _short(shape: list[int]) -> str:
    return str(shape) if len(shape) <= 4 else f"{shape[:4]}... ({len(shape)} dimensions)"


def datums(request: ForwardBackwardRequest) -> list[ep.Datum]:
    check_shapes(request)
    out = []
    for i, datum in enumerate(request.data):
        out.append(_datum(datum, f"data[{i}]"))
    return out


def _datum(datum: Datum, where: str) -> ep.Datum:
    inputs = {name: tensor.to_numpy() for name, tensor in datum.loss_fn_inputs.items()}
    return ep.Datum(
        tokens=_tokens(datum.model_input, f"{where}.model_input"), loss_fn_inputs=inputs
    )


def loss_config(request: ForwardBackwardRequest) -> dict[str, float] | None:
    return numeric_loss_config(request.loss_fn_config)


def numeric_loss_config(config: dict[str, float | str] | None) -> dict[str, float] | None:
    """The engine's loss_fn_config: numbers only (text names a client-side custom loss)."""
    if not config:
        return None
    numbers: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, str):
            raise ep.UnsupportedInput(
                f"loss_fn_config[{key!r}] is text ({value!r}); server-side custom losses are not "
                "supported: use forward_backward_custom, which computes the loss client-side"
            )
        numbers[key] = float(value)
    return numbers


def adam(params: AdamParams | None) -> ep.AdamParams:
    if params is None:
        return ep.AdamParams()
    return ep.AdamParams(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )


def forward_backward_output(result: ep.ForwardBackwardResult) -> bytes:
    """The result's `ForwardBackwardOutput` protobuf, packed from the engine's arrays.

    Byte for byte what `treadle.wire.encode_forward_backward_output` writes for the same
    values as `TensorData.from_numpy` (float arrays travel as float32, integer and bool arrays
    as int64), without a Python object per value.
    """
    # The wire type checks the metric keys, as it would for a whole output.
    metrics = ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result.metrics)
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    msg.metrics.update(metrics.metrics)
    outputs = [
        {name: _packed(array) for name, array in per_datum.items()}
        for per_datum in result.loss_fn_outputs
    ]
    names = output_field_names(outputs)
    for start, end in record_runs(outputs, _layout):
        _add_record(msg, outputs[start:end], names)
    return msg.SerializeToString()


@dataclasses.dataclass(frozen=True)
class _Packed:
    """One output tensor: its wire dtype, shape and little-endian values."""

    dtype: int
    shape: tuple[int, ...]
    data: bytes


def _packed(array: np.ndarray) -> _Packed:
    kind = array.dtype.kind
    if kind == "f":
        dtype, wire = pb.DTYPE_FLOAT32, "<f4"
    elif kind in ("i", "u", "b"):
        dtype, wire = pb.DTYPE_INT64, "<i8"
    else:
        raise ValueError(f"cannot send a numpy array of dtype {array.dtype}; use ints or floats")
    return _Packed(dtype, array.shape, np.ascontiguousarray(array, dtype=wire).tobytes())


def _layout(fields: dict[str, _Packed]) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(name, t.dtype, t.shape[1:]) for name, t in sorted(fields.items())]


def _add_record(
    msg: pb.ForwardBackwardOutput, datums: list[dict[str, _Packed]], names: list[str]
) -> None:
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(datums))
    for name in names:
        parts = [d[name].data for d in datums]
        offsets = np.zeros(len(parts) + 1, dtype="<i8")
        np.cumsum([len(part) for part in parts], out=offsets[1:])
        batched = record.fields[name]
        batched.data = b"".join(parts)
        batched.offsets = offsets.tobytes()
        batched.dtype = datums[0][name].dtype
        batched.trailing_shape.extend(datums[0][name].shape[1:])


def sample_request(
    request: SampleRequest, *, run_id: str | None, base_model: str
) -> ep.SampleRequest:
    if request.prompt_alt_tokens_k:
        raise ep.UnsupportedInput("prompt_alt_tokens_k is not supported; leave it at 0")
    if request.target_prompt_logprobs is not None:
        raise ep.UnsupportedInput(
            "target_prompt_logprobs is not supported; compute logprobs of the target with compute_logprobs"
        )
    if request.topk_sample_logprobs:
        raise ep.UnsupportedInput(
            "topk_sample_logprobs is not supported; leave it at 0 (sampled-token logprobs are always returned)"
        )
    if request.record_stability_info:
        raise ep.UnsupportedInput(
            "record_stability_info is not supported yet; train with importance_sampling, ppo or cispo instead of stable_reinforce"
        )
    params = request.sampling_params
    wants_prompt = bool(request.prompt_logprobs) or request.topk_prompt_logprobs > 0
    return ep.SampleRequest(
        prompt=_tokens(request.prompt, "prompt"),
        params=ep.SamplingParams(
            max_tokens=params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop,
        ),
        num_samples=request.num_samples,
        run_id=run_id,
        base_model=None if run_id else base_model,
        prompt_logprobs=wants_prompt,
        topk_prompt_logprobs=request.topk_prompt_logprobs,
    )


def _nan_to_none(values: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else float(v) for v in values.tolist()]


def sample_output(request: SampleRequest, result: ep.SampleResult) -> bytes:
    sequences = [
        SampledSequence(stop_reason=s.stop_reason, tokens=list(s.tokens), logprobs=list(s.logprobs))
        for s in result.sequences
    ]
    prompt_logprobs = None
    if request.prompt_logprobs and result.prompt_logprobs is not None:
        prompt_logprobs = _nan_to_none(result.prompt_logprobs)
        if request.prompt_logprobs_last_n is not None:
            keep_from = max(0, len(prompt_logprobs) - request.prompt_logprobs_last_n)
            hidden: list[float | None] = [None] * keep_from
            prompt_logprobs = hidden + prompt_logprobs[keep_from:]
    topk = None
    if request.topk_prompt_logprobs and result.topk_prompt_logprobs is not None:
        ids, lps = result.topk_prompt_logprobs
        topk = [
            None
            if row == 0
            else [(int(t), float(lp)) for t, lp in zip(ids[row], lps[row], strict=True)]
            for row in range(ids.shape[0])
        ]
    response = SampleResponse(
        sequences=sequences, prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk
    )
    return encode_sample_response(response)
