"""A training loop in its own process, for the tests that kill it mid-loop.

Usage: `python -m tests.e2e._looping_client BASE_URL API_KEY`. It prints `ready <session id>`
once its session is open and its first step is done, then trains until it is stopped. It never
calls `close()`: ending the session is left to the SDK's exit handling.
"""

from __future__ import annotations

import sys

import treadle
from treadle import types

MODEL = "treadle/tiny-1m"


def main(base_url: str, api_key: str) -> None:
    service = treadle.ServiceClient(base_url=base_url, api_key=api_key)
    trainer = service.create_lora_training_client(MODEL, rank=4)
    tokens = [(7 * i) % 500 + 10 for i in range(17)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_list(tokens[1:], "int64"),
            "weights": types.TensorData.from_list([1.0] * 16, "float32"),
        },
    )
    step = 0
    while True:
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        if step == 0:
            print("ready", service.session_id, flush=True)
        step += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
