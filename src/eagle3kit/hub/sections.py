"""The sections of the model card, one function each, from `inputs.CardInputs`.

Tables show what the export recorded and skip what it did not: a training run fills
`Draft.training` with keys such as epochs, lr, batch_size, seq_len, grad_accum, ttt_length,
warmup_ratio, dtype, mesh, devices, device_kind, steps, wall_time_s, data_records,
data_tokens; an imported draft may have none of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3kit import __version__
from eagle3kit.core import arches
from eagle3kit.hub.inputs import CardInputs, EvalResult

# Training keys shown in a row of their own or folded into one; other keys render as-is,
# except the run's bookkeeping (local paths, logging and checkpoint cadence), which says
# nothing about the draft.
_FOLDED = {"epochs", "lr", "batch_size", "seq_len", "grad_accum", "ttt_length", "warmup_ratio",
           "dtype", "mesh", "devices", "device_kind", "steps", "wall_time_s", "data_records",
           "data_tokens", "data", "optimizer", "schedule", "b1", "b2", "weight_decay",
           "clip_norm", "min_lr_ratio", "decay", "target_dtype", "eval_data", "init_from",
           "loss", "position_weights", "planned_steps", "vocab_filled"}
_OPERATIONAL = {"out", "vocab", "target", "resume", "save_every", "keep_checkpoints",
                "log_every", "eval_every", "attention", "max_steps", "aux_layer_ids",
                "coordinator", "num_processes", "process_id", "time_limit", "track"}


# `train --loss` names as a reader meets them (docs/losses.md defines each)
_LOSSES = {"kl": "forward KL (soft cross-entropy)", "tv": "total variation (1 - alpha)",
           "nla": "negative log-acceptance (-log alpha)",
           "lk-hybrid": "LK hybrid (lambda KL + (1 - lambda) TV, lambda = exp(-3 alpha))",
           "jsd": "Jensen-Shannon divergence"}


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _num(x: Any) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:g}"
    if isinstance(x, str):
        return x
    return json.dumps(x, separators=(", ", ": "))


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def sweep_winner(evals) -> tuple[dict[str, Any], dict[str, Any] | None, str, int] | None:
    """From the last eval with a `--sweep`: (fastest shape, fastest chain, device, batch size)
    at its smallest measured batch size; None without a sweep."""
    for e in reversed(evals):
        if e.best:
            b = min(e.best, key=int)
            return e.best[b], e.best_chain.get(b), e.device or "an unnamed device", int(b)
    return None


def _shapes(c: CardInputs) -> tuple[tuple[int, int, int], int, str | None]:
    """((steps, topk, draft tokens) for SGLang, K for vLLM, the line saying where they were
    measured): a sweep's winners, else the export's chain."""
    n = c.speculative_tokens
    won = sweep_winner(c.evals)
    if won is None:
        return (n, 1, n + 1), n, None
    best, chain, device, batch = won
    if best["speedup"] <= 1:  # nothing to recommend: no shape beat plain decoding
        return (n, 1, n + 1), n, (
            f"eagle3kit eval --sweep on {device} found no drafting shape faster than plain "
            f"decoding at batch {batch} (the best, {best['shape']}, ran at "
            f"{best['speedup']:.2f}x): the settings above are the export's chain of {n}, "
            "not a measured recommendation; measure on your hardware before serving with "
            "speculative decoding.\n")
    if chain is not None and chain["speedup"] <= 1:
        chain = None
    k = chain["steps"] if chain else n
    note = (f"These settings were measured on {device} with eagle3kit eval --sweep (batch "
            f"{batch}: {best['speedup']:.2f}x for {best['shape']}"
            + (f", {chain['speedup']:.2f}x for the chain of {k}" if chain else "") + ").\n")
    return (best["steps"], best["topk"], best["draft_tokens"]), k, note


def _sglang_command(c: CardInputs, shape: tuple[int, int, int], n: int) -> str:
    steps, topk, nodes = shape
    return (
        "### SGLang\n\n```bash\npython -m sglang.launch_server \\\n"
        f"    --model-path {c.target_name} \\\n    --speculative-algorithm EAGLE3 \\\n"
        f"    --speculative-draft-model-path {c.repo_id} \\\n"
        f"    --speculative-num-steps {steps} \\\n"
        f"    --speculative-eagle-topk {topk} \\\n"
        f"    --speculative-num-draft-tokens {nodes} \\\n    --dtype {c.serve_dtype}\n```\n\n"
        + (f"This is chain drafting ({steps} tokens per step). For tree drafting raise "
           "`--speculative-eagle-topk` and `--speculative-num-draft-tokens` together.\n"
           if topk == 1 else f"This is tree drafting: depth {steps}, top-{topk}, "
           f"{nodes} tokens verified per step.\n"))


def _sglang_python(c: CardInputs, shape: tuple[int, int, int], n: int) -> str:
    steps, topk, nodes = shape
    return ("import sglang as sgl\n\nengine = sgl.Engine(\n"
            f"    model_path=\"{c.target_name}\",\n    speculative_algorithm=\"EAGLE3\",\n"
            f"    speculative_draft_model_path=\"{c.repo_id}\",\n"
            f"    speculative_num_steps={steps},\n    speculative_eagle_topk={topk},\n"
            f"    speculative_num_draft_tokens={nodes},\n    dtype=\"{c.serve_dtype}\",\n)\n")


def _vllm_command(c: CardInputs, shape: tuple[int, int, int], n: int) -> str:
    return ("### vLLM\n\n```bash\n"
            f"vllm serve {c.target_name} \\\n    --speculative-config '{{\"method\": \"eagle3\", "
            f"\"model\": \"{c.repo_id}\", \"num_speculative_tokens\": {n}}}'\n```\n")


def _vllm_python(c: CardInputs, shape: tuple[int, int, int], n: int) -> str:
    return ("from vllm import LLM\n\nllm = LLM(\n"
            f"    model=\"{c.target_name}\",\n    speculative_config={{\"method\": \"eagle3\", "
            f"\"model\": \"{c.repo_id}\", \"num_speculative_tokens\": {n}}},\n)\n")


# The engines a card can show commands for, in the order it shows them: (title, shell
# command, Python); a format's `serving` (formats/registry.py) names those that load it.
_ENGINES = {"sglang": ("SGLang", _sglang_command, _sglang_python),
            "vllm": ("vLLM", _vllm_command, _vllm_python)}


def usage(c: CardInputs) -> str:
    shape, n, note = _shapes(c)
    serving = c.serving
    unknown = (set(serving.engines) | set(serving.refused)) - set(_ENGINES)
    if unknown:
        raise ValueError(f"the card has no usage for engines {sorted(unknown)}")
    out = ["## Usage\n"]
    python = []
    for engine, (title, command, in_python) in _ENGINES.items():
        if engine in serving.engines:
            out.append(command(c, shape, n))
            if engine in serving.notes:
                out.append(serving.notes[engine](c.repo_id, n))
            python.append(in_python(c, shape, n))
        elif engine in serving.refused:
            out.append(f"### {title}\n\n{serving.refused[engine]}")
    if note:
        out.append(note)
    out.append("### Python\n\n" + "\n".join(f"```python\n{b}```\n" for b in python))
    if c.target.family == "qwen3":
        out.append(
            "### Thinking mode\n\nQwen3 thinks before it answers unless a request turns it "
            "off. The draft accepts most tokens in the mode its training data was rendered "
            "in (`eagle3kit tokenize --thinking` or `--no-thinking`); serve in that mode, "
            "e.g. per request with `\"chat_template_kwargs\": {\"enable_thinking\": false}` "
            "(SGLang and vLLM's OpenAI-compatible servers) for a non-thinking draft.\n")
    return "\n".join(out)


def _present(t: dict[str, Any], *keys: str) -> bool:
    return all(t.get(k) is not None for k in keys)


def _training_rows(t: dict[str, Any], arch: str) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []

    def add(label: str, value: str | None) -> None:
        if value:
            rows.append((label, value))

    if _present(t, "devices") or _present(t, "device_kind"):
        hw = f"{t.get('devices', '?')} x {t.get('device_kind', 'device')}"
        add("Hardware", hw + (f" (mesh {_num(t['mesh'])})" if t.get("mesh") else ""))
    data = [Path(str(t["data"])).name] if _present(t, "data") else []
    # records, not conversations: regenerated data holds a record per sampled answer
    data += [f"{_num(t[k])} {label}" for k, label in (("data_records", "records"),
                                                      ("data_tokens", "tokens"))
             if _present(t, k)]
    add("Training data", ", ".join(data))
    if _present(t, "eval_data"):
        add("Held-out data", Path(str(t["eval_data"])).name)
    if _present(t, "init_from"):
        add("Initialised from", _num(t["init_from"]))
    add("Epochs", _epochs(t) if _present(t, "epochs") else None)
    if _present(t, "steps"):
        # a run that was not cut short by --max-steps spent the same steps on every epoch
        per_epoch = (f" ({_num(round(t['steps'] / t['epochs']))} per epoch)"
                     if t.get("epochs") and "max_steps" in t and t["max_steps"] is None else "")
        add("Optimizer steps", _num(t["steps"]) + per_epoch)
    opt = [_num(t.get("optimizer") or "AdamW")] if _present(t, "b1", "b2") else (
        [_num(t["optimizer"])] if _present(t, "optimizer") else [])
    if opt and _present(t, "b1", "b2"):
        opt[0] += f" (betas {t['b1']:g}, {t['b2']:g})"
    opt += [f"weight decay {t['weight_decay']:g}"] if _present(t, "weight_decay") else []
    opt += [f"gradient clip {t['clip_norm']:g}"] if _present(t, "clip_norm") else []
    add("Optimizer", ", ".join(opt))
    lr = [f"{t['lr']:g} peak"] if _present(t, "lr") else []
    lr += [_num(t["schedule"])] if _present(t, "schedule") else []
    lr += [f"{_pct(float(t['warmup_ratio']))} warmup"] if _present(t, "warmup_ratio") else []
    lr += [f"final {t['min_lr_ratio']:g} x peak"] if _present(t, "min_lr_ratio") else []
    add("Learning rate", ", ".join(lr))
    batch = [f"B={t['batch_size']}"] if _present(t, "batch_size") else []
    batch += [f"sequence length T={t['seq_len']}"] if _present(t, "seq_len") else []
    batch += [f"gradient accumulation {t['grad_accum']}"] if _present(t, "grad_accum") else []
    add("Batch", ", ".join(batch))
    if _present(t, "ttt_length"):
        weights = (f", loss weight {t['decay']:g}^k" if _present(t, "decay")
                   and not _present(t, "loss") else "")
        add("TTT length", f"{t['ttt_length']} steps (training-time test{weights})")
    add("Loss", _loss(t) if _present(t, "loss") else None)
    precision = [f"draft {t['dtype']} (fp32 master weights)"] if _present(t, "dtype") else []
    precision += [f"target {t['target_dtype']}"] if _present(t, "target_dtype") else []
    add("Precision", ", ".join(precision))
    if _present(t, "wall_time_s"):
        add("Training time", _duration(float(t["wall_time_s"])))
    for key in sorted(set(t) - _FOLDED - _OPERATIONAL - arches.foreign_options(arch)):
        if t[key] is not None and len(_num(t[key])) <= 80:
            add(key, _num(t[key]))
    return rows


def _cell(text: str) -> str:
    """Free text as one table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _epochs(t: dict[str, Any]) -> str:
    """The epochs trained: --epochs, unless --max-steps stopped the run sooner (then the share
    of the planned steps, when the run recorded them, else what stopped it)."""
    planned, steps, cap = t.get("planned_steps"), t.get("steps"), t.get("max_steps")
    if planned and steps is not None and steps < planned:
        done = t["epochs"] * steps / planned
        return (f"{done:.2g} of the {_num(t['epochs'])} planned (stopped by --max-steps at "
                f"step {_num(steps)} of {_num(planned)})")
    if cap is not None and steps is not None and steps >= cap:
        return f"{_num(t['epochs'])} planned; stopped by --max-steps at step {_num(steps)}"
    return _num(t["epochs"])


