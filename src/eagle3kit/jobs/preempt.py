"""Preemption: SIGTERM, SIGINT and SIGUSR1 stop a long job at its next safe point, not mid-write.

Spot VMs, TPU maintenance and batch schedulers send SIGTERM; SLURM sends SIGUSR1 ahead of a
job's time limit when asked to (`#SBATCH --signal=USR1@300`); a user presses Ctrl-C. Each
only sets a flag here; the job reads it at step boundaries (`requested`), checkpoints and exits
75 (EX_TEMPFAIL), so `--resume` loses nothing. A second Ctrl-C quits at once: after the first,
SIGINT gets its default action back, which ends the process even inside a long XLA call (a
Python handler would only run once that call returns), with no interpreter teardown (threads
of a compiling XLA runtime make an ordinary exit crash); the shell reports 130.

No JAX here: the command installs this before importing the job.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

from eagle3kit.errors import UserError


class Preempted(UserError):
    """Stopped by SIGTERM/SIGINT/SIGUSR1 at a step boundary; the run is resumable (exit 75)."""

    exit_code = 75


class Preemption:
    """A context that turns SIGTERM/SIGINT/SIGUSR1 into a flag; `requested` reads it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, say: Callable[[str], None] | None = None,
                 at: str = "the next step boundary with a checkpoint"):
        self.received: int | None = None
        self._at = at  # what the job stops at, for the message
        self._say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            return  # a second SIGTERM or SIGUSR1: the scheduler's SIGKILL follows if it must
        self.received = signum
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next Ctrl-C ends the process now
        self._say(f"{signal.Signals(signum).name} received: stopping at {self._at} "
                  "(Ctrl-C again to quit at once)")

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    @property
    def requested(self) -> bool:
        return self.received is not None
