"""The sandbox contains hostile programs, and code problems are graded and checked through it.

Each hostile program runs with limits of about 2 s and is scored 0 by the reward; the test
then checks the host: the sandbox uid can still fork, no process of the run lives on, a marker
outside the working folder was not written, nothing answered the connection. Reward and the two-turn
`check_solution` flow are tested with scripted completions, no model.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from treadle_cookbook import code_tasks
from treadle_cookbook.code_tasks import Case, CodeProblem
from treadle_cookbook.data import Conversation
from treadle_cookbook.sandbox import Limits, NetworkIsolation, run_python

pytestmark = pytest.mark.unit

LIMITS = Limits(wall_time_s=2.0, cpu_time_s=1, processes=16, memory_bytes=256 * 2**20)
AS_ROOT = os.geteuid() == 0
PROBLEMS_FILE = Path(__file__).resolve().parents[2] / "cookbook" / "data" / "code_problems.jsonl"

ECHO = CodeProblem("echo", "Print the input.", (Case("hi\n", "hi\n", "stdin"),))


def fenced(code: str) -> str:
    return f"Here is my answer.\n```python\n{code}\n```\n"


def assert_scored_zero(code: str) -> None:
    assert code_tasks.reward(ECHO, fenced(code), LIMITS) == 0.0


def test_plain_program_reads_stdin_in_its_own_folder() -> None:
    result = run_python(
        "import os\nprint(input()[::-1], os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])",
        "abc\n",
        LIMITS,
    )
    assert result.ok and result.stdout == "cba True\n", result
    assert code_tasks.reward(ECHO, fenced("print(input())"), LIMITS) == 1.0


def test_fork_bomb_is_contained_and_leaves_the_uid_free_to_fork() -> None:
    if not AS_ROOT:
        pytest.skip("RLIMIT_NPROC counts all of this user's processes; only root can run as nobody")
    bomb = "import os\nwhile True:\n    os.fork()"
    result = run_python(bomb, "", LIMITS)
    assert not result.ok and "BlockingIOError" in result.stderr, result
    assert_scored_zero(bomb)
    # Nothing of the bomb holds the uid's process slots: the next run can fork to its limit.
    spawn = "import os\nfor _ in range({}):\n    if os.fork() == 0:\n        os._exit(0)\nprint('forked')"
    after = run_python(spawn.format(LIMITS.processes - 2), "", LIMITS)
    assert after.ok and after.stdout == "forked\n", after


def test_a_process_that_left_the_session_dies_with_the_run() -> None:
    if run_python("pass", "", LIMITS).network != "namespace":
        pytest.skip("without namespaces a setsid() process escapes the process group's kill")
    # A sleeper that keeps stdout open would hold the run to its wall deadline if it lived on.
    tag = f"20.{uuid.uuid4().int % 10**9:09d}"
    escape = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['/bin/sleep', {tag!r}])\n"
        "print(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    )
    result = run_python(escape, "", replace(LIMITS, wall_time_s=30.0))
    assert result.ok and not result.timed_out, result
    if AS_ROOT:  # /proc is remounted: the program is pid 1 and sees only its own processes
        pid, seen = result.stdout.split(" ", 1)
        assert pid == "1" and set(json.loads(seen)) <= {1, 2}, result
    assert not _processes_with_argument(tag)


def test_infinite_loop_is_killed_by_its_cpu_limit() -> None:
    # A wall deadline well past the CPU limit, so a busy machine still hits the CPU limit first.
    result = run_python("while True:\n    pass", "", replace(LIMITS, wall_time_s=10.0))
    assert result.timed_out and result.kill_reason == "cpu_time", result


def test_sleeping_program_is_killed_at_the_wall_deadline() -> None:
    result = run_python("import time\ntime.sleep(60)", "", LIMITS)
    assert result.timed_out and result.kill_reason == "wall_time" and result.exit_code == -9


def test_ten_gigabyte_allocation_fails_with_memory_error() -> None:
    allocate = "block = bytearray(10 * 2**30)\nprint('allocated')"
    result = run_python(allocate, "", LIMITS)
    assert result.exit_code == 1 and "MemoryError" in result.stderr, result
    assert "allocated" not in result.stdout
    assert_scored_zero(allocate)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    yield server
    server.close()


@pytest.mark.parametrize("network", ["namespace", "audit_hook"])
def test_network_connection_is_refused(listener: socket.socket, network: NetworkIsolation) -> None:
    if network == "namespace" and run_python("pass", "", LIMITS).network != "namespace":
        pytest.skip("this machine refuses new network namespaces; the audit hook is used instead")
    port = listener.getsockname()[1]
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
    result = run_python(connect, "", LIMITS, network=network)
    assert result.exit_code == 1, result
    expected = "Network is unreachable" if network == "namespace" else "not allowed in this sandbox"
    assert expected in result.stderr
    with pytest.raises(TimeoutError):
        listener.accept()
    assert_scored_zero(connect)


@pytest.mark.parametrize("folder", ["host", "tmp", "run_lock"])
def test_write_outside_the_working_folder_is_contained(folder: str) -> None:
    if not AS_ROOT:
        pytest.skip("without root the child runs as this user and can write where it can")
    # The host folder: this test's own, outside /tmp, writable by its owner (root) only.
    # /run/lock is writable by every uid on the host; the child's /run is an empty tmpfs.
    parent = {"host": Path(__file__).parent, "tmp": Path("/tmp"), "run_lock": Path("/run/lock")}
    if not parent[folder].is_dir():
        pytest.skip(f"this machine has no {parent[folder]}")
    marker = parent[folder] / f"sandbox-marker-{os.getpid()}"
    write = f"open({str(marker)!r}, 'w').write('escaped')\nprint('written')"
    try:
        result = run_python(write, "", LIMITS)
        if folder == "host":
            # A checkout under /tmp (a CI clone) is out of the child's sight: its /tmp is its own.
            hidden = parent["host"].is_relative_to("/tmp")
            error = "FileNotFoundError" if hidden else "PermissionError"
            assert result.exit_code == 1 and error in result.stderr, result
        elif folder == "run_lock":
            assert result.exit_code == 1 and "FileNotFoundError" in result.stderr, result
        else:  # /tmp is private to the child: the write lands in a throwaway tmpfs
            assert result.ok, result
        assert not marker.exists()
        assert_scored_zero(write)
    finally:
        marker.unlink(missing_ok=True)


def test_output_and_file_sizes_are_capped() -> None:
    flood = run_python("while True:\n    print('x' * 1000)", "", LIMITS)
    assert flood.kill_reason == "output_limit" and flood.output_truncated
    assert len(flood.stdout) == LIMITS.output_bytes
    big = run_python(f"open('big', 'wb').write(b'x' * {2 * LIMITS.file_size_bytes})", "", LIMITS)
    assert big.exit_code == 1 and "File too large" in big.stderr, big


def test_the_working_folder_holds_its_tmpfs_size_in_total() -> None:
    if not AS_ROOT or run_python("pass", "", LIMITS).network != "namespace":
        pytest.skip("the working folder is a tmpfs only as root with namespaces")
    # Files each under the size limit, together past the folder's size.
    count = 2 * LIMITS.tmpfs_bytes // LIMITS.file_size_bytes
    fill = (
        f"for i in range({count}):\n"
        f"    open(f'part{{i}}', 'wb').write(b'x' * ({LIMITS.file_size_bytes} - 1))"
    )
    result = run_python(fill, "", LIMITS)
    assert result.exit_code == 1 and "No space left on device" in result.stderr, result


def test_a_launcher_failure_raises_with_its_cause() -> None:
    if not AS_ROOT or run_python("pass", "", LIMITS).network != "namespace":
        pytest.skip("the launcher mounts only as root with namespaces")
    with pytest.raises(RuntimeError, match=r"could not start the program: OSError.*mount on /tmp"):
        run_python("print('ran')", "", replace(LIMITS, tmpfs_bytes=-1))


def _processes_with_argument(argument: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return pids


# -- problems and reward --------------------------------------------------------------------


def test_the_shipped_problems_load_and_a_correct_answer_scores_one() -> None:
    problems = {p.id: p for p in code_tasks.load_problems(PROBLEMS_FILE)}
    assert len(problems) >= 10
    assert {t.kind for p in problems.values() for t in p.tests} == {"stdin", "functional"}
    sum_two = fenced("a, b = map(int, input().split())\nprint(a + b)")
    assert code_tasks.reward(problems["sum-two"], sum_two, LIMITS) == 1.0
    method = fenced(
        "class Solution:\n    def gcd(self, a, b):\n        return b and self.gcd(b, a % b) or a"
    )
    assert code_tasks.reward(problems["gcd"], method, LIMITS) == 1.0


def test_reward_is_zero_on_a_wrong_answer_and_negative_without_code() -> None:
    problem = code_tasks.from_deepcoder(
        {
            "problem": "Return x squared.",
            "tests": {"inputs": [[3], [4]], "outputs": [9, 16], "fn_name": "sq"},
        }
    )
    assert code_tasks.reward(problem, fenced("def sq(x):\n    return x * x"), LIMITS) == 1.0
    assert code_tasks.reward(problem, fenced("def sq(x):\n    return 9"), LIMITS) == 0.0
    assert code_tasks.reward(problem, "def sq(x): return x * x", LIMITS) == -0.1
    unclosed = "```python\ndef sq(x):\n    return x * x\n"
    assert code_tasks.reward(problem, unclosed, LIMITS) == -0.1


def test_only_the_first_python_block_is_the_answer() -> None:
    completion = "```text\nnot code\n```\n```python\nprint(1)\n```\n```python\nprint(2)\n```"
    assert code_tasks.extract_code(completion) == "print(1)\n"


def test_unsupported_test_types_are_refused_with_the_supported_ones_named() -> None:
    row = {
        "problem": "p",
        "tests": json.dumps([{"input": "1", "output": "1", "testtype": "checker"}]),
    }
    with pytest.raises(ValueError, match="'stdin' or 'functional'"):
        code_tasks.from_deepcoder(row)
    with pytest.raises(ValueError, match="func_name"):
        code_tasks.from_deepcoder(
            {"problem": "p", "tests": [{"input": "1", "output": "1", "testtype": "functional"}]}
        )


# -- the two-turn check_solution flow -------------------------------------------------------

SUM_TWO = CodeProblem(
    "sum",
    "Print a + b.",
    (Case("1 2\n", "3\n", "stdin"), Case("5 5\n", "10\n", "stdin")),
)
WRONG = "a, b = map(int, input().split())\nprint(a - b)"
RIGHT = "a, b = map(int, input().split())\nprint(a + b)"


def scripted(*answers: str) -> tuple[list[Conversation], Callable[[Conversation], str]]:
    seen: list[Conversation] = []
    queue = list(answers)

    def respond(messages: Conversation) -> str:
        seen.append(messages)
        return queue.pop(0)

    return seen, respond


def test_a_tool_call_returns_test_results_and_the_revision_is_graded() -> None:
    seen, respond = scripted(
        f"Let me check.\n<check_solution>\n{fenced(WRONG)}</check_solution>", fenced(RIGHT)
    )
    episode = code_tasks.run_episode(SUM_TWO, respond, LIMITS, tool_tests=1)
    assert episode.reward == 1.0 and len(episode.answers) == 2
    assert episode.tool_output is not None
    assert (
        "0/1 tests passed" in episode.tool_output
        and "expected '3\\n', got '-1\\n'" in episode.tool_output
    )
    assert seen[0] == code_tasks.conversation(SUM_TWO) and seen[0][0]["role"] == "system"
    assert seen[1] == [
        *seen[0],
        {"role": "assistant", "content": episode.answers[0]},
        {"role": "tool", "content": episode.tool_output},
    ]


def test_the_second_answer_is_final_even_when_the_check_passed() -> None:
    _, respond = scripted(f"<check_solution>{fenced(RIGHT)}</check_solution>", "I am done.")
    episode = code_tasks.run_episode(SUM_TWO, respond, LIMITS, tool_tests=2)
    assert episode.tool_output is not None and "2/2 tests passed" in episode.tool_output
    assert episode.reward == -0.1


def test_an_answer_without_a_call_is_final_and_an_empty_call_runs_nothing() -> None:
    _, respond = scripted(fenced(WRONG))
    episode = code_tasks.run_episode(SUM_TWO, respond, LIMITS, tool_tests=1)
    assert episode == code_tasks.Episode([fenced(WRONG)], None, 0.0)
    _, respond = scripted("<check_solution>no code</check_solution>", fenced(RIGHT))
    episode = code_tasks.run_episode(SUM_TWO, respond, LIMITS, tool_tests=1)
    assert episode.tool_output is not None and "nothing was run" in episode.tool_output
    assert episode.reward == 1.0
