"""Preemption: SIGTERM and SIGINT stop a long job at its next safe point, not mid-write.

Spot VMs, TPU maintenance and batch schedulers send SIGTERM; a user presses Ctrl-C. Either
only sets a flag here; the job reads it at step boundaries (`requested`), checkpoints and exits
75 (EX_TEMPFAIL), so `--resume` loses nothing. A second Ctrl-C quits at once with 130, without
interpreter teardown (threads of a compiling XLA runtime make an ordinary exit crash).

No JAX here: the command installs this before importing the job.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from eagle3kit.errors import UserError


class Preempted(UserError):
    """Stopped by SIGTERM/SIGINT at a step boundary; the run is resumable (exit 75)."""

    exit_code = 75


class Preemption:
    """A context that turns SIGTERM/SIGINT into a flag; `requested` reads it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, say: Callable[[str], None] | None = None):
        self.received: int | None = None
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
            if signum == signal.SIGINT:  # the second Ctrl-C: the user means now
                self._say("interrupted again: quitting now, without a checkpoint")
                sys.stderr.flush()
                os._exit(130)
            return
        self.received = signum
        self._say(f"{signal.Signals(signum).name} received: stopping at the next step "
                  "boundary with a checkpoint (Ctrl-C again to quit at once)")

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    @property
    def requested(self) -> bool:
        return self.received is not None