def _frequent(c: CardInputs) -> tuple[int, int]:
    """(draft ids that are frequent training tokens, ids vocab-select filled in because
    fewer distinct tokens occurred in its data)."""
    filled = int(c.training.get("vocab_filled") or 0)
    return c.draft.draft_vocab_size - filled, filled


def _loss(t: dict[str, Any]) -> str:
    """The loss per position and the weights of the TTT steps, as `train` recorded them."""
    text = _LOSSES.get(str(t["loss"]), _num(t["loss"])) + " against the target's distribution"
    weights, decay = t.get("position_weights", "geometric"), t.get("decay")
    if weights == "geometric" and decay is not None:
        return text + f"; step k weighs {decay:g}^k"
    if weights == "verify" and decay is not None:
        return (text + "; verification-aware step weights: full weight up to the draft's "
                f"first miss, x{decay:g} per step after, each position's total as {decay:g}^k")
    return text + f"; step weights {_num(weights)}"


def training(c: CardInputs) -> str:
    recorded = _training_rows(c.training, c.draft.arch)
    rows = [("Framework", f"eagle3kit {__version__}, pure JAX"),
            *([("Recipe", _cell(c.recipe))] if c.recipe else []), *recorded]
    text = "## Training details\n\n" + _table(("Parameter", "Value"), rows)
    if not recorded:
        origin = f" from `{c.source}`" if c.source else ""
        text += f"\nNo training configuration was recorded: this draft was imported{origin}.\n"
    return text


