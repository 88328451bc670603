"""Training progress on stderr: a live rich bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    """step, epoch, loss, acc_0, tokens/s and ETA; `update` returns the measured tokens/s."""

    def __init__(self, console, total: int, start: int = 0, log_every: int = 10):
        self.console, self.total, self.log_every = console, total, max(log_every, 1)
        self.live = console.is_terminal
        self._last_t: float | None = None
        self._bar = Progress(
            TextColumn("[bold]train[/bold] step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=console, disable=not self.live, transient=False)
        self._task = self._bar.add_task("train", total=total, completed=start, info="compiling")

    def __enter__(self):
        self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)

    def update(self, step: int, record: dict[str, Any], t: float) -> float:
        # tokens/s between consecutive fetched steps; the first step includes compilation
        tps = 0.0 if self._last_t is None else record["tokens"] / max(t - self._last_t, 1e-9)
        self._last_t = t
        info = (f"epoch {record['epoch']}  loss {record['loss']:.4f}  "
                f"acc_0 {record['acc'][0]:.3f}  tau {record['tau']:.2f}  {tps:,.0f} tok/s")
        self._bar.update(self._task, completed=step, info=info)
        if not self.live and (step % self.log_every == 0 or step == self.total):
            self.console.print(f"step {step}/{self.total}  {info}")
        return round(tps, 1)

    def note_eval(self, record: dict[str, Any]) -> None:
        accs = " ".join(f"{a:.3f}" for a in record["acc"])
        self.console.print(f"eval @ step {record['step']}: acc {accs}  tau {record['tau']:.3f}  "
                           f"({record['masked_tokens']:,} tokens)")

