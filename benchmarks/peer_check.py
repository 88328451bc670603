"""A trained draft's exports in the peers' own model code (issue 35: "the exports of this draft
load in the peers' own model code with equal logits"), no target needed:

    python benchmarks/peer_check.py RUN/final --sglang EXPORT --speculators EXPORT \
        [--tokens 64] [--rows 2] [--steps 2] [--out R.md]

- SGLang 0.5.23's `LlamaForCausalLMEagle3` (sglang/srt/models/llama_eagle3.py) builds the model
  from the SGLang export's config and loads its safetensors, in a process of its own through
  tests/formats/sglang_runner.py (stand-ins for the serving packages it imports but never runs
  here, CUDA hidden); every tensor must land in a parameter (d2t/t2d aside, which SGLang maps
  to its hot-token ids), every parameter but the target-owned embedding must be written.
- speculators 0.9.0's `Eagle3DraftModel.from_pretrained` loads the speculators export, its
  verifier a local stand-in (the target's config from the draft, the random embedding below:
  no hub here); no unexpected tensor, every parameter but the target-owned ones written, each
  equal to the export's.

Both then run on random captured states (standard normal, [rows, tokens, 3 x target hidden])
and the embeddings of random token ids (one random embedding table, the target's stand-in),
fp32 on the CPU, against eagle3kit's JAX forward of the native draft, its weights rounded to
the export's dtype (a bf16 export holds bf16 weights; the arithmetic is fp32 on both sides):
SGLang over `--steps` steps (each later one reads the state the previous carried), speculators
over its first (one packed row). The tolerance is the tests' (tests/formats/helpers.py:
2e-4 of the logits' scale). Prints a markdown table; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # before jax: fp32 is fp32
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from tests.formats.helpers import assert_same_logits  # noqa: E402

from eagle3kit.core import draft, layers  # noqa: E402
from eagle3kit.io.draft_io import load_draft  # noqa: E402

RUNNER = ROOT / "tests" / "formats" / "sglang_runner.py"
# the parameters an export never writes: the target's embedding, and speculators' verifier
# head and norm (its training loss only; loaded from the verifier, which is not here)
TARGET_OWNED = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}


def _export_dtype(directory: Path):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "np") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()} - {"I64", "BOOL"}
    (name,) = dtypes  # one float type for every weight
    return {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}[name]


def reference(d, aux: np.ndarray, embeds: np.ndarray, steps: int, dtype) -> list[np.ndarray]:
    """eagle3kit's forward of the native draft on the captured states `aux` (its own
    aux_layer_ids order): `steps` logits [B, T, V] over the target vocabulary, -inf off the
    draft's, the weights rounded to `dtype` first."""
    w = jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(dtype).astype(np.float32)),
                     d.weights)
    cfg, (b, n) = d.config, aux.shape[:2]
    mask = layers.causal_mask(jnp.ones((b, n), jnp.int32))
    hidden = draft.fuse(w, cfg, jnp.asarray(aux))
    out = []
    for k in range(steps):
        pos = jnp.broadcast_to(jnp.arange(n) + k, (b, n))
        hidden, _ = draft.step(w, cfg, jnp.asarray(embeds), hidden, pos, draft.masked(mask))
        full = np.full((b, n, cfg.vocab_size), -np.inf, np.float32)
        full[..., d.vocab.used_ids] = np.asarray(draft.head(w, cfg, hidden))
        out.append(full)
    return out


def _chunks(d, aux: np.ndarray, hf_ids) -> np.ndarray:
    """`aux` (chunks in the draft's aux_layer_ids order) re-ordered to `hf_ids` (HF
    hidden_states indices, the order a peer concatenates its captures in)."""
    h = d.config.target_hidden_size
    by_layer = {i: aux[..., j * h:(j + 1) * h] for j, i in enumerate(d.config.aux_layer_ids)}
    assert sorted(hf_ids) == sorted(by_layer), (hf_ids, d.config.aux_layer_ids)
    return np.concatenate([by_layer[i] for i in hf_ids], -1)


