"""The code sandbox: hostile programs fail safely with the penalty and leave the host unharmed."""

import os
import secrets
import socket
import tempfile
from pathlib import Path

import pytest

from rlbolt.rewards import RewardRunner
from rlbolt.rewards.sandbox import code_reward, extract_code, run_python_sandboxed

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")

PENALTY = -1.0


@pytest.fixture(autouse=True)
def _watch_sandbox_dirs():
    """Every run's temp dir must be gone afterwards, whatever the program did."""
    root = Path(tempfile.gettempdir())
    before = set(root.glob("rlbolt-sandbox-*"))
    yield
    assert set(root.glob("rlbolt-sandbox-*")) - before == set()


def _live_group_members(pgid: int) -> list[int]:
    """Live pids in process group `pgid`, read from /proc (independent of the sandbox code).

    Zombies are skipped: they are dead, and killed orphans wait for init to reap them.
    """
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]  # after "pid (comm)"
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def _assert_host_unharmed(result):
    assert result.pid > 0
    assert _live_group_members(result.pid) == []


def _reward(code, **options):
    completion = f"Here is my solution:\n```python\n{code}\n```\n"
    return code_reward(completion, {"tests": ["assert True"]}, penalty=PENALTY, **options)


def test_correct_program_passes_its_tests():
    completion = (
        "<think>Simple.</think>\n```python\ndef add(a, b):\n    return a + b\n```"
    )
    sample = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
    assert code_reward(completion, sample) == 1.0
    wrong = completion.replace("a + b", "a * b")  # passes only add(2, 2) == 4
    assert code_reward(wrong, sample) == pytest.approx(1 / 3)
    assert code_reward(wrong, sample, partial_credit=False) == 0.0
    result = run_python_sandboxed("import sys\nprint(sys.stdin.read().upper())", stdin="hello", tests="assert True")
    assert result.ok and result.stdout.strip() == "HELLO" and result.tests_passed == result.tests_total == 1
    _assert_host_unharmed(result)


def test_tests_are_hidden_from_the_program_and_the_report_cannot_be_printed():
    # The program cannot read the task file (deleted before it runs) nor fake the harness line.
    code = "import os\nprint(sorted(os.listdir('.')))\nprint('deadbeef 5 5')"
    result = run_python_sandboxed(code, tests=["assert False"])
    assert "task.json" not in result.stdout
    assert not result.ok and result.tests_passed == 0 and result.reason == "tests failed: 0 of 1 passed"


def test_writes_outside_the_sandbox_fail(tmp_path):
    outside_tmp = Path(tempfile.gettempdir()) / f"rlbolt-test-{secrets.token_hex(8)}-x"
    in_test_dir = tmp_path / "pwned.txt"
    for target in (outside_tmp, in_test_dir):
        code = f"open({str(target)!r}, 'w').write('pwned')"
        assert _reward(code) == PENALTY
        result = run_python_sandboxed(code)
        assert not result.ok and "PermissionError" in result.reason
        assert not target.exists()
        _assert_host_unharmed(result)
    # Low-level calls are covered too.
    code = f"import os\nos.open({str(outside_tmp)!r}, os.O_WRONLY | os.O_CREAT)"
    assert not run_python_sandboxed(code).ok and not outside_tmp.exists()
    # Writing inside its own directory is allowed.
    assert run_python_sandboxed("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())").stdout == "ok\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid-drop layer exists only when running as root")
def test_uid_drop_alone_blocks_writes_to_private_dirs(tmp_path):
    # With the audit hook off, the kernel still refuses: tmp_path is root-owned and private.
    target = tmp_path / "pwned.txt"
    result = run_python_sandboxed(f"open({str(target)!r}, 'w')", audit_hook=False)
    assert not result.ok and "Permission denied" in result.reason
    assert not target.exists()


def test_socket_to_localhost_fails():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'x')"
        for audit_hook in (True, False):  # the hook, then the network namespace alone
            result = run_python_sandboxed(code, audit_hook=audit_hook)
            assert not result.ok and result.returncode != 0
            _assert_host_unharmed(result)
            if not audit_hook and "Permission" not in result.reason:
                with pytest.raises(socket.timeout):
                    server.accept()  # nothing ever reached the listener
        assert _reward(code) == PENALTY


BOUNDED_FORK_BOMB = """
import os, time
for _ in range(200):  # bounded, so a failure of the limits cannot take the machine down
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
print("forked 200")
"""


def test_bounded_fork_bomb_fails_and_leaves_no_children():
    assert _reward(BOUNDED_FORK_BOMB) == PENALTY
    result = run_python_sandboxed(BOUNDED_FORK_BOMB)
    assert not result.ok and "os.fork" in result.reason
    _assert_host_unharmed(result)
    if os.geteuid() == 0:  # RLIMIT_NPROC binds only once the uid is dropped
        result = run_python_sandboxed(BOUNDED_FORK_BOMB, audit_hook=False, max_procs=8)
        assert not result.ok and "forked 200" not in result.stdout
        _assert_host_unharmed(result)


def test_huge_allocation_fails():
    code = "data = bytearray(10 * 1024 ** 3)\nprint(len(data))"
    assert _reward(code) == PENALTY
    result = run_python_sandboxed(code)
    assert not result.ok and "MemoryError" in result.reason
    _assert_host_unharmed(result)


def test_infinite_loop_is_stopped():
    code = "while True:\n    pass"
    result = run_python_sandboxed(code, cpu_s=1, wall_s=3)
    assert not result.ok
    # Whichever limit fires first on a busy machine: CPU time (SIGXCPU/SIGKILL) or wall clock.
    assert result.timed_out or result.returncode < 0
    _assert_host_unharmed(result)
    assert _reward("import time\ntime.sleep(60)", wall_s=1) == PENALTY


def test_extract_code_and_missing_tests_field():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("z = 4") == "z = 4"
    with pytest.raises(KeyError, match="tests_key"):
        code_reward("x = 1", {"unit_tests": []})


def test_code_reward_under_the_runner():
    completions = ["```python\ndef f(x):\n    return x * 2\n```", "```python\nwhile True: pass\n```"]
    samples = [{"tests": ["assert f(2) == 4", "assert f(0) == 0"]}] * 2
    with RewardRunner(code_reward, timeout_s=30.0, max_workers=2) as runner:
        result = runner.score(completions, samples)
    assert result.rewards.tolist() == [1.0, 0.0]  # the loop is stopped by the sandbox, not the runner
    assert result.metrics["reward/code/mean"] == 0.5 and result.metrics["reward/timeouts"] == 0.0
