"""Recipe data: conversations and preference pairs, their held-out split and their batches.

A conversation is the `messages` list of Tulu 3 and UltraChat: `[{"role": ..., "content":
...}, ...]` with roles `system`, `user` and `assistant`. A preference pair is a prompt (a
conversation, or a string taken as one user message) and two assistant replies, `chosen` and
`rejected`. Both come from JSON-lines files, one record per line, or, given a name that is not
a file, from a Hugging Face dataset with the same columns (`pip install datasets`; the sample
files in cookbook/data/ need nothing).

Batches are a function of (seed, step): the order is a fresh permutation per epoch, so a
resumed recipe sees exactly the batches it would have seen without the interruption.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ROLES = ("system", "user", "assistant")
Message = dict[str, str]
Conversation = list[Message]

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "data"
"""The sample files shipped beside the package (present in a source checkout)."""


@dataclass(frozen=True)
class Preference:
    """One comparison: after `prompt`, the reply `chosen` is preferred to `rejected`."""

    prompt: Conversation
    chosen: str
    rejected: str


def load_conversations(
    source: str | Path, *, split: str = "train", limit: int | None = None
) -> list[Conversation]:
    """The conversations of a JSON-lines file, or of a Hugging Face dataset by name.

    Args:
        source: a `.jsonl` file whose records have a `messages` list, or a dataset name
            (e.g. `allenai/tulu-3-sft-mixture`) whose rows do.
        split: the dataset split (datasets only).
        limit: keep the first `limit` conversations.

    Raises:
        ValueError: a record has no `messages`, an unknown role, non-text content, or no
            assistant message; the message names the record.
        ImportError: a dataset name was given and `datasets` is not installed.
    """
    records = _records(source, split, limit)
    return [_conversation(record.get("messages"), f"{source} record {i}") for i, record in records]


def load_preferences(
    source: str | Path, *, split: str = "train", limit: int | None = None
) -> list[Preference]:
    """The preference pairs of a JSON-lines file or dataset with `prompt`, `chosen` and
    `rejected` (the prompt a conversation or a string; the replies strings).

    Raises:
        ValueError: a record lacks one of the three, or they have the wrong types.
        ImportError: as for `load_conversations`.
    """
    pairs = []
    for i, record in _records(source, split, limit):
        where = f"{source} record {i}"
        prompt = record.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        chosen, rejected = record.get("chosen"), record.get("rejected")
        if not isinstance(chosen, str) or not isinstance(rejected, str):
            raise ValueError(f"{where}: `chosen` and `rejected` must be strings (the replies)")
        pairs.append(Preference(_messages(prompt, where), chosen, rejected))
    return pairs


def split_held_out(items: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Shuffle by `seed` and hold out `fraction` of the items (at least one when fraction > 0).

    Returns:
        (train, held_out).

    Raises:
        ValueError: fraction is outside [0, 1), or nothing would be left to train on.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"held-out fraction {fraction} must be in [0, 1)")
    order = list(items)
    random.Random(seed).shuffle(order)
    count = max(1, round(len(order) * fraction)) if fraction > 0 else 0
    if count >= len(order):
        raise ValueError(
            f"holding out {count} of {len(order)} items leaves none to train on; "
            "lower the fraction or add data"
        )
    return order[count:], order[:count]


def batch(items: Sequence[T], batch_size: int, step: int, seed: int) -> list[T]:
    """The batch of `step`: items `step * batch_size` onward of an endless sequence of epochs,
    each epoch a permutation drawn from (seed, epoch).

    Raises:
        ValueError: no items, or batch_size < 1.
    """
    if not items or batch_size < 1:
        raise ValueError(f"cannot batch {len(items)} items by {batch_size}")
    out = []
    for index in range(step * batch_size, (step + 1) * batch_size):
        epoch, position = divmod(index, len(items))
        out.append(items[_permutation(len(items), seed, epoch)[position]])
    return out


def _permutation(size: int, seed: int, epoch: int) -> list[int]:
    order = list(range(size))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def _records(
    source: str | Path, split: str, limit: int | None
) -> Iterable[tuple[int, dict[str, Any]]]:
    path = Path(source)
    if path.exists() or path.suffix in (".jsonl", ".json"):
        rows: Iterable[Any] = _read_jsonl(path)
    else:
        rows = _load_dataset(str(source), split)
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        if not isinstance(row, dict):
            raise ValueError(f"{source} record {i}: expected a JSON object, got {row!r:.60}")
        yield i, row


def _read_jsonl(path: Path) -> Iterable[Any]:
    if not path.exists():
        raise FileNotFoundError(f"no data file {path}; pass an existing .jsonl file")
    with path.open() as file:
        for line in file:
            if line.strip():
                yield json.loads(line)


def _load_dataset(name: str, split: str) -> Iterable[Any]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{name!r} is not a file, so it is read as a Hugging Face dataset, which needs the "
            "`datasets` package: pip install 'treadle-cookbook[datasets]', or pass a .jsonl path"
        ) from None
    return iter(datasets.load_dataset(name, split=split))


def _conversation(messages: Any, where: str) -> Conversation:
    conversation = _messages(messages, where)
    if not any(message["role"] == "assistant" for message in conversation):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")
    return conversation


def _messages(messages: Any, where: str) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of {{role, content}} messages")
    out = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(
                f"{where}: message {message!r:.80} needs a role in {ROLES} and text content"
            )
        out.append({"role": role, "content": content})
    return out
