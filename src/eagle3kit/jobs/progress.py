"""Progress on stderr, one implementation for train, eval and tokenize.

On a terminal a live rich bar; otherwise (a log file, CI, a batch job) plain lines: one every
`every` items and at least one every `seconds` of wall time, and the last one, so a long
job's log shows it is alive without a line per item.
"""

from __future__ import annotations

import time
from typing import Any

from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    """`update(done, total, info)`: a bar on a terminal, plain lines elsewhere."""

    def __init__(self, console, label: str, total: int | None = None, every: int | None = 10,
                 seconds: float = 60.0, start: int = 0):
        self.console, self.label, self.every, self.seconds = console, label, every, seconds
        self.live = console.is_terminal
        self.total = total
        self._last_line = time.monotonic()
        self._bar = RichProgress(TextColumn(f"[bold]{label}[/bold] {{task.completed:,}}"
                                            + ("/{task.total:,}" if total else "")),
                                 BarColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), console=console, disable=not self.live,
                                 transient=False)
        self._task = self._bar.add_task(label, total=total, completed=start, info="compiling")

    def __enter__(self):
        self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)

    def update(self, done: int, total: int | None = None, info: str = "") -> None:
        self.total = total if total is not None else self.total
        self._bar.update(self._task, completed=done, total=self.total, info=info)
        if self.live:
            return
        now = time.monotonic()
        if ((self.every and done % self.every == 0) or done == self.total
                or now - self._last_line >= self.seconds):
            self._last_line = now
            of = f"/{self.total:,}" if self.total else ""
            self.console.print(f"{self.label} {done:,}{of}  {info}".rstrip())


def per_second(rate: float) -> str:
    """A rate as a progress line shows it: whole numbers from 100 up, else three digits
    (0.42, not 0: a big target on a CPU makes less than a token a second)."""
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


class TrainProgress(Progress):
    """step, epoch, loss, acc_0, tokens/s; `update` returns the measured tokens/s."""

    def __init__(self, console, total: int, start: int = 0, log_every: int = 10):
        super().__init__(console, "step", total, every=max(log_every, 1), start=start)
        self._last_t: float | None = None

    def update(self, step: int, record: dict[str, Any], t: float) -> float:
        # tokens/s between consecutive fetched steps; the first step includes compilation
        tps = 0.0 if self._last_t is None else record["tokens"] / max(t - self._last_t, 1e-9)
        rate = "" if self._last_t is None else f"  {per_second(tps)} tok/s"  # none measured
        self._last_t = t
        super().update(step, info=f"epoch {record['epoch']}  loss {record['loss']:.4f}  "
                                  f"acc_0 {record['acc'][0]:.3f}  tau {record['tau']:.2f}"
                                  + rate)
        return round(tps, 1)

    def note_eval(self, record: dict[str, Any]) -> None:
        accs = " ".join(f"{a:.3f}" for a in record["acc"])
        self.console.print(f"eval @ step {record['step']}: acc {accs}  tau {record['tau']:.3f}  "
                           f"({record['masked_tokens']:,} tokens)")
