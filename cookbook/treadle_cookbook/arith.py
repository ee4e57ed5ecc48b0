"""Problems with checkable answers for math RL: 3-digit addition and GSM8K-format files.

The addition task is small enough to learn on a CPU: `"042+007="` is answered `"0049"` then
end-of-sequence, one character per token, so a ~1M-parameter model trained from scratch
(`cookbook/scripts/make_arith_model.py`) reaches the regime where reinforcement learning has
something to improve within minutes. `VOCAB` is that model's whole vocabulary; 1,000 fixed
problems (`held_out()`) never appear in training (`training_problems` skips them), so
accuracy on them measures generalisation.

GSM8K-format files (JSON lines of `question` and `answer`, the answer ending in `#### N`)
give the same `Problem`s for users who have the data and a model that can read them.

This module knows nothing of the server: prompts and answers are text, graded as text.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DIGITS = 3
"""Operands are 0..999, written with 3 digits; their sum with 4."""
EOS = "<eos>"
PAD = "<pad>"
VOCAB: tuple[str, ...] = (*"0123456789", "+", "=", EOS, PAD)
"""Token id = position. The model's embedding has `MODEL_VOCAB_SIZE` rows; the rest are unused."""
MODEL_VOCAB_SIZE = 16
ANSWER_TOKENS = DIGITS + 2
"""The answer's digits and the end-of-sequence token."""
HELD_OUT_SIZE = 1000
HELD_OUT_SEED = 20_241_201


@dataclass(frozen=True)
class Problem:
    """A prompt and the answer a correct completion states (without end-of-sequence)."""

    prompt: str
    answer: str


def addition(a: int, b: int) -> Problem:
    """`addition(42, 7)` is `Problem("042+007=", "0049")`."""
    if not (0 <= a < 10**DIGITS and 0 <= b < 10**DIGITS):
        raise ValueError(f"operands must be in [0, {10**DIGITS - 1}], got {a} and {b}")
    return Problem(f"{a:0{DIGITS}d}+{b:0{DIGITS}d}=", f"{a + b:0{DIGITS + 1}d}")


def held_out() -> list[Problem]:
    """The 1,000 fixed evaluation problems (distinct pairs, the same on every call)."""
    rng = random.Random(HELD_OUT_SEED)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < HELD_OUT_SIZE:
        pairs[(rng.randrange(10**DIGITS), rng.randrange(10**DIGITS))] = None
    return [addition(a, b) for a, b in pairs]


def training_problems(seed: int) -> Iterator[Problem]:
    """An endless stream of uniformly random problems, never one of `held_out()`."""
    excluded = {p.prompt for p in held_out()}
    rng = random.Random(seed)
    while True:
        problem = addition(rng.randrange(10**DIGITS), rng.randrange(10**DIGITS))
        if problem.prompt not in excluded:
            yield problem


def encode(text: str) -> list[int]:
    """Token ids of a text over `VOCAB` (digits, `+`, `=`); `EOS` is not a character."""
    try:
        return [VOCAB.index(ch) for ch in text]
    except ValueError:
        raise ValueError(f"{text!r} has characters outside {VOCAB[:12]}") from None


def exact_match(problem: Problem, completion: str) -> bool:
    """Whether the completion (sampled text before end-of-sequence) is exactly the answer."""
    return completion == problem.answer


# -- GSM8K format ---------------------------------------------------------------------------

_FINAL_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def final_answer(text: str) -> str | None:
    """The number after the last `####` in `text`, commas removed; None when there is none."""
    found = _FINAL_ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def load_gsm8k(path: Path) -> list[Problem]:
    """Problems from a GSM8K-format JSON-lines file (`question`, `answer` ending `#### N`).

    Raises:
        ValueError: a line lacks either field or its answer has no `#### N`; the message names
            the line.
    """
    problems = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            answer = final_answer(str(row.get("answer", "")))
            if "question" not in row or answer is None:
                raise ValueError(
                    f"{path}:{number}: expected a 'question' and an 'answer' ending in "
                    "'#### <number>' (the GSM8K format)"
                )
            problems.append(Problem(gsm8k_prompt(row["question"]), answer))
    return problems


def final_answer_match(problem: Problem, completion: str) -> bool:
    """Whether the completion's `#### N` states the problem's answer."""
    return final_answer(completion) == problem.answer
