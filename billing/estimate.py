"""What an operation will cost, estimated from its request before it runs.

The quantities come from what the request says: a forward or forward_backward trains the
tokens of its model inputs; a sample prefills its prompt and generates at most `max_tokens`
per sequence; a save writes one checkpoint; optim_step, load and create use nothing priced.
They are the most the op can use, so an estimate never falls short of the op's real cost
under the same prices. Pricing them reads the price book in force at the given time.

It knows nothing of limits (`billing.limits` holds estimates against them) or of how a
request's body is parsed: callers count the tokens.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import datetime

from sqlalchemy.orm import Session as OrmSession

from billing.ledger import UsageLine
from billing.prices import PriceCache, Rate, cost_micros, rate_in_force
from core.clock import Clock

RateLookup = Callable[[OrmSession, str, str, datetime], Rate | None]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What one op will use, on the base model it runs on."""

    base_model: str
    usage: tuple[UsageLine, ...]


@dataclasses.dataclass(frozen=True)
class PricedLine:
    """One kind of usage and what it costs now (`price_id` None: unpriced, free)."""

    kind: str
    quantity: int
    cached_quantity: int
    price_id: int | None
    amount_micros: int


def training(tokens: int) -> tuple[UsageLine, ...]:
    """forward_backward or forward: the tokens of the model inputs, at the training rate."""
    return (UsageLine("training", tokens),) if tokens > 0 else ()


def sample(prompt_tokens: int, max_tokens: int, num_samples: int) -> tuple[UsageLine, ...]:
    """A sample: the prompt prefilled once, and up to `max_tokens` for each sequence.
    compute_logprobs arrives as a sample of one token: its prompt at the prefill rate, and
    that one token."""
    lines = [
        UsageLine("sampling_prefill", prompt_tokens),
        UsageLine("sampling_sample", max_tokens * num_samples),
    ]
    return tuple(line for line in lines if line.quantity > 0)


def checkpoint() -> tuple[UsageLine, ...]:
    """A save: one checkpoint at the checkpoint price (its storage is metered while held)."""
    return (UsageLine("checkpoint", 1),)


def price_lines(
    db: OrmSession,
    base_model: str,
    usage: Sequence[UsageLine],
    at: datetime,
    rates: RateLookup = rate_in_force,
) -> list[PricedLine]:
    """Each line priced by the version in force for `base_model` at `at`."""
    priced = []
    for line in usage:
        rate = rates(db, base_model, line.kind, at)
        priced.append(
            PricedLine(
                kind=line.kind,
                quantity=line.quantity,
                cached_quantity=line.cached_quantity,
                price_id=None if rate is None else rate.id,
                amount_micros=cost_micros(rate, line.quantity, line.cached_quantity),
            )
        )
    return priced


_caches: weakref.WeakKeyDictionary[Clock, PriceCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def price_cache(clock: Clock) -> PriceCache:
    """This process's price cache for times told by `clock` (a fake clock's times are its own):
    estimates run on every submission of a tenant with a limit, and the cache spares them the
    price book's queries."""
    with _caches_lock:
        cache = _caches.get(clock)
        if cache is None:
            cache = _caches[clock] = PriceCache(clock)
        return cache


def estimate_micros(db: OrmSession, clock: Clock, estimate: Estimate) -> int:
    """What the op is expected to cost now, in micro-units."""
    if not estimate.usage:
        return 0
    lines = price_lines(db, estimate.base_model, estimate.usage, clock.now(), price_cache(clock))
    return sum(line.amount_micros for line in lines)
