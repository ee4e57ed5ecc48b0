"""Our strict request models accept what tinker 0.38.0 sends; tinker accepts what we answer.

Requests are built with tinker's own request types and dumped the way its resources do
(`model_dump(exclude_none=True, mode="json")`). Each must validate with our model and dump
back to the same JSON, so no field is dropped, renamed or defaulted differently.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
import tinker
from pydantic import BaseModel
from tinker import types as tt
from tinker.types import custom_loss_graph as tcl
from tinker.types import search_owner as tso
from tinker.types import session_status_query as tsq
from tinker.types.generic_event import GenericEvent
from tinker.types.try_again_response import TryAgainResponse

import treadle.types as ours

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _event(kind: type[BaseModel], **extra: Any) -> BaseModel:
    return kind(event_id="e1", event_session_index=0, severity="INFO", timestamp=NOW, **extra)


def _tinker_requests() -> list[tuple[type[BaseModel], BaseModel]]:
    chunks = [
        tt.EncodedTextChunk(tokens=[1, 2, 3]),
        tt.ImageChunk(data=b"\x89PNG\r\n", format="png", expected_tokens=16),
        tt.ImageAssetPointerChunk(format="jpeg", location="https://x/y.jpg"),
    ]
    target = tt._pydantic_types.tensor_data.TensorData(
        data=[5, 7],
        dtype="int64",
        shape=[2, 2],
        sparse_crow_indices=[0, 1, 2],
        sparse_col_indices=[0, 1],
    )
    return [
        (ours.ClientConfigRequest, tt.ClientConfigRequest(sdk_version="0.38.0")),
        (
            ours.CreateSessionRequest,
            tt.CreateSessionRequest(
                tags=["a", "b"], user_metadata={"k": 1}, sdk_version="0.38.0", project_id="p"
            ),
        ),
        (
            ours.CreateSessionRequest,
            tt.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38.0"),
        ),
        (ours.SessionHeartbeatRequest, tt.SessionHeartbeatRequest(session_id="s")),
        (
            ours.CreateModelRequest,
            tt.CreateModelRequest(
                session_id="s",
                model_seq_id=0,
                base_model="Qwen/Qwen3-8B",
                lora_config=tt.LoraConfig(rank=8, seed=1),
                optimizer_config=tt.AdamOptimizerConfig(),
            ),
        ),
        (
            ours.CreateModelRequest,
            tt.CreateModelRequest(
                session_id="s",
                model_seq_id=3,
                base_model="m",
                user_metadata={"renderer_name": "qwen3"},
                lora_config=tt.LoraConfig(rank=32, train_unembed=False),
                optimizer_config=tt.DimuonOptimizerConfig(),
            ),
        ),
        (ours.GetInfoRequest, tt.GetInfoRequest(model_id="s:train:0")),
        (ours.UnloadModelRequest, tt.UnloadModelRequest(model_id="s:train:0")),
        (
            ours.OptimStepRequest,
            tt.OptimStepRequest(
                optim_params=tt.AdamParams(learning_rate=2e-5, grad_clip_norm=1.0),
                model_id="s:train:0",
                seq_id=2,
            ),
        ),
        (
            ours.OptimStepRequest,
            tt.OptimStepRequest(
                optim_params=tt.DimuonParams(learning_rate=0.02, beta1=0.95), model_id="m", seq_id=5
            ),
        ),
        (
            ours.SaveWeightsRequest,
            tt.SaveWeightsRequest(
                model_id="m",
                path="step-10",
                seq_id=4,
                ttl_seconds=3600,
                overwrite=True,
                user_metadata={"step": "10"},
            ),
        ),
        (
            ours.SaveWeightsForSamplerRequest,
            tt.SaveWeightsForSamplerRequest(model_id="m", path="final", seq_id=6, ttl_seconds=7200),
        ),
        (
            ours.SaveWeightsForSamplerRequest,
            tt.SaveWeightsForSamplerRequest(
                model_id="m", seq_id=7, sampling_session_seq_id=2, kind="inflight"
            ),
        ),
        (
            ours.SaveWeightsExternalRequest,
            tt.SaveWeightsExternalRequest(
                model_id="m", path="export", seq_id=8, age_encryption_recipients=["age1xyz"]
            ),
        ),
        (
            ours.LoadWeightsRequest,
            tt.LoadWeightsRequest(
                session_id="s",
                model_seq_id=1,
                path="tinker://s:train:0/weights/step-10",
                optimizer=True,
                user_metadata={"a": "b"},
                base_model="Qwen/Qwen3-8B",
            ),
        ),
        (
            ours.LoadWeightsRequest,
            tt.LoadWeightsRequest(
                session_id="s",
                model_seq_id=2,
                path="tinker://r/weights/x",
                optimizer=False,
                optimizer_config=tt.DimuonOptimizerConfig(),
                weights_access_token="tok",
            ),
        ),
        (
            ours.LoadWeightsRequest,
            tt.LoadWeightsRequest(
                model_id="m", seq_id=9, path="tinker://r/weights/x", optimizer=True
            ),
        ),
        (
            ours.CreateSamplingSessionRequest,
            tt.CreateSamplingSessionRequest(
                session_id="s", sampling_session_seq_id=0, base_model="m"
            ),
        ),
        (
            ours.CreateSamplingSessionRequest,
            tt.CreateSamplingSessionRequest(
                session_id="s", sampling_session_seq_id=1, model_path="tinker://r/sampler_weights/x"
            ),
        ),
        (
            ours.SampleRequest,
            tt.SampleRequest(
                num_samples=2,
                prompt=tt.ModelInput.from_ints([1, 2, 3, 4, 5]),
                sampling_params=tt.SamplingParams(max_tokens=3, temperature=0.7, seed=11),
                sampling_session_id="s:sample:0",
                seq_id=326578948000000000,
                prompt_logprobs=False,
                topk_prompt_logprobs=0,
                topk_sample_logprobs=0,
                prompt_alt_tokens_k=0,
                record_stability_info=False,
            ),
        ),
        (
            ours.SampleRequest,
            tt.SampleRequest(
                prompt=tt.ModelInput(chunks=chunks),
                sampling_params=tt.SamplingParams(stop=["\n\n", "</s>"]),
                sampling_session_id="s:sample:1",
                seq_id=0,
                prompt_logprobs=True,
                topk_prompt_logprobs=5,
                topk_sample_logprobs=3,
                target_prompt_logprobs=target,
                prompt_alt_tokens_k=4,
                prompt_logprobs_last_n=2,
                record_stability_info=True,
            ),
        ),
        (
            ours.SampleRequest,
            tt.SampleRequest(
                prompt=tt.ModelInput.from_ints([1]),
                sampling_params=tt.SamplingParams(stop=[151643, 2]),
            ),
        ),
        (
            ours.SampleRequest,
            tt.SampleRequest(
                prompt=tt.ModelInput.from_ints([1]), sampling_params=tt.SamplingParams(stop="###")
            ),
        ),
        (
            ours.SampleRequest,
            tt.SampleRequest(
                prompt=tt.ModelInput.from_ints([1]),
                sampling_params=tt.SamplingParams(stop=[], top_k=20, top_p=0.9),
            ),
        ),
        (
            ours.RetrieveFutureRequest,
            tt.FutureRetrieveRequest(request_id="r1", allow_metadata_only=True),
        ),
        (
            ours.RetrieveFuturesRequest,
            tt.FuturesRetrieveRequest(
                target=tt.futures_retrieve_request.SamplingSessionFuturesTarget(
                    sampling_session_id="s:sample:0", cloned_sampler_id=3
                ),
                prev_cursor=12,
                timeout=0,
                retrieved_request_ids=["a", "b"],
            ),
        ),
        (
            ours.JoinSamplingSessionRequest,
            tt.JoinSamplingSessionRequest(sampling_session_id="s:sample:0"),
        ),
        (
            ours.CreateCustomLossRequest,
            tt.CreateCustomLossRequest(
                session_id="s",
                custom_loss_seq_id=0,
                name="my_loss",
                inputs=[
                    tt.CustomLossInput(name="logprobs", rank=1),
                    tt.CustomLossInput(name="weights", rank=1),
                ],
                graph=tcl.CustomLossGraph(
                    nodes=[
                        tcl.CustomLossNode(op="placeholder", name="logprobs", target="logprobs"),
                        tcl.CustomLossNode(
                            op="call_function",
                            name="mul",
                            target="operator.mul",
                            args=[{"ref": "logprobs"}, {"float": "-inf"}],
                            kwargs={"k": [1, 2]},
                        ),
                        tcl.CustomLossNode(
                            op="output", name="output", target="output", args=[{"ref": "mul"}]
                        ),
                    ]
                ),
            ),
        ),
        (
            ours.CopyWeightsRequest,
            tt.CopyWeightsRequest(
                source_path="tinker://r/weights/x", destination_project_id="p", ttl_seconds=3600
            ),
        ),
        (
            ours.CopyWeightsRequest,
            tt.CopyWeightsRequest(
                source_path="tinker://r/sampler_weights/x", session_id="s", model_seq_id=4
            ),
        ),
        (
            ours.SessionSearchRequest,
            tt.SessionSearchRequest(
                display_name="run",
                user_metadata={"team": "rl"},
                owner=tso.UserSearchOwner(owner_urns=["urn:user:1"]),
                statuses=[
                    tsq.ActiveSessionStatusQuery(),
                    tsq.ClientFinishedSessionStatusQuery(reasons=["errored"]),
                ],
                limit=20,
                cursor=tt.SessionSearchCursor(last_created_at=NOW, last_session_id="s0"),
            ),
        ),
        (ours.SessionSearchRequest, tt.SessionSearchRequest()),
        (
            ours.TelemetrySendRequest,
            tt.TelemetrySendRequest(
                events=[
                    _event(tt.SessionStartEvent, event="SESSION_START"),
                    _event(tt.SessionEndEvent, event="SESSION_END", duration="PT12.5S"),
                    _event(
                        tt.UnhandledExceptionEvent,
                        event="UNHANDLED_EXCEPTION",
                        error_message="boom",
                        error_type="ValueError",
                        traceback="Traceback...",
                    ),
                    _event(
                        GenericEvent,
                        event="GENERIC_EVENT",
                        event_name="APIFuture.result",
                        event_data={"elapsed": 1.5, "nested": {"a": [1, 2]}},
                    ),
                ],
                platform="Linux",
                sdk_version="0.38.0",
                session_id="sessionless-123",
                process_uuid="0b4c",
            ),
        ),
    ]


@pytest.mark.parametrize(
    ("ours_cls", "request_obj"),
    _tinker_requests(),
    ids=lambda v: type(v).__name__ if isinstance(v, BaseModel) else v.__name__,
)
def test_request_json_from_tinker_validates_and_round_trips(
    ours_cls: type[BaseModel], request_obj: BaseModel
) -> None:
    sent = request_obj.model_dump(exclude_none=True, mode="json")
    parsed = ours_cls.model_validate(sent)
    assert parsed.model_dump(exclude_none=True, mode="json") == sent


@pytest.mark.parametrize(
    ("ours_cls", "body"),
    [
        # bodies tinker builds by hand rather than from a model
        (ours.WeightsInfoRequest, {"tinker_path": "tinker://r/weights/x"}),
        (ours.SetCheckpointTtlRequest, {"ttl_seconds": None}),
        (ours.SetCheckpointTtlRequest, {"ttl_seconds": 86400}),
        (ours.AssignSessionProjectRequest, {"project_id": "p"}),
        (ours.FinishSessionRequest, {"reason": {"type": "interrupted"}, "detail": None}),
        (ours.CancelFutureRequest, {"request_id": "r"}),
    ],
)
def test_hand_built_bodies_validate(ours_cls: type[BaseModel], body: dict[str, Any]) -> None:
    ours_cls.model_validate(body)


def test_sample_request_types_its_fields() -> None:
    sent = tt.SampleRequest(
        prompt=tt.ModelInput(chunks=[tt.ImageChunk(data=b"img", format="png", expected_tokens=2)]),
        sampling_params=tt.SamplingParams(stop=[1, 2]),
    ).model_dump(exclude_none=True, mode="json")
    parsed = ours.SampleRequest.model_validate(sent)
    chunk = parsed.prompt.chunks[0]
    assert isinstance(chunk, ours.ImageChunk) and chunk.data == b"img"
    assert parsed.sampling_params.stop == [1, 2]
    assert ours.SampleRequest.model_validate(
        {**sent, "sampling_params": {"stop": ["a"]}}
    ).sampling_params.stop == ["a"]


def test_unknown_fields_are_rejected_with_their_name() -> None:
    body = tt.GetInfoRequest(model_id="m").model_dump(mode="json")
    with pytest.raises(ValueError, match="model_idd"):
        ours.GetInfoRequest.model_validate({**body, "model_idd": "x"})


# ---- responses: what a Treadle server answers, read by tinker's strict response models ---


def _checkpoint() -> ours.Checkpoint:
    return ours.Checkpoint(
        checkpoint_id="weights/step-10",
        checkpoint_type="training",
        time=NOW,
        tinker_path="tinker://s:train:0/weights/step-10",
        size_bytes=1024,
        user_metadata={"a": "b"},
    )


def _responses() -> list[tuple[BaseModel, type[Any]]]:
    run = ours.TrainingRun(
        training_run_id="s:train:0",
        base_model="Qwen/Qwen3-8B",
        model_owner="tenant-1",
        is_lora=True,
        lora_rank=8,
        last_request_time=NOW,
        last_checkpoint=_checkpoint(),
        user_metadata={"renderer_name": "qwen3"},
    )
    return [
        (ours.ClientConfigResponse(use_pyqwest_transport=False), tt.ClientConfigResponse),
        (ours.ClientConfigResponse(), tt.ClientConfigResponse),
        (ours.ClientDynamicConfigResponse(), tt.ClientDynamicConfigResponse),
        (ours.CreateSessionResponse(session_id="s", info_message="hi"), tt.CreateSessionResponse),
        (ours.SessionHeartbeatResponse(), tt.SessionHeartbeatResponse),
        (ours.TelemetryResponse(), tt.TelemetryResponse),
        (ours.HealthResponse(), tt.HealthResponse),
        (ours.AuthTokenResponse(jwt="eyJ.x.y"), tt.AuthTokenResponse),
        (
            ours.ServerCapabilities(
                supported_models=[ours.SupportedModel(model_name="m", max_context_length=4096)]
            ),
            tt.GetServerCapabilitiesResponse,
        ),
        (ours.UntypedAPIFuture(request_id="r", model_id="s:train:0"), tt.shared.UntypedAPIFuture),
        (
            ours.UntypedAPIFuture(request_id="r", sample_sequence_ids=["q1", "q2"]),
            tt.shared.UntypedAPIFuture,
        ),
        (ours.TryAgainResponse(request_id="r", queue_state="paused_capacity"), TryAgainResponse),
        (ours.FutureError(error="rank too big", category="user"), tt.RequestFailedResponse),
        (ours.CreateModelResponse(model_id="s:train:0"), tt.CreateModelResponse),
        (
            ours.GetInfoResponse(
                model_id="s:train:0",
                model_data=ours.ModelData(model_name="m", tokenizer_id="org/tok"),
                is_lora=True,
                lora_rank=8,
                model_name="m",
            ),
            tt.GetInfoResponse,
        ),
        (ours.UnloadModelResponse(model_id="m"), tt.UnloadModelResponse),
        (ours.OptimStepResponse(metrics={"grad_norm:mean": 1.5}), tt.OptimStepResponse),
        (ours.SaveWeightsResponse(path="tinker://r/weights/x"), tt.SaveWeightsResponse),
        (
            ours.SaveWeightsForSamplerResponse(sampling_session_id="s:sample:1"),
            tt.SaveWeightsForSamplerResponseInternal,
        ),
        (
            ours.SaveWeightsExternalResponse(path="tinker://r/external_weights/x", size_bytes=10),
            tt.SaveWeightsExternalResponseInternal,
        ),
        (
            ours.LoadWeightsResponse(path="tinker://r/weights/x", model_id="s:train:1"),
            tt.LoadWeightsResponse,
        ),
        (
            ours.CreateSamplingSessionResponse(sampling_session_id="s:sample:0"),
            tt.CreateSamplingSessionResponse,
        ),
        (ours.GetSamplerResponse(sampler_id="s:sample:0", base_model="m"), tt.GetSamplerResponse),
        (ours.JoinSamplingSessionResponse(client_counter=2), tt.JoinSamplingSessionResponse),
        (ours.CreateCustomLossResponse(loss_id="L"), tt.CreateCustomLossResponse),
        (
            ours.RetrieveFuturesResponse(
                completions=[
                    ours.FutureFinished(request_id="a", response_payload_uncompressed_size=10),
                    ours.FutureFailed(request_id="b"),
                ],
                cursor=3,
            ),
            tt.FuturesRetrieveResponse,
        ),
        (_checkpoint(), tt.Checkpoint),
        (run, tt.TrainingRun),
        (
            ours.TrainingRunsResponse(
                training_runs=[run], cursor=ours.Cursor(offset=0, limit=20, total_count=1)
            ),
            tt.TrainingRunsResponse,
        ),
        (ours.CheckpointsListResponse(checkpoints=[_checkpoint()]), tt.CheckpointsListResponse),
        (
            ours.WeightsInfoResponse(base_model="m", is_lora=True, lora_rank=8, train_mlp=True),
            tt.WeightsInfoResponse,
        ),
        (
            ours.ExternalWeightsUrlsResponse(
                urls={"adapter_model.safetensors": "http://x"}, expires=NOW
            ),
            tt.ExternalWeightsUrlsResponse,
        ),
        (ours.CopyWeightsResponse(tinker_path="tinker://r2/weights/x"), tt.CopyWeightsResponse),
        (ours.ListSessionsResponse(sessions=["a", "b"]), tt.ListSessionsResponse),
        (
            ours.GetSessionResponse(training_run_ids=["s:train:0"], sampler_ids=[]),
            tt.GetSessionResponse,
        ),
        (
            ours.SessionSearchResponse(
                sessions=[
                    ours.SessionSummary(
                        session_id="s",
                        created_at=NOW,
                        owner="u",
                        project_id="p",
                        checkpoints_count=2,
                        status=ours.SessionFailed(
                            category="user",
                            reason=ours.SessionFailedReason(
                                type="training_run", training_run_id="s:train:0"
                            ),
                            message="bad",
                        ),
                    )
                ],
                next_cursor=ours.SessionSearchCursor(last_created_at=NOW, last_session_id="s"),
            ),
            tt.SessionSearchResponse,
        ),
    ]


@pytest.mark.parametrize(
    ("response", "tinker_cls"), _responses(), ids=lambda v: getattr(v, "__name__", type(v).__name__)
)
@pytest.mark.parametrize("exclude_none", [False, True])
def test_tinker_accepts_our_responses(
    response: BaseModel, tinker_cls: type[Any], exclude_none: bool
) -> None:
    body = response.model_dump(mode="json", exclude_none=exclude_none)
    echoed = tinker_cls.model_validate(body).model_dump(mode="json")
    for key, value in body.items():
        if value is not None and isinstance(value, str | int | float | bool):
            assert echoed[key] == value, key


def test_try_again_and_error_bodies_drive_tinker_future_dispatch() -> None:
    # api_future_impl looks at these exact keys before any model validation.
    assert ours.TryAgainResponse(request_id="r").model_dump(mode="json")["type"] == "try_again"
    meta = ours.CompleteMetadataResponse(response_payload_size=10).model_dump(mode="json")
    assert meta == {"response_payload_size": 10, "status": "complete_metadata"}
    err = ours.FutureError(error="x", category="server").model_dump(mode="json")
    assert tt.RequestFailedResponse.model_validate(err).category == tt.RequestErrorCategory.Server


def test_image_chunk_json_is_base64() -> None:
    chunk = ours.ImageChunk(data=b"\x00\x01", format="png")
    assert chunk.model_dump(mode="json")["data"] == base64.b64encode(b"\x00\x01").decode()
    assert tt.ImageChunk.model_validate(chunk.model_dump(mode="json")).data == b"\x00\x01"


def test_tensor_data_json_matches_tinker() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    theirs = tt._pydantic_types.tensor_data.TensorData.from_numpy(arr).model_dump(mode="json")
    assert ours.TensorData.from_numpy(arr).model_dump(mode="json") == theirs
    assert ours.TensorData.model_validate(theirs).to_numpy().tolist() == arr.tolist()
    assert isinstance(tinker.TensorData, type)