def check_sglang(d, export: Path, aux, embeds, steps: int) -> str:
    config = json.loads((export / "config.json").read_text())
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = config.get("num_target_layers") or d.target_config.get("num_hidden_layers")
    # SGLang's ids are "output of layer i" (HF index i + 1), captured in layer order
    captures = sorted(i + 1 for i in ids) if ids else [2, n // 2, n - 3]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        np.savez(tmp / "in.npz", embeds=embeds, aux=_chunks(d, aux, captures), steps=steps)
        (tmp / "request.json").write_text(json.dumps([{
            "export": str(export), "inputs": str(tmp / "in.npz"),
            "outputs": str(tmp / "out.npz")}]))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # SGLang's CPU path: no kernels
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        r = subprocess.run([sys.executable, str(RUNNER), str(tmp / "request.json")],
                           env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode:
            raise AssertionError(f"SGLang's runner exited {r.returncode}: {r.stderr[-2000:]}")
        logits = np.load(tmp / "out.npz")["logits"]
        report = json.loads((tmp / "out.json").read_text())
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert set(report["landed"]) == names, sorted(names ^ set(report["landed"]))
    skipped = sorted(k for k, params in report["landed"].items() if not params)
    assert skipped == ["d2t", "t2d"], f"tensors SGLang skips: {skipped}"
    assert report["unwritten"] == ["model.embed_tokens.weight"], (
        f"parameters no tensor wrote: {report['unwritten']}")
    assert report["hot_token_id"] == d.vocab.used_ids.tolist(), "hot-token ids differ"
    assert report["fc_norm"] is d.config.fc_norm and report["norm_output"] is d.config.norm_output
    expected = reference(d, aux, embeds, steps, _export_dtype(export))
    assert_same_logits(list(logits), expected)
    return (f"{len(names)} tensors landed, {len(report['parameters'])} parameters; "
            f"{_error(list(logits), expected)}")


def _verifier(d, table: np.ndarray, directory: Path) -> Path:
    """A stand-in for the target the library reads its verifier from: the target's config
    (from the draft), `table` as its embedding (the output layer falls back to it), a unit
    final norm."""
    from safetensors.numpy import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(d.target_config))
    save_file({"model.embed_tokens.weight": table,
               "model.norm.weight": np.ones(d.config.target_hidden_size, np.float32)},
              str(directory / "model.safetensors"))
    return directory


def check_speculators(d, export: Path, aux, token_ids, table) -> str:
    import speculators.models.eagle3 as spec
    import torch
    from safetensors.torch import load_file

    cfg = spec.Eagle3SpeculatorConfig.from_pretrained(export)
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention: GPU only
    with tempfile.TemporaryDirectory() as tmp:
        # the library reads its verifier's config (hidden size, layer count: its own checks
        # of the capture layers) and embedding from there: no hub here
        cfg.speculators_config.verifier.name_or_path = str(_verifier(d, table, Path(tmp) / "v"))
        model = spec.Eagle3DraftModel.from_pretrained(export, config=cfg).float().eval()
    written, held = load_file(str(export / "model.safetensors")), model.state_dict()
    unexpected = sorted(set(written) - set(held))
    assert not unexpected, f"tensors speculators has no place for: {unexpected}"
    missing = sorted(set(held) - set(written) - TARGET_OWNED)
    assert not missing, f"parameters the export does not write: {missing}"
    unwritten = sorted(k for k, p in model.named_parameters()
                       if p.requires_grad and k not in written)
    assert not unwritten, f"trainable parameters the export does not write: {unwritten}"
    differ = [k for k, v in written.items() if not torch.equal(held[k], v.to(held[k].dtype))]
    assert not differ, f"tensors loaded with other values: {differ}"
    ids = torch.from_numpy(token_ids[:1])  # the library's forward takes one packed row
    with torch.no_grad():  # (the library keeps an initialised embedding over the verifier's)
        model.embed_tokens.weight.copy_(torch.from_numpy(table))
    got = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: got.append(o.numpy()))
    with torch.no_grad():
        model(torch.from_numpy(_chunks(d, aux[:1], cfg.eagle_aux_hidden_state_layer_ids)), ids,
              torch.zeros_like(ids), position_ids=torch.arange(ids.shape[1])[None], ttt_steps=1)
    hook.remove()
    full = reference(d, aux[:1], table[token_ids[:1]], 1, _export_dtype(export))[0]
    expected = [full[..., d.vocab.used_ids]]
    assert_same_logits(got, expected)
    return (f"{len(written)} tensors, none unexpected; the rest the target's "
            f"{sorted(set(held) - set(written))}; {_error(got, expected)}")


def _error(actual, expected) -> str:
    errs = []
    for a, e in zip(actual, expected, strict=True):
        fin = np.isfinite(e)
        errs.append(np.abs(a[fin] - e[fin]).max() / np.abs(e[fin]).max())
    return "max error / scale " + ", ".join(f"{x:.1e}" for x in errs) + " (tolerance 2e-4)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft", type=Path, help="the native draft (a run's final/)")
    ap.add_argument("--sglang", type=Path, help="its SGLang export")
    ap.add_argument("--speculators", type=Path, help="its speculators export")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="SGLang draft steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the markdown table here")
    args = ap.parse_args()
    if not (args.sglang or args.speculators):
        ap.error("name an export: --sglang and/or --speculators")

    d = load_draft(args.draft)
    cfg = d.config
    rng = np.random.default_rng(args.seed)
    aux = rng.standard_normal((args.rows, args.tokens, len(cfg.aux_layer_ids)
                               * cfg.target_hidden_size)).astype(np.float32)
    token_ids = rng.integers(0, cfg.vocab_size, (args.rows, args.tokens))
    table = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    embeds = table[token_ids]

    rows = []
    for name, export, fn in (
            ("SGLang 0.5.23 LlamaForCausalLMEagle3", args.sglang,
             lambda e: check_sglang(d, e, aux, embeds, args.steps)),
            ("speculators 0.9.0 Eagle3DraftModel", args.speculators,
             lambda e: check_speculators(d, e, aux, token_ids, table))):
        if export is None:
            continue
        t = time.perf_counter()
        try:
            rows.append((name, export, "ok", fn(export), time.perf_counter() - t))
        except Exception as e:  # noqa: BLE001 - one row per peer, the other still runs
            traceback.print_exc()
            rows.append((name, export, "**FAIL**", (str(e) or type(e).__name__)[:300],
                         time.perf_counter() - t))
    lines = [f"### {args.draft}: the exports in the peers' own code (fp32)", "",
             f"{cfg.arch}, hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, "
             f"draft vocab {cfg.draft_vocab_size} of {cfg.vocab_size}, captures "
             f"{cfg.aux_layer_ids}; random inputs {args.rows} x {args.tokens} (seed {args.seed})",
             "", "| peer | export | result | detail | s |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {e} | {r} | {' '.join(x.split()).replace('|', '/')} | {s:.0f} |"
              for n, e, r, x, s in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if any(r != "ok" for _, _, r, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
