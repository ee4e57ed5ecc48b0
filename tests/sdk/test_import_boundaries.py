"""`treadle` stays a light client: no tinker, torch, numpy or server packages on import."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

FORBIDDEN = ("tinker", "torch", "numpy", "api", "core", "scheduler", "billing", "gpu_worker")


def test_importing_treadle_pulls_in_nothing_heavy() -> None:
    code = (
        "import sys, treadle, treadle.types, treadle.wire, treadle.proto\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == ""


def test_codecs_work_without_numpy() -> None:
    code = """
import sys
sys.modules["numpy"] = None  # any `import numpy` now fails
from treadle.types import *
from treadle.wire import *
req = ForwardBackwardRequest(
    model_id="m", seq_id=1, loss_fn="cross_entropy",
    data=[Datum(model_input=ModelInput.from_ints([1, 2]),
                loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 0.5]})],
)
assert decode_forward_backward_request(encode_forward_backward_request(req, compress=True)) == req
out = ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": TensorData(data=[-1.0], dtype="float32")}])
assert decode_forward_backward_output(encode_forward_backward_output(out)).loss_fn_outputs[0]["logprobs"].data == [-1.0]
resp = SampleResponse(sequences=[SampledSequence(stop_reason="stop", tokens=[1])], prompt_logprobs=[None, -1.0])
assert decode_sample_response(encode_sample_response(resp)) == resp
try:
    TensorData(data=[1], dtype="int64").to_numpy()
except ImportError as exc:
    assert "treadle[numpy]" in str(exc)
else:
    raise AssertionError("to_numpy should need numpy")
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
