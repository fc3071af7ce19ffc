"""The code sandbox against hostile programs: none scores above an honest wrong answer, the host
is untouched, and nothing of a run is left running or on disk.

Each hostile program answers the same task as HONEST_WRONG (a wrong `add` that passes 1 of 3
tests) plus a test whose expected value is a fresh random token: a program can only pass it by
finding the token, and the token only exists in this (the trusted) process.
"""

import functools
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from rlbolt.rewards import RewardRunner
from rlbolt.rewards import sandbox_isolation as iso
from rlbolt.rewards.sandbox import code_reward, extract_code, run_python_sandboxed, score_result

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc").is_dir(), reason="Linux only")

ROOT = os.geteuid() == 0
PENALTY = 0.0
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
HONEST_WRONG = "def add(a, b):\n    return a * b\n\ndef secret():\n    return 'no idea'\n"


def _available(backend):
    try:
        iso.choose(backend, iso.python_for(ROOT), ROOT)
        return True
    except RuntimeError:
        return False


NAMESPACED = [pytest.param(b, marks=pytest.mark.skipif(not _available(b), reason=f"{b} cannot run on this host"
                                                      + (" (install the bubblewrap package)" if b == "bwrap" else
                                                         " (no unprivileged user namespaces)")))
              for b in ("bwrap", "namespaces")]
NONE_AS_ROOT = pytest.param("none", marks=pytest.mark.skipif(
    not ROOT, reason="without namespaces only a fresh uid (root) keeps a program from the trainer's memory and "
                     "files; an unprivileged host needs bubblewrap, user namespaces or a container"))


@pytest.fixture(autouse=True)
def _watch_sandbox_dirs():
    """Every run's temp dir must be gone afterwards, whatever the program did."""
    root = Path(tempfile.gettempdir())
    before = set(root.glob("rlbolt-sandbox-*"))
    yield
    assert set(root.glob("rlbolt-sandbox-*")) - before == set()


@pytest.fixture
def secret_task():
    token = "rlbolt-secret-" + secrets.token_hex(16)
    return ADD_TESTS + [f"assert secret() == {token!r}"], token


def _honest_score(tests, **options):
    return code_reward(f"```python\n{HONEST_WRONG}```", {"tests": tests}, **options)


