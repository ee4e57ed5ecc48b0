"""The loss names are written three times, by design: the wire's (the SDK's `LossFnType`, the
Tinker API's names), the engine's torch-free protocol (what the engine knows), and the engine's
implementations. The SDK may not import the engine, nor the engine the wire; this holds the three
lists to one another instead."""

from __future__ import annotations

import pytest

from gpu_worker import protocol
from gpu_worker.losses import LOSSES
from treadle.types import LOSS_FNS as WIRE_LOSS_FNS

pytestmark = pytest.mark.unit

# Names of the Tinker API that are not server-side losses: `custom` is computed by the client
# (forward_backward_custom), and the engine refuses `stable_reinforce` with an explanation.
CLIENT_SIDE = {"custom"}
REFUSED = {"stable_reinforce"}


def test_the_engine_knows_every_loss_the_wire_names() -> None:
    assert set(protocol.LOSS_FNS) == set(WIRE_LOSS_FNS) - CLIENT_SIDE


def test_every_known_loss_is_implemented_or_refused_with_a_reason() -> None:
    assert set(LOSSES) == set(protocol.LOSS_FNS) - REFUSED
