"""SampleResponse protobuf codec: tinker 0.38.0 reads what we write; our reader agrees."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tinker.proto import response_conv

from treadle.proto import treadle_wire_pb2 as pb
from treadle.types import (
    PromptAltTokens,
    SampledSequence,
    SampleResponse,
    TensorData,
)
from treadle.wire import WireFormatError, decode_sample_response, encode_sample_response

pytestmark = pytest.mark.unit


def _response() -> SampleResponse:
    return SampleResponse(
        sequences=[
            SampledSequence(
                stop_reason="stop",
                tokens=[5, 6, 151643],
                logprobs=[-0.25, -1.5, -0.125],
                topk_logprobs=[
                    [(5, -0.25), (9, -2.0)],
                    [(6, -1.5)],
                    None,
                ],
            ),
            SampledSequence(stop_reason="length", tokens=[7, 8]),
        ],
        prompt_logprobs=[None, None, -3.5, -0.75],
        topk_prompt_logprobs=[None, None, [(3, -3.5), (4, -4.0)], [(4, -0.75), (1, -2.0)]],
        prompt_cache_hit_tokens=2,
        target_prompt_logprobs=TensorData(
            data=[-0.5, -1.25],
            dtype="float32",
            shape=[3, 2],
            sparse_crow_indices=[0, 1, 1, 2],
            sparse_col_indices=[1, 0],
        ),
        prompt_alt_tokens=PromptAltTokens(
            tokens=TensorData(data=[1, 2, 3, 4, 5, 6], dtype="int64", shape=[3, 2]),
            logprobs=TensorData(data=[-1.0] * 6, dtype="float32", shape=[3, 2]),
        ),
    )


def test_tinker_decodes_full_sample_response() -> None:
    out = response_conv.deserialize_sample_response(encode_sample_response(_response()))
    first, second = out.sequences
    assert first.stop_reason == "stop" and first.tokens == [5, 6, 151643]
    assert first.tokens_np.dtype == np.int32
    assert first.logprobs == [-0.25, -1.5, -0.125]
    assert first.topk_logprobs == [[(5, -0.25), (9, -2.0)], [(6, -1.5)], None]
    assert second.stop_reason == "length" and second.tokens == [7, 8]
    assert second.logprobs is None and second.topk_logprobs is None

    assert out.prompt_logprobs == [None, None, -3.5, -0.75]
    assert np.isnan(out.prompt_logprobs_np[:2]).all()
    assert out.topk_prompt_logprobs == [None, None, [(3, -3.5), (4, -4.0)], [(4, -0.75), (1, -2.0)]]
    assert out.prompt_cache_hit_tokens == 2

    target = out.target_prompt_logprobs
    assert target is not None and target.dtype == "float32" and target.shape == [3, 2]
    assert target.sparse_crow_indices == [0, 1, 1, 2] and target.sparse_col_indices == [1, 0]
    assert target.data == [-0.5, -1.25]
    assert out.prompt_alt_tokens is not None
    assert out.prompt_alt_tokens.tokens.tolist() == [[1, 2], [3, 4], [5, 6]]
    assert out.prompt_alt_tokens.logprobs.dtype == "float32"


def test_topk_uses_sentinels_on_the_wire() -> None:
    msg = pb.SampleResponse()
    msg.ParseFromString(encode_sample_response(_response()))
    topk = msg.sequences[0].topk_sampled_logprobs
    assert (topk.length, topk.k) == (3, 2)
    assert np.frombuffer(topk.token_ids, np.int32).tolist() == [5, 9, 6, 0, 0, 0]
    assert np.frombuffer(topk.logprobs, np.float32).tolist() == [
        -0.25,
        -2.0,
        -1.5,
        -99999.0,
        -99999.0,
        -99999.0,
    ]


def test_compute_logprobs_shape_minimal_response() -> None:
    response = SampleResponse(
        sequences=[SampledSequence(stop_reason="length", tokens=[42], logprobs=[-0.1])],
        prompt_logprobs=[None, -1.0, -2.0],
    )
    out = response_conv.deserialize_sample_response(encode_sample_response(response))
    assert out.prompt_logprobs == [None, -1.0, pytest.approx(-2.0)]
    assert out.topk_prompt_logprobs is None and out.target_prompt_logprobs is None
    assert out.prompt_alt_tokens is None
    assert out.sequences[0].logprobs == [pytest.approx(-0.1)]


def test_unrequested_fields_stay_unset() -> None:
    body = encode_sample_response(
        SampleResponse(sequences=[SampledSequence(stop_reason="stop", tokens=[1])])
    )
    msg = pb.SampleResponse()
    msg.ParseFromString(body)
    assert not msg.HasField("prompt_logprobs") and not msg.HasField("topk_prompt_logprobs")
    assert not msg.sequences[0].HasField("logprobs")
    assert response_conv.deserialize_sample_response(body).prompt_logprobs is None


def test_round_trip_through_own_decoder() -> None:
    response = _response()
    decoded = decode_sample_response(encode_sample_response(response))
    assert decoded == response


def test_own_decoder_reads_nan_and_rejects_unknown_stop_reason() -> None:
    msg = pb.SampleResponse()
    seq = msg.sequences.add(tokens=np.array([1], np.int32).tobytes())
    msg.prompt_logprobs = np.array([np.nan, -1.0], np.float32).tobytes()
    decoded = decode_sample_response(msg.SerializeToString())
    assert decoded.prompt_logprobs == [None, -1.0]
    assert decoded.sequences[0].stop_reason == "stop"
    seq.stop_reason = 7  # type: ignore[assignment]
    with pytest.raises(WireFormatError, match="unknown stop_reason 7"):
        decode_sample_response(msg.SerializeToString())


def test_token_ids_must_fit_int32() -> None:
    with pytest.raises(ValueError, match="int32"):
        encode_sample_response(
            SampleResponse(sequences=[SampledSequence(stop_reason="stop", tokens=[2**31])])
        )


def test_logprob_nan_in_sampled_tokens_is_kept() -> None:
    response = SampleResponse(
        sequences=[SampledSequence(stop_reason="stop", tokens=[1, 2], logprobs=[math.nan, -1.0])]
    )
    out = response_conv.deserialize_sample_response(encode_sample_response(response))
    assert math.isnan(out.sequences[0].logprobs[0])
