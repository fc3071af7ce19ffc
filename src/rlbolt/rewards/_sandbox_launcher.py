"""Runs inside the sandbox child (see `sandbox.py`): isolation, limits, guard, program, calls.

Started as `python -I -S -c <this source> <json config>`, as an unprivileged user (a fresh uid
when the trainer is root), with two inherited descriptors: `task_fd` (the program and the calls
to evaluate, read once) and `results_fd` (one JSON line per call). It must stay plain standard
library and Python 3.8-compatible: it may run under a system interpreter that differs from the
trainer's.

What it never receives is what the score depends on: expected values stay in the trusted
parent (`code_tests.py`), which checks every reported value itself. So there is nothing here
for the program to find or forge; the layers below keep it from harming the host.

With `"namespaces": true` it first isolates itself (the fallback when bubblewrap is absent):
new user, mount, pid, network, IPC and UTS namespaces (unshare(2) through ctypes); a fork, so
the program runs as pid 1 of its own pid namespace (when it exits, the kernel kills every
process it left behind); a new root holding only the `view` folders (the interpreter and the
system's /usr, /lib, /etc), read-only, with size-capped private tmpfs on /tmp and /dev/shm (the
only writable places, gone with the namespace), four device nodes and a /proc that shows only
the sandbox (or none); then every capability dropped, so the program cannot undo any of it.
"""

import ctypes
import io
import json
import os
import re
import resource
import signal
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
ST_NOSUID, ST_NODEV, ST_NOEXEC, ST_NOATIME, ST_NODIRATIME, ST_RELATIME = 2, 4, 8, 1024, 2048, 4096
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 24, 38, 47

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


# -- namespaces (the fallback isolation when bubblewrap is absent) --------------------------------
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, "%s: %s" % (what, os.strerror(error)))


def _write(path, text):
    with open(path, "w") as handle:
        handle.write(text)


def _mount_points():
    points = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            point = line.split()[4]
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point))  # "\040": a space
    return points


def _remount_read_only(libc, point):
    flags = os.statvfs(point).f_flag  # locked flags must be kept, or the kernel refuses
    extra = MS_NOSUID * bool(flags & ST_NOSUID) | MS_NODEV * bool(flags & ST_NODEV)
    extra |= MS_NOEXEC * bool(flags & ST_NOEXEC) | MS_NODIRATIME * bool(flags & ST_NODIRATIME)
    extra |= MS_NOATIME if flags & ST_NOATIME else MS_RELATIME if flags & ST_RELATIME else MS_STRICTATIME
    _check(libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, None), "remount " + point)


def _tmpfs(libc, point, size, mode="1777"):
    options = ("size=%d,mode=%s" % (size, mode)).encode()
    _check(libc.mount(b"tmpfs", point.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), "tmpfs " + point)


def _drop_capabilities(libc):
    for cap in range(64):  # the bounding set: nothing can be regained by exec
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")


def _wait_and_relay(pid, keep_fds):
    """The outer half: holds nothing, waits for the sandbox's pid 1, exits as it did."""
    for fd in keep_fds:  # the pipe's reader must see EOF when pid 1 is gone
        if fd >= 0:
            os.close(fd)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be (re)set
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _bind_read_only(libc, source, target):
    """Binds `source` (and the mounts below it) at `target`, every one of them read-only."""
    os.makedirs(target, exist_ok=True)
    _check(libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None), "bind " + source)
    refused = []
    for point in _mount_points():
        if point == target or point.startswith(target.rstrip("/") + "/"):
            try:
                _remount_read_only(libc, point)
            except OSError:
                refused.append(point)
    return refused


