"""`python -m tests.cli.kill_in_checkpoint STEP ARGS...`: `eagle3kit ARGS...`, which SIGKILLs
itself in the middle of writing the checkpoint of STEP: the state file half written, no
meta.json, the temporary directory not yet renamed. A kill from outside cannot hit that
window reliably (it lasts milliseconds); the kill itself is the real signal."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from eagle3kit.cli.app import main
from eagle3kit.io import safetensors


def _save_then_die(step: int):
    real = safetensors.save

    def save(path, tensors, metadata=None):
        real(path, tensors, metadata)
        if f".step_{step:08d}." in str(path):
            size = Path(path).stat().st_size
            os.truncate(path, size // 2)
            os.kill(os.getpid(), signal.SIGKILL)

    return save


if __name__ == "__main__":
    safetensors.save = _save_then_die(int(sys.argv[1]))
    sys.argv = ["eagle3kit", *sys.argv[2:]]
    main()
