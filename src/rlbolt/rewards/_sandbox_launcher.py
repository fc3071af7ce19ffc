"""Runs inside the sandbox child (see `sandbox.py`): limits, guard, user code, then the tests.

Started as `python -I -S _sandbox_launcher.py <workdir> <json config>`. It must stay plain
standard library and Python 3.8-compatible: it may run under a system interpreter that differs
from the trainer's. It reads the task file (solution, tests, nonce) and deletes it *before* the
untrusted code runs, so that code cannot read the tests or forge the result line by reading it.
"""

import json
import os
import resource
import sys
import traceback

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_DENIED_PREFIXES = (
    "socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.system", "os.kill", "os.killpg", "os.setuid", "ctypes.", "resource.setrlimit",
    "resource.prlimit", "pty.", "gc.get_objects", "gc.get_referrers", "sys.remote_exec",
)
_PATH_EVENTS = {  # event -> positions of the path arguments that must stay inside the workdir
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "os.rename": (0, 1),
    "os.link": (1,), "os.symlink": (1,), "shutil.copyfile": (1,), "shutil.copytree": (1,),
}


def _set_limits(limits):
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _install_guard(workdir):
    root = os.path.realpath(workdir)

    def inside(path):
        if isinstance(path, int):  # an already-open descriptor, e.g. open(1, "w")
            return True
        path = os.fsdecode(os.fspath(path))
        real = os.path.realpath(os.path.join(os.getcwd(), path))
        return real == root or real.startswith(root + os.sep) or real == "/dev/null"

    def guard(event, args):
        if event.startswith(_DENIED_PREFIXES):
            raise PermissionError("sandbox: %s is not allowed" % event)
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writes = bool((flags or 0) & _WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
            if writes and path is not None and not inside(path):
                raise PermissionError("sandbox: writing %r is not allowed" % (path,))
        elif event in _PATH_EVENTS:
            for position in _PATH_EVENTS[event]:
                if position < len(args) and args[position] is not None and not inside(args[position]):
                    raise PermissionError("sandbox: %s on %r is not allowed" % (event, args[position]))

    sys.addaudithook(guard)


def main():
    workdir, config = sys.argv[1], json.loads(sys.argv[2])
    _set_limits(config["limits"])
    os.chdir(workdir)
    os.umask(0o077)
    task_path = os.path.join(workdir, config["task_file"])
    with open(task_path) as handle:
        task = json.load(handle)
    os.unlink(task_path)
    nonce, tests = task.pop("nonce"), task.pop("tests")
    sys.argv = ["solution.py"]
    if config["audit_hook"]:
        _install_guard(workdir)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(task.pop("solution"), "solution.py", "exec"), namespace)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    passed = 0
    for number, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d" % number, "exec"), namespace)
            passed += 1
        except BaseException:  # a failing test is a result, not a crash
            sys.stderr.write("test %d failed:\n%s" % (number, traceback.format_exc(limit=2)))
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, ("\n%s %d %d\n" % (nonce, passed, len(tests))).encode())


if __name__ == "__main__":
    main()
