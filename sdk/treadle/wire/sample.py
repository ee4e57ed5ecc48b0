"""Protobuf codec for sample results (`SampleResponse`).

Tokens travel as int32 bytes and logprobs as float32 bytes. Prompt logprobs are NaN where
they were not computed (None on the Python side). Top-k logprobs are dense `(length, k)`
matrices in which empty slots hold token 0 with logprob -99999.0; a position whose first slot
is empty reads back as None, and trailing empty slots are dropped.
"""

from __future__ import annotations

import math

from google.protobuf.message import DecodeError

from treadle.proto import treadle_wire_pb2 as pb
from treadle.types.sampling import (
    TOPK_EMPTY_LOGPROB,
    TOPK_EMPTY_TOKEN,
    PromptAltTokens,
    SampledSequence,
    SampleResponse,
    StopReason,
    TopkEntries,
)
from treadle.wire._codec import (
    FLOAT32,
    INT32,
    WireFormatError,
    pack,
    tensor_from_proto,
    tensor_to_proto,
    unpack,
)

_STOP_TO_PROTO: dict[StopReason, int] = {
    "stop": pb.STOP_REASON_STOP,
    "length": pb.STOP_REASON_LENGTH,
}
_PROTO_TO_STOP: dict[int, StopReason] = {v: k for k, v in _STOP_TO_PROTO.items()}


def encode_sample_response(response: SampleResponse) -> bytes:
    """Serialize a sample result for the tinker SDK (and `decode_sample_response`).

    Raises:
        ValueError: a token id does not fit int32.
    """
    msg = pb.SampleResponse(prompt_cache_hit_tokens=response.prompt_cache_hit_tokens)
    for i, seq in enumerate(response.sequences):
        out = msg.sequences.add(
            stop_reason=_STOP_TO_PROTO[seq.stop_reason],
            tokens=pack(seq.tokens, INT32, f"sequences[{i}].tokens"),
        )
        if seq.logprobs is not None:
            out.logprobs = pack(seq.logprobs, FLOAT32, f"sequences[{i}].logprobs")
        if seq.topk_logprobs is not None:
            _topk_to_proto(seq.topk_logprobs, out.topk_sampled_logprobs)
    if response.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in response.prompt_logprobs]
        msg.prompt_logprobs = pack(values, FLOAT32, "prompt_logprobs")
    if response.topk_prompt_logprobs is not None:
        _topk_to_proto(response.topk_prompt_logprobs, msg.topk_prompt_logprobs)
    if response.target_prompt_logprobs is not None:
        tensor_to_proto(
            response.target_prompt_logprobs, msg.target_prompt_logprobs, "target_prompt_logprobs"
        )
    if response.prompt_alt_tokens is not None:
        alt = response.prompt_alt_tokens
        tensor_to_proto(alt.tokens, msg.prompt_alt_tokens.tokens, "prompt_alt_tokens.tokens")
        tensor_to_proto(alt.logprobs, msg.prompt_alt_tokens.logprobs, "prompt_alt_tokens.logprobs")
    return msg.SerializeToString()


def decode_sample_response(body: bytes) -> SampleResponse:
    """Decode a sample result; `sequence_id`s are left None (they come with the future).

    Raises:
        WireFormatError: the bytes are not a consistent SampleResponse.
    """
    msg = pb.SampleResponse()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireFormatError(f"not a SampleResponse protobuf ({exc})") from exc
    sequences: list[SampledSequence] = []
    for i, seq in enumerate(msg.sequences):
        stop_reason = _PROTO_TO_STOP.get(seq.stop_reason)
        if stop_reason is None:
            raise WireFormatError(
                f"sequences[{i}] has unknown stop_reason {seq.stop_reason}; "
                "send STOP_REASON_STOP or STOP_REASON_LENGTH"
            )
        sequences.append(
            SampledSequence(
                stop_reason=stop_reason,
                tokens=unpack(seq.tokens, INT32, f"sequences[{i}].tokens"),
                logprobs=(
                    unpack(seq.logprobs, FLOAT32, f"sequences[{i}].logprobs")
                    if seq.HasField("logprobs")
                    else None
                ),
                topk_logprobs=(
                    _topk_from_proto(seq.topk_sampled_logprobs, f"sequences[{i}].topk")
                    if seq.HasField("topk_sampled_logprobs")
                    else None
                ),
            )
        )
    prompt_logprobs: list[float | None] | None = None
    if msg.HasField("prompt_logprobs"):
        prompt_logprobs = [
            None if math.isnan(v) else v
            for v in unpack(msg.prompt_logprobs, FLOAT32, "prompt_logprobs")
        ]
    alt: PromptAltTokens | None = None
    if msg.HasField("prompt_alt_tokens"):
        alt = PromptAltTokens(
            tokens=tensor_from_proto(msg.prompt_alt_tokens.tokens, "prompt_alt_tokens.tokens"),
            logprobs=tensor_from_proto(
                msg.prompt_alt_tokens.logprobs, "prompt_alt_tokens.logprobs"
            ),
        )
    return SampleResponse(
        sequences=sequences,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=(
            _topk_from_proto(msg.topk_prompt_logprobs, "topk_prompt_logprobs")
            if msg.HasField("topk_prompt_logprobs")
            else None
        ),
        prompt_cache_hit_tokens=msg.prompt_cache_hit_tokens,
        target_prompt_logprobs=(
            tensor_from_proto(msg.target_prompt_logprobs, "target_prompt_logprobs")
            if msg.HasField("target_prompt_logprobs")
            else None
        ),
        prompt_alt_tokens=alt,
    )


def _topk_to_proto(rows: list[TopkEntries | None], msg: pb.TopkLogprobs) -> None:
    # k >= 1 whenever there are rows, so "asked, but nothing at this position" survives as
    # an all-empty row instead of collapsing to "not asked".
    k = max([len(row) for row in rows if row] + [1]) if rows else 0
    token_ids: list[int] = []
    logprobs: list[float] = []
    for row in rows:
        entries = row or []
        token_ids.extend(tid for tid, _ in entries)
        logprobs.extend(lp for _, lp in entries)
        pad = k - len(entries)
        token_ids.extend([TOPK_EMPTY_TOKEN] * pad)
        logprobs.extend([TOPK_EMPTY_LOGPROB] * pad)
    msg.k = k
    msg.length = len(rows)
    msg.token_ids = pack(token_ids, INT32, "top-k token ids")
    msg.logprobs = pack(logprobs, FLOAT32, "top-k logprobs")


def _topk_from_proto(msg: pb.TopkLogprobs, what: str) -> list[TopkEntries | None]:
    n, k = msg.length, msg.k
    token_ids = unpack(msg.token_ids, INT32, f"{what} token_ids")
    logprobs = unpack(msg.logprobs, FLOAT32, f"{what} logprobs")
    if len(token_ids) != n * k or len(logprobs) != n * k:
        raise WireFormatError(
            f"{what} declares {n}x{k} entries but holds {len(token_ids)} token ids and "
            f"{len(logprobs)} logprobs"
        )
    rows: list[TopkEntries | None] = []
    for i in range(n):
        pairs = list(
            zip(token_ids[i * k : (i + 1) * k], logprobs[i * k : (i + 1) * k], strict=True)
        )
        while pairs and pairs[-1] == (TOPK_EMPTY_TOKEN, TOPK_EMPTY_LOGPROB):
            pairs.pop()
        rows.append(pairs or None)
    return rows
