"""Programming problems in the DeepCoder format, graded by running the answer in the sandbox.

A problem is a statement and tests. This module reads the rows of DeepCoder-Preview-Dataset
(and files written the same way, like cookbook/data/code_problems.jsonl): `problem` (the text),
`tests` (a JSON string or the decoded value) and optional `metadata` holding `func_name`.
Two shapes of `tests` are supported:

- a list of `{"input": str, "output": str, "testtype": "stdin" | "functional"}` (the
  LiveCodeBench and PrimeIntellect rows; `testtype` defaults to "stdin");
- a dict `{"inputs": [...], "outputs": [...], "fn_name": str?}` (the TACO rows): without
  `fn_name`, inputs and outputs are stdin and stdout texts; with it, `inputs[i]` is the list of
  arguments and `outputs[i]` the return value.

A stdin test runs the program with the input and compares stdout line by line, trailing
whitespace and trailing blank lines ignored. A functional test calls `func_name`, a top-level
function or a method of a `class Solution`, with the arguments given one JSON value per line,
and compares the JSON of its return value with the expected JSON value. Other test types
(checkers that accept several outputs, floating-point tolerances) are refused when loading.

The answer is the first ```python fenced block of a completion (one left unclosed does not
count). Reward: 1.0 when it passes every test, 0.0 when any fails, -0.1 when there is no block.

The two-turn flow: in its first answer the model may call the `check_solution` tool by wrapping
a ```python block in `<check_solution>` and `</check_solution>`. The block is run on the first
`tool_tests` tests and the results come back as a tool message; the model then answers again,
and that second answer is graded on all tests. A first answer without the tag is graded as the
final answer. A tag in the second answer runs nothing.

The flow is a conversation of messages (system instructions, the user's problem, the first
answer, a `tool` message, the second answer) that `renderers.Renderer` turns into tokens with
the model's chat template; this module does not tokenize.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from treadle_cookbook.data import Conversation, Message
from treadle_cookbook.sandbox import Limits, run_python

NO_CODE_REWARD = -0.1
TOOL_OPEN, TOOL_CLOSE = "<check_solution>", "</check_solution>"
_CODE_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)
_TOOL_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)
_SHOWN_CHARS = 200

TestKind = Literal["stdin", "functional"]

INSTRUCTIONS = (
    "Solve the problem in Python. Put your final program in one ```python block. "
    f"Before answering you may test a draft once: write {TOOL_OPEN}, a ```python block, "
    f"then {TOOL_CLOSE}, and stop; the results come back and you answer again."
)


@dataclass(frozen=True)
class Case:
    input: str
    output: str
    kind: TestKind


@dataclass(frozen=True)
class CodeProblem:
    id: str
    text: str
    tests: tuple[Case, ...]
    fn_name: str | None = None


@dataclass(frozen=True)
class CaseResult:
    passed: bool
    detail: str  # what went wrong, empty when passed


def from_deepcoder(row: Mapping[str, Any], default_id: str = "") -> CodeProblem:
    """A problem from one DeepCoder row; raises ValueError naming what is not supported."""
    tests = row["tests"]
    if isinstance(tests, str):
        tests = json.loads(tests)
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    fn_name = metadata.get("func_name")
    if isinstance(tests, dict):
        fn_name = tests.get("fn_name") or fn_name
        cases = tuple(
            _taco_case(i, o, fn_name)
            for i, o in zip(tests["inputs"], tests["outputs"], strict=True)
        )
    else:
        cases = tuple(_listed_case(t) for t in tests)
    if not cases:
        raise ValueError(f"problem {row.get('id', default_id)!r} has no tests")
    if any(c.kind == "functional" for c in cases) and not fn_name:
        raise ValueError("functional tests need metadata.func_name (or tests.fn_name)")
    return CodeProblem(str(row.get("id", default_id)), row["problem"], cases, fn_name)


def _listed_case(test: Mapping[str, Any]) -> Case:
    kind = test.get("testtype", "stdin")
    if kind not in ("stdin", "functional"):
        raise ValueError(f"test type {kind!r} is not supported; use 'stdin' or 'functional'")
    return Case(str(test["input"]), str(test["output"]), kind)


def _taco_case(inputs: Any, output: Any, fn_name: str | None) -> Case:
    if fn_name is None:
        return Case(_text(inputs), _text(output), "stdin")
    return Case("\n".join(json.dumps(arg) for arg in inputs), json.dumps(output), "functional")


def _text(value: Any) -> str:
    return "\n".join(value) if isinstance(value, list) else str(value)


def load_problems(path: Path) -> list[CodeProblem]:
    """The problems of a JSON-lines file, one DeepCoder row per line."""
    lines = path.read_text().splitlines()
    return [from_deepcoder(json.loads(line), f"{path.stem}-{i}") for i, line in enumerate(lines)]


def extract_code(completion: str) -> str | None:
    """The body of the first closed ```python block, or None."""
    match = _CODE_BLOCK.search(completion)
    return match.group(1) if match else None


def tool_call(completion: str) -> str | None:
    """The text inside the first `<check_solution>` tag, or None when the answer makes no call."""
    match = _TOOL_CALL.search(completion)
    return match.group(1) if match else None


def run_tests(
    problem: CodeProblem,
    code: str,
    limits: Limits,
    *,
    tests: Sequence[Case] | None = None,
    stop_at_failure: bool = False,
) -> list[CaseResult]:
    """Each test's result, one sandbox run per test."""
    results = []
    for test in problem.tests if tests is None else tests:
        results.append(_run_test(problem, code, test, limits))
        if stop_at_failure and not results[-1].passed:
            break
    return results


def _run_test(problem: CodeProblem, code: str, test: Case, limits: Limits) -> CaseResult:
    program = code if test.kind == "stdin" else code + _call_harness(problem.fn_name or "")
    result = run_python(program, test.input, limits)
    if result.kill_reason is not None:
        return CaseResult(False, f"killed: {result.kill_reason}")
    if result.exit_code != 0:
        last_line = (result.stderr.strip().splitlines() or [""])[-1]
        return CaseResult(False, f"exit code {result.exit_code}: {_shown(last_line)}")
    if _same_output(test, result.stdout):
        return CaseResult(True, "")
    return CaseResult(
        False,
        f"input {_shown(test.input)!r}: expected {_shown(test.output)!r}, "
        f"got {_shown(result.stdout)!r}",
    )


def _call_harness(fn_name: str) -> str:
    # Appended to the answer: reads one JSON argument a line from stdin, prints the JSON result.
    return (
        "\n\nimport json as _json, sys as _sys\n"
        f"_fn = globals().get({fn_name!r}) or getattr(globals()['Solution'](), {fn_name!r})\n"
        "_args = [_json.loads(l) for l in _sys.stdin.read().splitlines() if l.strip()]\n"
        "print(_json.dumps(_fn(*_args)))\n"
    )


def _same_output(test: Case, stdout: str) -> bool:
    if test.kind == "functional":
        try:
            return bool(json.loads(stdout) == json.loads(test.output))
        except json.JSONDecodeError:
            return False
    return _lines(stdout) == _lines(test.output)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _shown(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def reward(problem: CodeProblem, completion: str, limits: Limits) -> float:
    """1.0 if the completion's code passes every test, 0.0 if not, -0.1 without a code block."""
    code = extract_code(completion)
    if code is None:
        return NO_CODE_REWARD
    passed = run_tests(problem, code, limits, stop_at_failure=True)
    return 1.0 if all(r.passed for r in passed) else 0.0


def conversation(problem: CodeProblem) -> Conversation:
    """The first turn's messages: the instructions, the statement and the function to write."""
    signature = f"\nWrite a function named {problem.fn_name}." if problem.fn_name else ""
    return [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": problem.text + signature},
    ]


def tool_message(problem: CodeProblem, call: str, limits: Limits, tool_tests: int) -> Message:
    """The tool's answer to a `check_solution` call: the first `tool_tests` tests' results."""
    code = extract_code(call)
    if code is None:
        report = f"no ```python block inside {TOOL_OPEN}; nothing was run."
    else:
        results = run_tests(problem, code, limits, tests=problem.tests[:tool_tests])
        passed = sum(r.passed for r in results)
        lines = [f"{passed}/{len(results)} tests passed."]
        lines += [
            f"Test {i}: " + ("passed" if r.passed else f"failed, {r.detail}")
            for i, r in enumerate(results, 1)
        ]
        report = "\n".join(lines)
    return {"role": "tool", "content": report}


@dataclass(frozen=True)
class Episode:
    """A finished two-turn (or one-turn) attempt at a problem."""

    answers: list[str]  # the model's one or two answers
    tool_output: str | None  # the tool message between them, None when no call was made
    reward: float


def run_episode(
    problem: CodeProblem,
    respond: Callable[[Conversation], str],
    limits: Limits,
    tool_tests: int,
) -> Episode:
    """Play the two-turn flow with `respond(messages) -> answer`, a model or a script."""
    messages = conversation(problem)
    first = respond(messages)
    call = tool_call(first)
    if call is None:
        return Episode([first], None, reward(problem, first, limits))
    tool = tool_message(problem, call, limits, tool_tests)
    second = respond([*messages, {"role": "assistant", "content": first}, tool])
    return Episode([first, second], tool["content"], reward(problem, second, limits))
