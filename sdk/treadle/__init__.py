"""Treadle client: drive LoRA training and sampling loops on a remote Treadle server.

```python
import treadle
from treadle import types

with treadle.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...") as service:
    trainer = service.create_lora_training_client("treadle/tiny-1m", rank=8)
    fwd = trainer.forward_backward(batch, "cross_entropy")
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-3))
    print(fwd.result().metrics["loss:sum"])
```

This package knows nothing of the server's internals; the server imports its wire types
(`treadle.types`) so the two cannot drift. Importing it never imports torch, numpy or
transformers.
"""

__version__ = "0.1.0"

from treadle import types
from treadle._http import RetryPolicy
from treadle.client import RestClient, SamplingClient, ServiceClient, TrainingClient
from treadle.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ClientClosedError,
    FutureExpiredError,
    InternalServerError,
    InvalidArgumentError,
    MissingDependencyError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    QuotaExceededError,
    RateLimitError,
    RequestFailedError,
    RequestNotFoundError,
    RequestRejectedError,
    SessionExpiredError,
    SpendLimitReachedError,
    TreadleError,
    UsageError,
)
from treadle.futures import APIFuture
from treadle.types import (
    AdamParams,
    Checkpoint,
    CheckpointType,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoraConfig,
    ModelInput,
    ModelInputChunk,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    TensorData,
    TensorDtype,
    TrainingRun,
)

TinkerError = TreadleError
"""tinker's name for the base of its errors, so `except tinker.TinkerError` ports unchanged."""

__all__ = [
    "APIConnectionError",
    "APIFuture",
    "APIStatusError",
    "APITimeoutError",
    "AdamParams",
    "AuthenticationError",
    "BadRequestError",
    "Checkpoint",
    "CheckpointType",
    "ClientClosedError",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "FutureExpiredError",
    "InternalServerError",
    "InvalidArgumentError",
    "LoraConfig",
    "MissingDependencyError",
    "ModelInput",
    "ModelInputChunk",
    "NotFoundError",
    "OptimStepResponse",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "RateLimitError",
    "RequestFailedError",
    "RequestNotFoundError",
    "RequestRejectedError",
    "RestClient",
    "RetryPolicy",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "SessionExpiredError",
    "SpendLimitReachedError",
    "StopReason",
    "TensorData",
    "TensorDtype",
    "TinkerError",
    "TrainingClient",
    "TrainingRun",
    "TreadleError",
    "UsageError",
    "__version__",
    "types",
]
