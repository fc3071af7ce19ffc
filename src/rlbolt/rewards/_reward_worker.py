"""A reward worker process: `python -I _reward_worker.py <fd>`, started by `workers.ProcessPool`.

Started with `subprocess`, not `multiprocessing`, on purpose: multiprocessing's "spawn" and
"forkserver" re-import the trainer's `__main__` in every worker, which re-runs a training
script that has no `if __name__ == "__main__":` guard (the README's own example has none).
This file imports nothing but the standard library until the trainer has sent its `sys.path`;
then it unpickles the reward (importing the reward's own module), runs its `warm_up()` (a term's
slow first-call work: `WeightedReward.warm_up`), and serves one sample at a
time over the socket `<fd>`: `(index, completion, sample)` in, `(index, ok, scores or error
text)` out. It dies with the trainer (PR_SET_PDEATHSIG on Linux) and on the socket's EOF.
"""

import pickle
import sys
import traceback
from multiprocessing.connection import Connection


def _die_with_parent():
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the socket's EOF still ends an idle worker
        pass


def describe(error):
    """One summary line (`reward 'x' raised Type: message`), then the full traceback."""
    summary = str(error) if type(error).__name__ == "RewardTermError" else "%s: %s" % (type(error).__name__, error)
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    return "%s\n%s" % (summary, trace)


def main():
    _die_with_parent()
    connection = Connection(int(sys.argv[1]))
    try:
        sys_path, reward_bytes = connection.recv()
        sys.path[:] = sys_path  # import the reward exactly as the trainer would
        reward = pickle.loads(reward_bytes)
        reward.warm_up()  # a term's slow first-call work, inside the boot time-out, not a sample's
    except BaseException as error:  # noqa: BLE001 - reported to the trainer, which decides
        connection.send(("boot_error", describe(error)))
        return
    connection.send(("ready", None))
    while True:
        try:
            task = connection.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        index, completion, sample = task
        try:
            result = (index, True, reward.raw_scores(completion, sample))
        except BaseException as error:  # noqa: BLE001 - a reward's sys.exit() is a failed sample
            result = (index, False, describe(error))
        connection.send(result)


if __name__ == "__main__":
    main()
