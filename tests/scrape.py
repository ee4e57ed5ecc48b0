"""Reading Prometheus metrics as a scraper does: the text format parsed into samples, summed by
labels, compared between two scrapes."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""Each sample's value by (sample name, its labels)."""


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    response = httpx.get(url, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return parse(response.text)


def reachable(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def by(samples: Samples, name: str, *labels: str) -> Counter[tuple[str, ...]]:
    """The samples named `name`, summed by the values of `labels` (whole numbers)."""
    sums: Counter[tuple[str, ...]] = Counter()
    for (sample, labelset), value in samples.items():
        if sample == name:
            values = dict(labelset)
            sums[tuple(values.get(label, "") for label in labels)] += int(value)
    return sums


def delta(before: Samples, after: Samples, name: str, *labels: str) -> dict[tuple[str, ...], int]:
    """What grew (or shrank) between two scrapes, by the values of `labels`."""
    grown = by(after, name, *labels)
    grown.subtract(by(before, name, *labels))
    return {key: value for key, value in grown.items() if value}


def eventually(check: Callable[[], bool], seconds: float = 30) -> None:
    """Wait for `check`: an op's result is readable as its transaction commits, and counted
    just after."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "the metrics never caught up with the database"
        time.sleep(0.05)
