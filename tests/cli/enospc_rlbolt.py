"""`rlbolt` with a full disk injected: the writer's final rename of checkpoint step N raises
OSError(ENOSPC) on Orbax's background thread, as a full disk would mid-save.

    python tests/cli/enospc_rlbolt.py N demo --run-dir D --checkpoint-every 1
"""

from __future__ import annotations

import errno
import sys

from orbax.checkpoint._src.path import atomicity

from rlbolt.app.cli import run

FULL_AT = int(sys.argv.pop(1))
original = atomicity.AtomicRenameTemporaryPath.finalize


async def finalize(self):
    if self.get_final().name == str(FULL_AT):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.get_final()))
    return await original(self)


atomicity.AtomicRenameTemporaryPath.finalize = finalize
sys.argv[0] = "rlbolt"
run()
