"""What `eval` shows people: progress and a table on stderr, and the acceptance plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from eagle3kit.errors import plural


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_report(console, r: dict[str, Any]) -> None:
    """The per-step table and the headline numbers."""
    steps = max(len(r.get("acc", [])), len(r.get("accept_rate", [])))
    table = Table(title=f"{r['mode']} acceptance on {Path(r['dataset']).name}",
                  title_justify="left")
    table.add_column("draft token", justify="right")
    table.add_column("acc_k", justify="right")
    table.add_column("cond_acc_k", justify="right")
    generated = "accept_rate" in r
    if generated:
        table.add_column("accepted in generation", justify="right")
    for k in range(steps):
        row = [str(k + 1), _pct(_at(r.get("acc"), k)), _pct(_at(r.get("cond_acc"), k))]
        if generated:
            row.append(_pct(_at(r["accept_rate"], k)))
        table.add_row(*row)
    console.print(table)
    lines = [f"tau (teacher-forced estimate): {r['tau']:.3f} over {r['masked_tokens']:,} "
             "tokens"]
    if generated:
        lines.append(f"tau (generation, tokens per target forward): {r['tau_generate']:.3f} "
                     f"pooled over {r['verify_steps']:,} verify steps, "
                     f"{r['tau_per_request_mean']:.3f} mean of "
                     f"{plural(r['prompts'], 'prompt')}")
        lines.append(f"speculative {r['tokens_per_s_speculative']:,.1f} tok/s vs plain "
                     f"{r['tokens_per_s_baseline']:,.1f} tok/s: {r['speedup']:.2f}x"
                     f" on {r['device']} (temperature {r['temperature']:g}, "
                     f"{_drafting(r)})")
    for line in lines:
        console.print(line)
    if r.get("concurrency") or r.get("sweep"):
        console.print(batched_table(r))
        for b, e in (r.get("best") or {}).items():
            console.print(f"fastest at batch {b}: {e['shape']} ({e['speedup']:.2f}x)"
                          if e["speedup"] > 1 else f"at batch {b} no shape beat plain "
                          f"decoding (the best, {e['shape']}, ran at {e['speedup']:.2f}x): "
                          "speculative decoding does not pay here")


def batched_table(r: dict[str, Any]) -> Table:
    """Per batch size (and drafting shape): tau, tokens/s both ways and the speedup."""
    table = Table(title=f"batched decoding on {r['device']} (continuous refill)",
                  title_justify="left")
    for name in ("batch", "shape", "tau pooled", "tau per request", "spec tok/s",
                 "plain tok/s", "speedup"):
        table.add_column(name, justify="right")
    for p in r.get("sweep") or r["concurrency"]:
        table.add_row(str(p["batch"]), p["shape"], f"{p['tau_pooled']:.2f}",
                      f"{p['tau_per_request_mean']:.2f}",
                      f"{p['tokens_per_s_speculative']:,.1f}",
                      f"{p['tokens_per_s_baseline']:,.1f}", f"{p['speedup']:.2f}x")
    return table


def _drafting(r) -> str:
    if r.get("topk", 1) == 1:
        return f"{r['steps']} draft tokens per step"
    return (f"trees of depth {r['steps']}, top-{r['topk']}, {r['draft_tokens']} tokens "
            "verified per step")


def _at(values, k):
    return values[k] if values and k < len(values) else None


def require_matplotlib():
    """matplotlib, or one clear line naming the extra that brings it."""
    try:
        import matplotlib
    except ImportError:
        from eagle3kit.errors import UserError

        raise UserError("--plot needs matplotlib, which is not installed: "
                        "pip install 'eagle3kit[plot]'") from None
    return matplotlib


def plot_acceptance(r: dict[str, Any], path) -> None:
    """Two panels: acceptance of each draft position, and the chance that at least j draft
    tokens are accepted (tau = 1 + the sum of that curve)."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    from eagle3kit.io.atomic import atomic_path

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    k = np.arange(1, len(r["acc"]) + 1)
    tf = "teacher-forced"
    if len(k):
        left.plot(k, r["cond_acc"], "o-", color="C0", label=f"{tf}, previous tokens right")
        left.plot(k, r["acc"], "o--", color="C0", alpha=0.5, label=f"{tf}, unconditional")
        right.plot(np.r_[0, k], np.r_[1.0, np.cumprod(r["cond_acc"])], "o-", color="C0",
                   label=f"{tf} estimate, tau {r['tau']:.2f}")
    if "accept_rate" in r:
        j = np.arange(1, len(r["accept_rate"]) + 1)
        left.plot(j, r["accept_rate"], "s-", color="C3",
                  label=f"generation, T={r['temperature']:g}")
        right.plot(np.r_[0, j], np.r_[1.0, np.cumprod(r["accept_rate"])], "s-", color="C3",
                   label=f"generation, tau {r['tau_generate']:.2f}, {r['speedup']:.2f}x "
                         "speedup")
    left.set(title="Acceptance of each draft token", xlabel="draft token position",
             ylabel="acceptance rate")
    right.set(title="Chance of accepting at least j draft tokens", xlabel="j",
              ylabel="P(accepted length >= j)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.02, 1.02)  # points at 0 stay visible
    draft = Path(str(r.get("draft", "draft")).rstrip("/"))
    name = draft.name if draft.name != "final" else f"{draft.parent.name}/final"
    fig.suptitle(f"draft {name} with {Path(str(r.get('target', ''))).name or 'its target'} "
                 f"on {r['dataset']}", fontsize=10)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