def _build_root(libc, config):
    """A new root on a tmpfs: the `view` paths bound read-only, private /tmp, /dev/shm and
    /proc, four device nodes; everything else (home folders, datasets, the trainer's files)
    is simply absent. Returns the layer names."""
    new, size = "/tmp", config["tmpfs_bytes"]
    _tmpfs(libc, new, 1 << 20, "0755")
    refused = []
    for path in config["view"]:
        target = new + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            refused += _bind_read_only(libc, path, target)
    for folder in ("tmp", "dev", "dev/shm", "proc"):
        os.makedirs(os.path.join(new, folder), exist_ok=True)
    for node in ("null", "zero", "random", "urandom"):
        open(os.path.join(new, "dev", node), "w").close()
        _check(libc.mount(("/dev/" + node).encode(), ("%s/dev/%s" % (new, node)).encode(), None, MS_BIND, None), node)
    _tmpfs(libc, new + "/tmp", size)
    _tmpfs(libc, new + "/dev/shm", size)
    layers = ["read-only-filesystem" if not refused else "read-only-filesystem:partial", "private-tmpfs"]
    try:
        _check(libc.mount(b"proc", (new + "/proc").encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "proc")
        layers.append("private-proc")
    except OSError:  # e.g. a container masks parts of /proc: show none rather than the host's
        layers.append("no-proc")
    _check(libc.mount(None, new.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None), "ro /")
    os.chdir(new)
    _check(libc.mount(b".", b"/", None, MS_MOVE, None), "move root")
    os.chroot(".")
    os.chdir("/")
    os.mkdir(config["workdir"], 0o700)
    return ["minimal-filesystem-view"] + layers


def _enter_namespaces(config, fds):
    """Isolates this process (see the module docstring); returns, in the new pid 1, the layers."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(libc.unshare(flags), "unshare")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # again: new credentials clear it
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", "%d %d 1" % (uid, uid))
    _write("/proc/self/gid_map", "%d %d 1" % (gid, gid))
    child = os.fork()
    if child:
        _wait_and_relay(child, fds)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    layers = ["user-namespace", "pid-namespace", "network-namespace", "ipc-uts-namespaces"]
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    layers += _build_root(libc, config)
    _drop_capabilities(libc)
    layers.append("no-capabilities")
    return layers


# -- limits and the audit-hook tripwire -----------------------------------------------------------
def _set_limits(limits):
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _no_new_privileges():
    try:
        _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries cannot raise privileges
        return True
    except (OSError, AttributeError):
        return False


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


# -- running the program and reporting values -----------------------------------------------------
def _plain(value, depth=0):
    """The value as plain data whose repr() is a Python literal (the parent reads it back)."""
    if depth > 50:
        raise ValueError("the value is nested too deeply to report")
    if value is None or isinstance(value, bool):
        return value if value is None else bool(value)
    for kind in (int, float, complex, str, bytes):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(item, depth + 1) for item in value]
        return tuple(items) if isinstance(value, tuple) else set(items) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in value.items()}
    if hasattr(value, "tolist"):  # NumPy scalars and arrays
        return _plain(value.tolist(), depth + 1)
    raise TypeError("cannot report a value of type %s" % type(value).__name__)


def _send(fd, message):
    os.write(fd, (json.dumps(message) + "\n").encode())


def _describe(error):
    return ("%s: %s" % (type(error).__name__, error))[:500]


def _run_io_case(code, text, fd, number):
    saved = sys.stdin, sys.stdout
    sys.stdin, sys.stdout = io.StringIO(text), io.StringIO()
    error = None
    try:
        exec(compile(code, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as stop:
        if stop.code not in (None, 0):
            error = "exit code %s" % (stop.code,)
    except BaseException as caught:  # noqa: BLE001 - a crash fails this case only
        error = _describe(caught)
    output = sys.stdout.getvalue()
    sys.stdin, sys.stdout = saved
    _send(fd, {"io": number, "stdout": output} if error is None else {"io": number, "error": error})


def _die_with_parent():
    """SIGKILL when the trainer (or reward worker) that started us dies, even mid-sleep."""
    try:
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main():
    _die_with_parent()
    config = json.loads(sys.argv[1])
    task_fd, results_fd = config["task_fd"], config["results_fd"]
    layers = _enter_namespaces(config, (task_fd, results_fd)) if config["namespaces"] else []
    if config.get("probe"):
        _send(results_fd, {"layers": layers})
        return
    with os.fdopen(task_fd, "rb") as handle:
        task = json.loads(handle.read().decode())
    os.closerange(3, results_fd)
    os.closerange(results_fd + 1, 1 << 16)
    workdir = config["workdir"]
    os.chdir(workdir)
    os.umask(0o077)
    _no_new_privileges()
    _set_limits(config["limits"])
    sys.argv = ["solution.py"]
    if config["audit_hook"]:
        _install_guard(workdir)
    code, calls, io_inputs = task["code"], task["calls"], task["io"]
    if calls or not io_inputs:  # the program itself, on the real stdin and stdout
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(code, "solution.py", "exec"), namespace)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise
        for number, call in enumerate(calls):
            try:
                message = {"call": number, "value": repr(_plain(eval(compile(call, "test_%d" % number, "eval"), namespace)))}
            except BaseException as error:  # noqa: BLE001 - a failing call is a result, not a crash
                traceback.print_exc(limit=2)
                message = {"call": number, "error": _describe(error)}
            _send(results_fd, message)
    for number, text in enumerate(io_inputs):
        _run_io_case(code, text, results_fd, number)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
