"""Where a jitted step's device time goes: a profiler trace summed by `jax.named_scope`.

    summary = summarize(trace_dir, hlo_dir, steps)   # after jax.profiler.start/stop_trace

Device kernels carry the name of the HLO instruction they run (`hlo_op`); the optimized HLO
that XLA dumps (`--xla_dump_to`, `--xla_dump_hlo_as_text`) maps each instruction to the
`op_name` of its source, whose path holds the named scopes (`target/attention`,
`ttt_step3/ttt_attention`, `optimizer`, ...) and `transpose(...)` for the backward pass.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

# (scope part of an op_name, row label), first match wins
PARTS = [("target_head", "target lm_head + softmax"), ("target", "target forward"),
         ("ttt_attention", "TTT attention"), ("draft_qkv", "draft norms + q/k/v"),
         ("draft_mlp", "draft o_proj + MLP"), ("draft_head", "draft lm_head"),
         ("loss", "soft CE + accuracy"), ("fc", "draft fc"), ("optimizer", "optimizer")]
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"', re.M)


def op_names(hlo_dir: Path) -> dict[tuple[str, str], str]:
    """(module, instruction) and ("", instruction) -> op_name, from XLA's optimized dumps."""
    out: dict[tuple[str, str], str] = {}
    for f in Path(hlo_dir).glob("*after_optimizations.txt"):
        text = f.read_text()
        module = re.match(r"HloModule\s+([\w.\-]+)", text)
        for name, op in _INSTR.findall(text):
            out[(module.group(1) if module else "", name)] = op
            out.setdefault(("", name), op)
    return out


def label(op_name: str) -> str:
    part = next((lab for key, lab in PARTS if re.search(rf"(^|[/(]){key}([/)]|$)", op_name)),
                "other")
    backward = "transpose(" in op_name
    return f"{part} ({'backward' if backward else 'forward'})" if part not in (
        "optimizer", "other", "target forward", "target lm_head + softmax") else part


def summarize(trace_dir: Path, hlo_dir: Path, steps: int, top: int = 12) -> str:
    from jax.profiler import ProfileData
    names = op_names(hlo_dir)
    by_label: dict[str, float] = collections.Counter()
    by_op: dict[tuple[str, str], float] = collections.Counter()
    by_step: dict[str, float] = collections.Counter()
    lines_seen = set()
    for path in Path(trace_dir).rglob("*.xplane.pb"):
        for plane in ProfileData.from_file(str(path)).planes:
            gpu = plane.name.startswith("/device:GPU")
            if not (gpu or plane.name == "/host:CPU"):
                continue
            for line in plane.lines:
                lines_seen.add(line.name)
                if gpu and not line.name.startswith("Stream"):
                    continue  # the kernels, not the derived per-module or per-op lines
                for e in line.events:
                    stats = dict(e.stats)
                    op = stats.get("hlo_op", "")
                    if not op:
                        continue
                    op_name = names.get((stats.get("hlo_module", ""), op),
                                        names.get(("", op), ""))
                    by_label[label(op_name)] += e.duration_ns
                    by_op[(op, op_name)] += e.duration_ns
                    m = re.search(r"ttt_step(\d+)", op_name)
                    by_step[f"TTT step {m.group(1)}" if m else "outside the TTT steps"] += (
                        e.duration_ns)
    total = sum(by_label.values())
    if not total:
        return f"no device kernels with hlo_op found (lines: {sorted(lines_seen)})"
    ms = 1e6 * steps
    rows = [f"device time per step: {total / ms:.1f} ms (kernels only, {steps} steps traced)"]
    rows += [f"  {lab:<34} {t / ms:8.1f} ms {100 * t / total:5.1f}%"
             for lab, t in sorted(by_label.items(), key=lambda x: -x[1])]
    rows.append("per TTT step (forward + backward):")
    rows += [f"  {k:<34} {t / ms:8.1f} ms" for k, t in sorted(by_step.items())]
    rows.append(f"top {top} kernels:")
    rows += [f"  {t / ms:7.2f} ms  {op[:40]:<40} {op_name[-90:]}"
             for (op, op_name), t in by_op.most_common(top)]
    return "\n".join(rows)
