"""The wire types' ranges: what they refuse and say, what they keep, and how NaN travels."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import treadle.types as t
from treadle.types.bounds import MAX_COUNTER, MAX_SAMPLER_SEQ_ID, MAX_SEED, MAX_SEQ_ID

pytestmark = pytest.mark.unit

PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1]}]}


def _refusal(model: type[BaseModel], body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    (error,) = caught.value.errors()
    return ".".join(str(p) for p in error["loc"]) + ": " + error["msg"]


@pytest.mark.parametrize(
    ("model", "field", "low", "high", "extra"),
    [
        (t.OptimStepRequest, "seq_id", 1, MAX_SEQ_ID, {"model_id": "m", "adam_params": {}}),
        (t.SaveWeightsRequest, "seq_id", 1, MAX_SEQ_ID, {"model_id": "m"}),
        (
            t.ForwardBackwardRequest,
            "seq_id",
            0,
            MAX_SEQ_ID,
            {"model_id": "m", "data": [], "loss_fn": "cross_entropy"},
        ),
        (
            t.CreateModelRequest,
            "model_seq_id",
            0,
            MAX_COUNTER,
            {"session_id": "s", "base_model": "b"},
        ),
        (
            t.CreateSamplingSessionRequest,
            "sampling_session_seq_id",
            0,
            MAX_COUNTER,
            {"session_id": "s"},
        ),
        (
            t.SampleRequest,
            "seq_id",
            0,
            MAX_SAMPLER_SEQ_ID,
            {"prompt": PROMPT, "sampling_params": {}},
        ),
        (t.SamplingParams, "seed", 0, MAX_SEED, {}),
        (t.LoraConfig, "seed", 0, MAX_SEED, {"rank": 8}),
    ],
)
def test_integers_keep_to_their_range_and_say_it(
    model: type[BaseModel], field: str, low: int, high: int, extra: dict[str, Any]
) -> None:
    for edge in (low, high):
        assert getattr(model.model_validate({**extra, field: edge}), field) == edge
    for outside in (low - 1, high + 1, 2**70, -(2**70)):
        message = _refusal(model, {**extra, field: outside})
        assert message == f"{field}: must be an integer from {low} to {high}"
    schema = model.model_json_schema()["properties"][field]
    bounds = next(s for s in schema.get("anyOf", [schema]) if s.get("type") == "integer")
    assert (bounds["minimum"], bounds["maximum"]) == (low, high)


def test_the_tinker_sdks_largest_sampler_seq_ids_fit() -> None:
    # Clones number their requests clone_id * 1e9 + n with clone ids up to 1e9.
    request = t.SampleRequest.model_validate(
        {"prompt": PROMPT, "sampling_params": {}, "seq_id": 10**9 * 10**9 + 400}
    )
    assert request.seq_id == 10**18 + 400


def test_adam_parameters_are_finite_and_in_range() -> None:
    assert t.AdamParams() == t.AdamParams(
        learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0, grad_clip_norm=0
    )
    cases = {
        "learning_rate": ([0.0, 1000.0], [1000.5, -1e-9, math.inf, math.nan], "[0, 1000]"),
        "beta1": ([0.0, 0.999], [1.0, -0.5], "[0, 1)"),
        "beta2": ([0.5], [1.5, math.nan], "[0, 1)"),
        "eps": ([1e-300, 10.0], [0.0, -1e-8, math.inf], "(0, ∞)"),
        "weight_decay": ([0.0, 5.0], [-0.1, math.inf], "[0, ∞)"),
        "grad_clip_norm": ([0.0, 1e9], [-1.0, -math.inf], "[0, ∞)"),
    }
    for field, (good, bad, shown) in cases.items():
        for value in good:
            assert getattr(t.AdamParams.model_validate({field: value}), field) == value
        for value in bad:
            message = _refusal(t.AdamParams, {field: value})
            assert message == f"{field}: must be a finite number in {shown}"


def test_checkpoint_names_keep_to_the_safe_set() -> None:
    for name in ("000010", "final", "step-5", "a.b", "_x", "x" * 255):
        assert t.SaveWeightsRequest(model_id="m", path=name).path == name
    for name in ("", ".x", "a/b", "a b", "x" * 256, "ü", "a\x00", "{high}"):
        message = _refusal(t.SaveWeightsExternalRequest, {"model_id": "m", "path": name})
        assert message.startswith("path: checkpoint name ")
        assert "letters, digits, '.', '_' and '-'" in message and "x" * 41 not in message


def test_non_finite_floats_travel_as_strings_and_come_back_as_floats() -> None:
    output = t.ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": t.TensorData(data=[math.nan, -math.inf], dtype="float32")}],
        metrics={"loss:sum": math.inf},
    )
    text = output.model_dump_json()
    parsed_plain = json.loads(text, parse_constant=lambda token: pytest.fail(token))
    assert parsed_plain["metrics"] == {"loss:sum": "Infinity"}
    assert parsed_plain["loss_fn_outputs"][0]["logprobs"]["data"] == ["NaN", "-Infinity"]
    back = t.ForwardBackwardOutput.model_validate_json(text)
    values = back.loss_fn_outputs[0]["logprobs"].data
    assert math.isnan(values[0]) and values[1] == -math.inf
    assert back.metrics == {"loss:sum": math.inf}


def test_ids_names_and_paths_are_no_longer_than_the_server_makes_them() -> None:
    assert t.GetInfoRequest(model_id="s" * 36 + ":train:2147483647").model_id.endswith("647")
    for model, body, field, limit in (
        (t.GetInfoRequest, {"model_id": "m" * 129}, "model_id", 128),
        (t.RetrieveFutureRequest, {"request_id": "r" * 129}, "request_id", 128),
        (
            t.CreateModelRequest,
            {"session_id": "s", "model_seq_id": 0, "base_model": "b" * 201},
            "base_model",
            200,
        ),
        (t.WeightsInfoRequest, {"tinker_path": "t" * 513}, "tinker_path", 512),
    ):
        assert _refusal(model, body) == f"{field}: String should have at most {limit} characters"