def _eval_title(e: EvalResult) -> str:
    name = e.dataset or "unnamed data"
    if "/" in name and not name.startswith("hf:"):
        name = name.rsplit("/", 1)[-1]  # a local path says nothing to the card's reader
    return f"{name}{_drafting_shape(e) or f' ({e.mode})'}"


def _drafting_shape(e: EvalResult) -> str:
    """", chain K=7" or ", tree 5/4/8 (...)" for a generation eval that recorded its shape:
    two evals of one data set at different shapes must read apart; "" otherwise."""
    if e.mode != "generate" or e.steps is None:
        return ""
    if (e.topk or 1) <= 1:
        return f", chain K={e.steps}"
    nodes = "?" if e.draft_tokens is None else e.draft_tokens
    return (f", tree {e.steps}/{e.topk}/{nodes} (depth {e.steps}, top-{e.topk}, {nodes} "
            "tokens)")


def performance(c: CardInputs) -> str:
    if not c.evals:
        return ("## Performance\n\nNo acceptance measurements were supplied when this card "
                "was written. Measure on your own prompts with `eagle3kit eval` before relying "
                "on a speedup.\n")
    k = max(len(e.acc) for e in c.evals)
    shown = min(k, 3)
    rows = []
    for e in c.evals:
        tau = e.tau_generate if e.tau_generate is not None else e.tau
        rows.append((_eval_title(e), "-" if tau is None else f"{tau:.2f}",
                     *(_pct(e.acc[i]) if i < len(e.acc) else "-" for i in range(shown)),
                     "-" if e.speedup is None else f"{e.speedup:.2f}x"))
    out = ["## Performance\n",
           "Acceptance measured with `eagle3kit eval`. acc_k is the share of assistant tokens "
           "where draft token k+1 (acc_0: the first) equals the target's greedy token, with "
           "the ground-truth prefix; tau is the mean number of tokens produced per target "
           "forward pass (acceptance length).\n",
           _table(("Data", "tau", *(f"acc_{i}" for i in range(shown)), "Speedup"), rows)]
    for e in c.evals:
        out.append(f"### {_eval_title(e)}\n")
        if e.acc or e.accept_rate:
            header = ["Draft token", "acc_k", "acc_k, previous tokens right"]
            header += ["Accepted in generation"] if e.accept_rate else []
            rows = []
            for i in range(max(len(e.acc), len(e.accept_rate))):
                row = [i + 1, *(_pct(v[i]) if i < len(v) else "-" for v in (e.acc, e.cond_acc))]
                row += ([_pct(e.accept_rate[i]) if i < len(e.accept_rate) else "-"]
                        if e.accept_rate else [])
                rows.append(tuple(row))
            out.append(_table(tuple(header), rows))
        details = [("Assistant tokens scored", e.masked_tokens, "{:,}"),
                   ("Prompts generated", e.prompts, "{:,}"),
                   ("Max new tokens", e.max_new_tokens, "{:,}"),
                   ("tau estimated from acc_k", e.tau, "{:.2f}"),
                   ("tau (generation, pooled over verify steps)", e.tau_generate, "{:.2f}"),
                   ("tau (generation, mean per request)", e.tau_per_request_mean, "{:.2f}"),
                   ("Speedup", e.speedup, "{:.2f}x"),
                   ("Tokens/s with the draft", e.tokens_per_s_speculative, "{:.1f}"),
                   ("Tokens/s without", e.tokens_per_s_baseline, "{:.1f}"),
                   ("Draft steps", e.steps, "{}"),
                   ("Draft tree (top-k, tokens verified)",
                    (e.topk, e.draft_tokens) if (e.topk or 1) > 1 else None,
                    "top-{0[0]}, {0[1]}"),
                   ("Temperature", e.temperature, "{:g}"),
                   ("Device", e.device, "{}")]
        lines = [f"- {label}: {fmt.format(v)}" for label, v, fmt in details if v is not None]
        if lines:
            out.append("\n".join(lines) + "\n")
        if e.sweep or e.concurrency:
            out.append(_batched_table(e))
    return "\n".join(out)


