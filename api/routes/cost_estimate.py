"""The pre-flight cost estimate: what some work would cost at the prices in force now (a
Treadle extension of the protocol). It reads the price book only; nothing is reserved."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentPrincipal, ReadSession, State
from api.openapi import error_responses
from billing.estimate import price_lines
from billing.ledger import UsageLine
from billing.tables import USAGE_KINDS
from core.errors import InvalidInput
from treadle.types import CostEstimateLine, CostEstimateRequest, CostEstimateResponse, dollars

router = APIRouter(prefix="/api/v1/billing", tags=["billing"])


@router.post(
    "/estimate",
    response_model=CostEstimateResponse,
    response_model_exclude_none=True,
    responses=error_responses(401, 403, 413, 422),
)
def estimate(
    body: CostEstimateRequest, _: CurrentPrincipal, state: State, db: ReadSession
) -> CostEstimateResponse:
    """The cost of each usage kind given, and the total, on `base_model` at the prices in
    force now, in micro-units and as decimal strings."""
    if body.base_model not in state.settings.offered_models:
        raise InvalidInput(
            f"base model {body.base_model!r} is not served here; use one of "
            f"{state.settings.offered_models}"
        )
    for kind, quantity in body.usage.items():
        if kind not in USAGE_KINDS:
            raise InvalidInput(f"usage kind {kind!r} is unknown; use one of {list(USAGE_KINDS)}")
        if quantity < 0:
            raise InvalidInput(f"usage[{kind!r}] is {quantity}; pass a quantity of 0 or more")
    prefill = body.usage.get("sampling_prefill", 0)
    if body.cached_prefill_tokens > prefill:
        raise InvalidInput(
            f"cached_prefill_tokens {body.cached_prefill_tokens} exceeds the "
            f"{prefill} sampling_prefill tokens; cached tokens are part of the prefill"
        )
    now = state.clock.now()
    usage = [
        UsageLine(kind, quantity, body.cached_prefill_tokens if kind == "sampling_prefill" else 0)
        for kind, quantity in body.usage.items()
    ]
    # Priced under the name asked for, as the ledger prices a run on it.
    priced = price_lines(db, body.base_model, usage, now)
    total = sum(line.amount_micros for line in priced)
    return CostEstimateResponse(
        base_model=body.base_model,
        priced_at=now,
        lines=[
            CostEstimateLine(
                kind=line.kind,
                quantity=line.quantity,
                cached_quantity=line.cached_quantity,
                price_id=line.price_id,
                amount_micros=line.amount_micros,
                amount=dollars(line.amount_micros),
            )
            for line in priced
        ],
        total_micros=total,
        total=dollars(total),
    )