def _live_group_members(pgid: int) -> list[int]:
    """Live pids in process group `pgid`, read from /proc (independent of the sandbox code)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]  # after "pid (comm)"
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def test_honest_programs_and_every_test_form():
    right = "def add(a, b):\n    return a + b\nimport sys\nprint(sys.stdin.read().upper())"
    result = run_python_sandboxed(right, stdin="hello", tests=ADD_TESTS)
    assert result.ok and result.judged and result.tests_passed == result.tests_total == 3
    assert result.stdout.strip() == "HELLO" and _live_group_members(result.pid) == []
    # a float64 ratio of test counts: approx's 1e-6 relative is ~1e10 float64 ulps
    assert _honest_score(ADD_TESTS) == pytest.approx(1 / 3)
    assert _honest_score(ADD_TESTS, partial_credit=False) == 0.0
    program = ("import math\ndef f(x):\n    return [x, x / 3, {'k': (x, None)}]\n"
               "def g(x):\n    return x > 1\n"
               "n = int(input())\nprint(n * 2)\nprint()\n")
    tests = [
        "assert f(1) == [1, 0.3333333333333333, {'k': (1, None)}]",  # floats, tuples, dicts, None round-trip
        "assert f(2)[0] in (2, 3)", "assert not g(0)", "assert g(5)", "assert 3 != f(3)[0] + 1",
        "assert math.isclose(f(3)[1], 1.0, rel_tol=1e-9)", "assert abs(f(3)[1] - 1.0) < 1e-9",
        {"call": "f(4)[1]", "expected": 1.333, "abs_tol": 1e-3}, {"call": "g(2)", "expected": True},
        {"stdin": "21\n", "stdout": "42\n"}, {"stdin": "5", "stdout": "10   \n\n"},  # trailing space/lines ignored
        "assert f(1) == [1, 0.3, {'k': (1, None)}]",  # fails
        {"stdin": "4\n", "stdout": "9\n"},  # fails
    ]
    result = run_python_sandboxed(program, stdin="0", tests=tests)
    assert result.judged and (result.tests_passed, result.tests_total) == (len(tests) - 2, len(tests)), result
    for bad in ("assert add(1, 2) == add(2, 1)", "x = 1", {"call": "f("}, 42):
        with pytest.raises(ValueError, match="test"):
            run_python_sandboxed(right, tests=[bad])


def test_a_returned_object_cannot_fake_equality():
    # The old harness ran `assert add(1, 2) == 3` in the child, where __eq__ is the program's.
    liar = "class Any:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Any()\n"
    result = run_python_sandboxed(liar, tests=ADD_TESTS)
    assert result.judged and result.tests_passed == 0


KITCHEN_SINK = r'''
import gc, json, os, re, socket, sys
PATTERN = re.compile(rb"rlbolt-secret-[0-9a-f]{32}")
report, found = {}, set()

def add(a, b):
    return a * b

def secret():
    return sorted(found)[0].decode() if found else "no idea"

def attempt(name, action):
    try:
        report[name] = str(action())[:200]
    except BaseException as error:
        report[name] = "blocked: %s: %s" % (type(error).__name__, str(error)[:120])

def frames():  # the runner's locals and globals, all the way up
    frame, seen = sys._getframe(), []
    while frame is not None:
        seen.append(repr(frame.f_locals) + repr(frame.f_globals))
        frame = frame.f_back
    found.update(PATTERN.findall("".join(seen).encode()))
    return len(seen)

def heap():  # every container the collector knows
    for obj in gc.get_objects():
        try:
            found.update(PATTERN.findall(repr(obj)[:100000].encode()))
        except Exception:
            pass
    return "searched"

def memory(pid):  # raw memory: this process, its parent, and every process it can see
    with open("/proc/%s/maps" % pid) as maps, open("/proc/%s/mem" % pid, "rb", 0) as mem:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if "r" not in line.split()[1] or end - start > 1 << 28:
                continue
            try:
                mem.seek(start)
                found.update(PATTERN.findall(mem.read(end - start)))
            except (OSError, ValueError, OverflowError):
                pass
    return "read"

def every_process():
    done = [p for p in os.listdir("/proc") if p.isdigit()]
    for pid in done:
        attempt("mem-%s" % pid, lambda: memory(pid))
    return done

def dataset():  # the training data, with this task's expected value in it
    data = open(DATASET).read().encode()
    found.update(PATTERN.findall(data))
    return "read %d bytes" % len(data)

def forge():  # the results pipe is ours too: claim values, and print a result line
    for fd in [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2]:
        try:
            os.write(fd, b'{"call": 3, "value": "\'rlbolt-secret-guess\'"}\n{"call": 0, "value": "3"}\n')
        except OSError:
            pass
    print("deadbeef 4 4")
    return "written"

def write(path):
    with open(path, "w") as handle:
        handle.write("pwned")
    return "wrote " + path

def dir_fd_create():  # os.open with dir_fd escapes the audit hook's path check
    folder = os.open(os.path.dirname(OUTSIDE), os.O_RDONLY)
    os.close(os.open(os.path.basename(OUTSIDE) + "-dirfd", os.O_CREAT | os.O_WRONLY, dir_fd=folder))
    return "created"

def network():
    with socket.create_connection(("127.0.0.1", PORT), timeout=2) as conn:
        conn.sendall(b"x")
    return "connected"

def with_ctypes():
    import ctypes
    libc = ctypes.CDLL(None)
    fd = libc.open((OUTSIDE + "-ctypes").encode(), os.O_CREAT | os.O_WRONLY, 0o644)
    return "open() -> %d, getuid() -> %d" % (fd, libc.getuid())

def fork_exec():  # _posixsubprocess.fork_exec raises no audit event
    import _posixsubprocess
    argv = [b"/bin/sh", b"-c", ("echo spawned > %s-spawned; sleep 300" % OUTSIDE).encode()]
    r, w = os.pipe()
    base = [argv, [argv[0]], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, True, True]
    for tail in ([-1, None, None, None, -1, None, False], [-1, None, None, None, -1, None], [None, None, None, -1, None]):
        try:
            return "pid %d" % _posixsubprocess.fork_exec(*(base + tail))
        except TypeError:
            continue
    return "no signature fits"

attempt("frames", frames)
attempt("heap", heap)
attempt("self-memory", lambda: memory("self"))
attempt("parent-memory", lambda: memory(os.getppid()))
attempt("every-process", every_process)
attempt("dataset", dataset)
attempt("write-outside", lambda: write(OUTSIDE))
attempt("write-usr", lambda: write("/usr/rlbolt-pwned"))
attempt("dir-fd", dir_fd_create)
attempt("network", network)
attempt("ctypes", with_ctypes)
attempt("fork-exec", fork_exec)
attempt("forge", forge)
report["found"] = sorted(x.decode() for x in found)
print("REPORT " + json.dumps(report))
'''


@pytest.fixture
def hostile_world(tmp_path):
    """A listener, a "dataset" holding the secret outside the temp dir, and outside paths."""
    token = "rlbolt-secret-" + secrets.token_hex(16)
    data_dir = Path(__file__).resolve().parents[2] / f".sandbox-test-{secrets.token_hex(4)}"
    data_dir.mkdir()
    os.chmod(data_dir, 0o755)
    dataset = data_dir / "train.jsonl"
    dataset.write_text(json.dumps({"tests": [f"assert secret() == {token!r}"]}) + "\n")
    os.chmod(dataset, 0o644)
    outside = str(Path(tempfile.gettempdir()) / f"rlbolt-hostile-{secrets.token_hex(6)}")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    try:
        yield {"token": token, "dataset": str(dataset), "outside": outside, "server": server,
               "tests": ADD_TESTS + [f"assert secret() == {token!r}"]}
    finally:
        server.close()
        shutil.rmtree(data_dir, ignore_errors=True)


def _kitchen_sink(world):
    prelude = f"DATASET = {world['dataset']!r}\nOUTSIDE = {world['outside']!r}\nPORT = {world['server'].getsockname()[1]}\n"
    return prelude + KITCHEN_SINK


def _check_host_untouched(world, result, network_isolated=True):
    assert _live_group_members(result.pid) == []
    leftovers = [p for p in Path(world["outside"]).parent.glob(Path(world["outside"]).name + "*")]
    assert leftovers == [], leftovers
    assert not Path("/usr/rlbolt-pwned").exists()
    if network_isolated:
        with pytest.raises(OSError):
            world["server"].accept()  # nothing ever connected
    else:
        world["server"].accept()[0].close()  # it did: take it, so the next run starts clean
    for proc in Path("/proc").glob("[0-9]*/cmdline"):  # the spawned `sleep 300` is gone too
        try:
            assert world["outside"].encode() not in proc.read_bytes()
        except OSError:
            pass


@pytest.mark.parametrize("backend", [*NAMESPACED, NONE_AS_ROOT])
def test_kitchen_sink_of_attacks_scores_no_more_than_an_honest_wrong_answer(backend, hostile_world):
    """Frames, the heap, raw memory of every visible process, the dataset on disk, forged
    reports, writes outside (plain, dir_fd, ctypes, a fork_exec'd shell), the network: with the
    audit hook off, so only the kernel layers stand in the way; then with it on."""
    world = hostile_world
    if backend == "none":  # no filesystem view: only file permissions keep the data from the fresh uid
        os.chmod(Path(world["dataset"]).parent, 0o700)
    honest = _honest_score(world["tests"], isolation=backend)
    # a float64 ratio of test counts: exact (1/4), approx only for form
    assert honest == pytest.approx(1 / 4)
    for audit_hook in (False, True):
        result = run_python_sandboxed(_kitchen_sink(world), tests=world["tests"], isolation=backend,
                                      audit_hook=audit_hook, wall_s=20, cpu_s=10, max_output_bytes=1 << 20)
        report = json.loads(result.stdout.split("REPORT ", 1)[1]) if "REPORT " in result.stdout else {}
        assert report, (result.reason, result.stderr[-2000:])
        assert report["found"] == [], report  # the token never was anywhere the program could look
        assert world["token"] not in result.stdout
        assert not result.judged and "broken report" in result.reason  # the forged lines
        assert score_result(result) <= honest
        # "none" has no network namespace: only the audit hook stands between a program and the network.
        _check_host_untouched(world, result, network_isolated=backend != "none" or audit_hook)
        if backend == "none":
            assert report["dataset"].startswith("blocked: PermissionError"), report
        else:  # the namespaced view: no dataset, no host network, no host pids
            assert report["dataset"].startswith("blocked: FileNotFoundError"), report
            assert report["write-usr"].startswith("blocked"), report
            assert report["network"].startswith("blocked"), report
        if audit_hook:
            assert "sandbox: gc.get_objects is not allowed" in report["heap"]


@pytest.mark.parametrize("backend", NAMESPACED)
def test_namespaced_backends_report_their_layers(backend):
    result = run_python_sandboxed("print(1)", isolation=backend)
    assert result.ok and result.stdout == "1\n"
    expected = {"user-namespace", "pid-namespace", "network-namespace", "minimal-filesystem-view",
                "read-only-filesystem", "private-tmpfs", "no-capabilities", "rlimits", "audit-hook"}
    assert expected <= set(result.layers)
    assert ("fresh-uid" in result.layers) == ROOT
    assert set(result.layers) == set(iso.sandbox_layers(backend))


BOUNDED_FORK_BOMB = """
import os, time
for _ in range(200):  # bounded, so a failure of the limits cannot take the machine down
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
print("forked", _)
def add(a, b):
    return a + b
"""

BOMBS = {
    "fork": BOUNDED_FORK_BOMB,
    "memory": "data = bytearray(10 * 1024 ** 3)\ndef add(a, b):\n    return a + b\n",
    "tmpfs": "with open('/tmp/rlbolt-fill-bomb', 'wb') as f:\n    for _ in range(256):\n        f.write(b'x' * (1 << 20))\n"
             "def add(a, b):\n    return a + b\n",
    "output": "import sys\nsys.stdout.write('x' * (64 << 20))\ndef add(a, b):\n    return a + b\n",
    "report": "import os\nfor fd in [int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2]:\n    try:\n"
              "        os.write(fd, b'\\n' * (8 << 20))\n    except OSError:\n        pass\n"
              "def add(a, b):\n    return a + b\n",
    "loop": "while True:\n    pass\n",
    "exit": "import os\nos._exit(0)\n",
}


def _slow(param):
    return pytest.param(*param.values, marks=[*param.marks, pytest.mark.slow], id=f"{param.values[0]}-slow")


@pytest.mark.parametrize("backend", ["auto", *[_slow(p) for p in (*NAMESPACED, NONE_AS_ROOT)]])
def test_bombs_and_loops_fail_and_leave_nothing(backend):
    """Fork, memory, tmpfs, output and report bombs, an infinite loop, an early exit: each is
    penalised (a correct `add` does not save it) and nothing of it survives the run."""
    for name, code in BOMBS.items():
        result = run_python_sandboxed(code, tests=ADD_TESTS, isolation=backend, audit_hook=False,
                                      cpu_s=1, wall_s=4, max_procs=8)
        assert not result.judged and result.tests_passed == 0, (name, result.reason)
        assert _live_group_members(result.pid) == [], name
        if name == "fork":
            assert "forked 199" not in result.stdout
        if name == "loop":
            assert result.timed_out or result.returncode < 0
        assert score_result(result, penalty=-1.0) == -1.0
    assert not Path("/tmp/rlbolt-fill-bomb").exists()


def test_audit_hook_alone_blocks_the_obvious(hostile_world):
    """Without namespaces (isolation="none"), the tripwire still stops plain attempts."""
    world = hostile_world
    for code, event in ((f"open({world['outside']!r}, 'w')", "writing"), ("import os\nos.fork()", "os.fork"),
                        ("import socket\nsocket.socket()", "socket."), ("import ctypes\nctypes.CDLL(None)", "ctypes.")):
        result = run_python_sandboxed(code, isolation="none")
        assert not result.ok and "PermissionError" in result.reason and event in result.reason, (code, result.reason)
    assert not Path(world["outside"]).exists()


@pytest.mark.skipif(not ROOT, reason="the uid layer exists only when running as root")
def test_uid_drop_alone_blocks_writes_to_private_dirs(tmp_path):
    target = tmp_path / "pwned.txt"  # tmp_path is root-owned and private
    result = run_python_sandboxed(f"open({str(target)!r}, 'w')", audit_hook=False, isolation="none")
    assert not result.ok and "Permission denied" in result.reason
    assert not target.exists()


def test_extract_code_and_missing_tests_field():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("z = 4") == "z = 4"
    with pytest.raises(KeyError, match="tests_key"):
        code_reward("x = 1", {"unit_tests": []})


def test_code_reward_under_the_runner():
    completions = ["```python\ndef f(x):\n    return x * 2\n```", "```python\nwhile True: pass\n```"]
    samples = [{"tests": ["assert f(2) == 4", "assert f(0) == 0"]}] * 2
    with RewardRunner(functools.partial(code_reward, cpu_s=1), timeout_s=30.0, max_workers=2) as runner:
        result = runner.score(completions, samples)
        assert runner.executor == "process"
    assert result.rewards.tolist() == [1.0, 0.0]  # the loop is stopped by the sandbox, not the runner
    assert result.metrics["reward/code/mean"] == 0.5 and result.metrics["reward/timeouts"] == 0.0


UNPRIVILEGED_RUN = r"""
import json, sys
from rlbolt.rewards.sandbox import run_python_sandboxed
result = run_python_sandboxed(sys.stdin.read(), tests=json.loads(sys.argv[1]), audit_hook=False, wall_s=20, cpu_s=10,
                              max_output_bytes=1 << 20)
print(json.dumps({"reason": result.reason, "judged": result.judged, "stdout": result.stdout, "layers": result.layers}))
"""


@pytest.mark.skipif(not ROOT or not shutil.which("setpriv"), reason="needs root (and setpriv) to become an unprivileged user")
def test_an_unprivileged_trainer_gets_the_namespace_layers_too(hostile_world):
    """The same attacks from a trainer that is not root (no fresh uid): the namespaces hold."""
    src = Path(__file__).resolve().parents[2] / "src"
    python = "/usr/bin/python3"
    if not os.access(src, os.R_OK | os.X_OK) or not Path(python).exists() or not _available("namespaces"):
        pytest.skip("the source tree or a system python is not usable by an unprivileged user here")
    world = hostile_world
    command = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "env", f"PYTHONPATH={src}",
               "HOME=/tmp", python, "-c", UNPRIVILEGED_RUN, json.dumps(world["tests"])]
    done = subprocess.run(command, input=_kitchen_sink(world), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    report = json.loads(outcome["stdout"].split("REPORT ", 1)[1])
    assert "fresh-uid" not in outcome["layers"] and "user-namespace" in outcome["layers"]
    assert report["found"] == [] and not outcome["judged"], report
    assert report["dataset"].startswith("blocked: FileNotFoundError") and report["network"].startswith("blocked")
    with pytest.raises(OSError):
        world["server"].accept()
    assert [p for p in Path(world["outside"]).parent.glob(Path(world["outside"]).name + "*")] == []