def _batched_table(e: EvalResult) -> str:
    """Speculative vs plain decoding of B requests at once (`eval --concurrency/--sweep`)."""
    best = {(p["batch"], p["shape"]) for p in (e.best or {}).values()}
    rows = [(p["batch"], p["shape"] + (" (fastest)" if (p["batch"], p["shape"]) in best
                                       else ""),
             f"{p['tau_pooled']:.2f}", f"{p['tau_per_request_mean']:.2f}",
             f"{p['tokens_per_s_speculative']:.1f}", f"{p['tokens_per_s_baseline']:.1f}",
             f"{p['speedup']:.2f}x") for p in (e.sweep or e.concurrency)]
    return ("Batched decoding, B requests at once with continuous refill (shape: K draft "
            "tokens, or a tree S/k/N):\n\n"
            + _table(("Batch", "Shape", "tau pooled", "tau per request", "Tokens/s with the "
                      "draft", "Tokens/s without", "Speedup"), rows))


def architecture(c: CardInputs) -> str:
    d = c.draft
    ids = list(d.aux_layer_ids)
    rows = [
        ("Architecture", f"{arches.display(d.arch).split(' ')[0]} head: fc over "
                         f"{len(ids)} target states{' (each RMS-normed first)' if d.fc_norm else ''}"
                         ", one Llama decoder layer of width 2H, own lm_head over the draft "
                         "vocabulary" + ("; the post-norm state feeds the next step "
                                         "(norm_output)" if d.norm_output else "")),
        ("Hidden size", _num(d.hidden_size)),
        ("Attention heads", f"{d.num_heads} (GQA: {d.num_kv_heads} KV heads, head dim "
                            f"{d.head_dim})"),
        ("Intermediate size", _num(d.intermediate_size)),
        ("Target vocabulary", _num(d.vocab_size)),
        ("Draft vocabulary", _draft_vocab(c)),
        ("Target layers read", f"hidden_states {ids} (inputs of layers {ids}; SGLang ids "
                               f"{[i - 1 for i in ids]})"),
        ("Residual", "normed hidden (norm_before_residual)" if d.norm_before_residual
         else "un-normed fused hidden (EAGLE3 / SGLang)"),
        ("Parameters", f"{_count(d.num_params)} trainable (the embedding is the target's, "
                       "not included)"),
        ("Weights", f"{c.dtype} safetensors ({c.engine_format} format)"),
    ]
    files = _table(("File", "Bytes"), [(f"`{n}`", f"{s:,}") for n, s in c.files])
    return ("## Model architecture\n\n" + _table(("Parameter", "Value"), rows)
            + "\n### Files\n\n" + files
            + "\n`eagle3kit.json` records provenance (target config, training configuration); "
              "the engines ignore it.\n")


def _draft_vocab(c: CardInputs) -> str:
    frequent, filled = _frequent(c)
    if not filled:
        return (f"{_num(c.draft.draft_vocab_size)} (most frequent target tokens; d2t/t2d map "
                "them)")
    return (f"{_num(c.draft.draft_vocab_size)}: the {_num(frequent)} tokens of the training "
            f"data and {_num(filled)} placeholder ids (d2t/t2d map them)")


def limitations(c: CardInputs) -> str:
    d = c.draft
    items = [f"Works only with `{c.target_name}`: it reads that model's hidden states and "
             "embeddings. Another model, a fine-tune or a differently quantised copy will "
             "accept fewer tokens.",
             "Acceptance depends on the prompt distribution; languages and domains absent "
             "from the training data accept fewer tokens."
             + ("" if c.evals else " No acceptance was measured for this card.")]
    frequent, filled = _frequent(c)
    if filled:
        items.append(f"The draft proposes only the {frequent:,} distinct tokens of its "
                     f"training data ({_pct(frequent / d.vocab_size)} of the vocabulary); "
                     f"the other {filled:,} of its {d.draft_vocab_size:,} draft ids are "
                     "placeholders `vocab-select` filled in, tokens it never saw. Other "
                     "tokens are never drafted, though the target still generates them.")
    elif d.draft_vocab_size < d.vocab_size:
        items.append(f"The draft proposes only the {d.draft_vocab_size:,} most frequent "
                     f"training tokens ({_pct(d.draft_vocab_size / d.vocab_size)} of the "
                     "vocabulary); other tokens are never drafted, though the target still "
                     "generates them.")
    if c.target.family == "qwen3":
        items.append("Acceptance differs between Qwen3's thinking and non-thinking modes; "
                     "the numbers above hold for the mode the training data was rendered in.")
    if not any(e.temperature for e in c.evals):
        items.append("Speedups at temperature > 0 are usually lower than at temperature 0.")
    return "## Limitations\n\n" + "\n".join(f"- {i}" for i in items) + "\n"


def license_section(c: CardInputs) -> str:
    if c.license:
        return (f"## License\n\nReleased under `{c.license}`, the license of the base model "
                f"`{c.target_name}`: the draft is trained on its hidden states and outputs.\n")
    return (f"## License\n\nThe license of the base model `{c.target_name}` could not be "
            "determined; the draft is derived from it and subject to its terms. Set it with "
            "`eagle3kit push --license` before publishing.\n")


REFERENCES = """## References

```bibtex
@inproceedings{li2025eagle3,
  author    = {Yuhui Li and Fangyun Wei and Chao Zhang and Hongyang Zhang},
  title     = {{EAGLE-3}: Scaling up Inference Acceleration of Large Language Models via
               Training-Time Test},
  booktitle = {Annual Conference on Neural Information Processing Systems},
  year      = {2025}
}
```
"""
