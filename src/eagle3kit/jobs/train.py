"""The `train` job: check artifacts, build the mesh, run the TTT loop, checkpoint, finish.

Run directory:

    OUT/config.json      the full resolved configuration and the fingerprints of target,
                         data and vocab (a resumed run must agree with it)
    OUT/metrics.jsonl    one record per logged step (and per evaluation)
    OUT/checkpoints/     atomic checkpoints (io/checkpoints.py)
    OUT/final/           the finished draft in eagle3kit's format (io/draft_io.py)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eagle3kit.core import arches, target, ttt
from eagle3kit.core.config import DraftConfig
from eagle3kit.core.metrics import summarize
from eagle3kit.core.sharding import batch_ways, make_mesh, shardings, to_host
from eagle3kit.core.target import TargetWeights
from eagle3kit.core.train_attention import resolve_attention
from eagle3kit.core.trainer import Trainer, put_batch
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.data.fingerprint import require_same
from eagle3kit.data.packing import pack_epoch
from eagle3kit.errors import (
    MismatchError,
    TimeLimitReached,
    TrainingDiverged,
    UserError,
    plural,
)
from eagle3kit.io import checkpoints
from eagle3kit.io.atomic import atomic_path
from eagle3kit.io.draft_io import Draft, save_draft
from eagle3kit.io.hf import load_target, resolve_target
from eagle3kit.jobs import common
from eagle3kit.jobs.config import TrainConfig, defaults
from eagle3kit.jobs.preempt import Preempted, Preemption
from eagle3kit.jobs.progress import TrainProgress
from eagle3kit.jobs.tracking import MetricsLog

# fields a resumed run may change (how long, how often); everything else must match
_RESUMABLE = {"epochs", "max_steps", "save_every", "keep_checkpoints", "eval_every",
              "log_every", "resume", "eval_data", "mesh", "out", "attention", "time_limit",
              "profile_steps", "track"}


def check_run_dir(out: Path) -> None:
    """Before any loading: a config.json in --out that a training run did not write (a model
    or export folder, an SGLang or Hugging Face `config.json`) is refused; the run would
    replace it with its own."""
    recorded = out / "config.json"
    if not recorded.is_file():
        return
    try:
        record = json.loads(recorded.read_text())
    except (UnicodeDecodeError, ValueError):
        record = None
    if not (isinstance(record, dict) and {"config", "fingerprints"} <= record.keys()):
        raise UserError("holds a config.json that no eagle3kit training run wrote (a model or "
                        "an export?); training would replace it: choose another --out",
                        path=out)


def _prepare_run_dir(cfg: TrainConfig, fingerprints: dict[str, Any]) -> Path:
    out = Path(cfg.out)
    recorded = out / "config.json"
    # a run that stopped before its first checkpoint (killed, out of memory) saved nothing to
    # continue: its config.json claims no run, and this one starts over in its place
    if recorded.exists() and checkpoints.list_checkpoints(out):
        if not cfg.resume:
            raise UserError(f"{out} already holds a run; pass --resume to continue it or "
                            "choose another --out")
        old = json.loads(recorded.read_text())
        before = {**defaults().to_json(), **old["config"]}  # a key added since: its default
        for key, value in cfg.to_json().items():
            if key not in _RESUMABLE and before.get(key) != value:
                raise MismatchError(f"--{key.replace('_', '-')} is {value!r} but the run was "
                                    f"started with {before.get(key)!r}; resume with "
                                    "its settings, or start a new run in another --out",
                                    path=recorded)
        for key, value in fingerprints.items():
            if old["fingerprints"].get(key) != value:
                raise MismatchError(f"the {key} changed since the run started "
                                    f"({old['fingerprints'].get(key)} -> {value})",
                                    path=recorded)
    elif cfg.resume and not recorded.exists():
        raise UserError(f"--resume: {out} holds no run to resume")
    common.barrier("run-dir checked")  # every process has looked before process 0 writes
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        with atomic_path(recorded) as tmp:
            tmp.write_text(json.dumps({"config": cfg.to_json(), "fingerprints": fingerprints,
                                       "eagle3kit": _version(), "devices": _devices()},
                                      indent=2, sort_keys=True) + "\n")
    return out


def _version() -> str:
    from eagle3kit import __version__

    return __version__


def _devices() -> dict[str, Any]:
    d = jax.devices()
    return {"count": len(d), "kind": d[0].device_kind, "platform": d[0].platform,
            "processes": jax.process_count()}


@dataclasses.dataclass
class _Setup:
    """Everything checked and loaded before the first step."""

    docs: Any
    eval_docs: Any
    tcfg: Any
    ckpt: Any
    dcfg: DraftConfig
    vocab: Any
    fingerprints: dict[str, Any]
    mesh: Any
    init: Draft | None
    vocab_filled: int = 0  # draft ids vocab-select filled in (tokens absent from its data)


def run(cfg: TrainConfig, console, stop: Preemption | None = None) -> Path:
    """Trains a draft as configured; returns OUT/final.

    `stop` (SIGTERM/SIGINT as a flag) is read between start-up phases and at every step
    boundary: a checkpoint, then `Preempted` (exit 75).
    """
    t_start = time.time()
    stop = stop or Preemption()
    check_run_dir(Path(cfg.out))
    common.compile_cache(console.print)  # a resumed run loads its programs from disk
    setup = _check_and_load(cfg)
    _stop_if_asked(stop, "before training started; nothing to save")
    out = _prepare_run_dir(cfg, setup.fingerprints)  # only once every check has passed
    docs, tcfg, mesh = setup.docs, setup.tcfg, setup.mesh
    rows = cfg.batch_size * cfg.grad_accum  # the global batch, every process alike
    epoch_batches = -(-len(pack_epoch(docs, cfg.seq_len, cfg.seed, 0).rows) // rows)
    # The LR schedule spans the planned run (--epochs); --max-steps only stops early, so a
    # capped run resumed with a larger cap continues exactly as one uninterrupted run.
    planned_steps = epoch_batches * cfg.epochs
    total_steps = min(planned_steps, cfg.max_steps or planned_steps)
    ttt_cfg = ttt.TTTConfig(cfg.ttt.steps, cfg.ttt.decay, common.DTYPES[cfg.dtype],
                            resolve_attention(cfg.attention, jax.default_backend(),
                                              common.DTYPES[cfg.target_dtype],
                                              common.DTYPES[cfg.dtype]),
                            loss=cfg.ttt.loss, position_weights=cfg.ttt.position_weights,
                            anchors=cfg.anchors)
    trainer = Trainer(tcfg, setup.dcfg, ttt_cfg,
                      dataclasses.replace(cfg.optim, total_steps=planned_steps), mesh)
    # per-layer arrays: the scan over stacked layers would copy each layer's weights per step
    target_w = target.unstack_in_place(
        load_target(setup.ckpt, mesh, common.DTYPES[cfg.target_dtype]), tcfg, fuse=False)
    vocab_dev = jax.device_put(VocabArrays.from_map(setup.vocab), trainer.replicated)
    state, step, epoch, position, elapsed_before = _initial_state(cfg, trainer, out,
                                                                  setup.init, console,
                                                                  target_w, vocab_dev)
    _stop_if_asked(stop, "before training started; nothing to save")
    t_segment = time.time()  # wall time of earlier (resumed) segments is in elapsed_before
    read = len(docs) + docs.dropped
    console.print(f"train {tcfg.name}: {plural(read, 'record')} read, {len(docs):,} used "
                  f"({plural(docs.num_tokens, 'token')}; {docs.truncated:,} cut to --seq-len "
                  f"{cfg.seq_len})"
                  + (f", {docs.dropped:,} dropped (no assistant token in their first "
                     f"{cfg.seq_len} tokens)" if docs.dropped else "")
                  + f"; {plural(epoch_batches, 'step')}/epoch x {plural(cfg.epochs, 'epoch')} = "
                  f"{plural(planned_steps, 'step')}"
                  + (f" (stopping at {total_steps})" if total_steps < planned_steps else "")
                  + f"; mesh data={mesh.shape['data']},tensor={mesh.shape['tensor']} on "
                  f"{jax.device_count()} {jax.devices()[0].device_kind}")
    log = (MetricsLog(out, cfg.track, cfg.to_json(), step) if jax.process_index() == 0
           else None)
    progress = TrainProgress(console, total_steps, start=step, log_every=cfg.log_every)
    pending = None
    last_saved = step
    tracing = False

    def checkpoint() -> None:  # report the step still in flight first: its loss may be NaN
        nonlocal pending, last_saved
        if pending is not None:
            _report(pending, log, progress)
            pending = None
        if last_saved != step:
            _save(out, state, step, epoch, position, cfg,
                  elapsed_before + time.time() - t_segment)
            last_saved = step

    eval_docs = setup.eval_docs
    first = step  # the flags are read at the boundaries after it (before it: _stop_if_asked)
    try:
        with progress:
            if eval_docs is not None and step == 0:  # the starting point, for comparison
                _evaluate(trainer, state, target_w, vocab_dev, eval_docs, cfg, 0, log, progress)
            while step < total_steps:
                packed = pack_epoch(docs, cfg.seq_len, cfg.seed, epoch)
                while position < epoch_batches and step < total_steps:
                    arrays = packed.batch(position * rows, rows)
                    arrays = {k: v.reshape(cfg.grad_accum, -1, cfg.seq_len)
                              for k, v in arrays.items()}
                    batch = put_batch(trainer, arrays)  # while the step in flight runs
                    if pending is not None:  # one step in flight: a signal stops the run at
                        jax.block_until_ready(pending[2])  # the boundary after it, no later
                    # across hosts the flags are agreed by a collective, which waits for the
                    # step in flight: every --log-every steps (each step with --time-limit)
                    if step > first and (jax.process_count() == 1 or cfg.time_limit
                                         or step % cfg.log_every == 0):
                        late = bool(cfg.time_limit and time.time() - t_start > cfg.time_limit)
                        reason = common.agree_max(2 * stop.requested + late)
                        if reason:
                            checkpoint()
                            why = (f"stopped by {stop.name or 'a signal on another process'}"
                                   if reason >= 2 else "--time-limit reached")
                            err = Preempted if reason >= 2 else TimeLimitReached
                            raise err(f"{why} at step {step}/{total_steps}; checkpoint "
                                      "saved, continue with --resume")
                    if cfg.profile_steps and step == cfg.profile_steps[0]:
                        jax.profiler.start_trace(str(out / "profile"))
                        tracing = True
                    state, metrics = _step(trainer, state, target_w, vocab_dev, batch, step, cfg)
                    step, position = step + 1, position + 1
                    if tracing and step == cfg.profile_steps[1]:
                        jax.block_until_ready(metrics.loss)
                        jax.profiler.stop_trace()
                        tracing = False
                    if pending is not None:  # the previous step's, while this one runs
                        _report(pending, log, progress)
                    pending = (step, epoch, metrics, time.time())  # reported a step later
                    if step % cfg.save_every == 0 or step == total_steps:
                        checkpoint()
                    if eval_docs is not None and (step % cfg.eval_every == 0
                                                  or step == total_steps):
                        _evaluate(trainer, state, target_w, vocab_dev, eval_docs, cfg, step,
                                  log, progress)
                if position >= epoch_batches:
                    epoch, position = epoch + 1, 0
            if pending is not None:
                _report(pending, log, progress)
    except TrainingDiverged as e:
        if not checkpoints.list_checkpoints(out):  # diverged before the first --save-every
            raise TrainingDiverged(f"{e} No checkpoint was written before it; lower --lr or "
                                   "raise --warmup-ratio and run again (no --resume: the run "
                                   "starts over in the same --out).") from None
        raise TrainingDiverged(f"{e} The last good checkpoint is step {last_saved} in "
                               f"{checkpoints.checkpoint_dir(out)}; lower --lr or raise "
                               "--warmup-ratio, then --resume.") from None
    finally:
        if tracing:
            jax.profiler.stop_trace()
        if log:
            log.close()
    return _finish(cfg, out, state, step, setup, elapsed_before + time.time() - t_segment,
                   console, planned_steps)


def _check_and_load(cfg: TrainConfig) -> _Setup:
    """Every artifact check, cheapest first, before any device work."""
    vfile = common.load_vocab_file(cfg.vocab)
    key = vfile.fingerprint.key
    ckpt = resolve_target(cfg.target)
    tcfg = ckpt.config
    common.check_seq_len(cfg.seq_len, tcfg, cfg.target)
    _, target_key = common.target_tokenizer(cfg.target, required=False)
    if target_key:  # refuse a vocab (and data) tokenized for another model
        require_same(target_key, key, "the vocab", cfg.vocab,
                     f"the tokenizer of --target {cfg.target}",
                     "select the vocab (vocab-select) from data tokenized with the target's "
                     "tokenizer")
    vocab = common.fit_vocab_to_target(vfile.vocab, tcfg.vocab_size, cfg.vocab)
    docs = common.read_docs(cfg.data, key, cfg.seq_len)
    eval_docs = common.read_docs(cfg.eval_data, key, cfg.seq_len) if cfg.eval_data else None
    fingerprints = {
        "tokenizer": vfile.fingerprint.to_json(),
        "data": common.file_digest(cfg.data),
        "vocab": hashlib.sha256(vocab.used_ids.tobytes()).hexdigest()[:16],
        "target": f"{tcfg.name}:{tcfg.family}:{tcfg.num_layers}x{tcfg.hidden_size}:"
                  f"{tcfg.vocab_size}",
    }
    mesh = make_mesh(cfg.mesh)
    if cfg.batch_size % batch_ways(mesh):
        raise UserError(f"--batch-size {cfg.batch_size} must be a multiple of the data axis "
                        f"({batch_ways(mesh)}); rows are split over data-parallel devices")
    shardings(TargetWeights.abstract(tcfg), mesh)  # a mesh that cannot split the heads: now
    init = _init_params(cfg, ckpt, key)
    dcfg = init.config if init else DraftConfig.for_target(
        tcfg, vocab.draft_size, cfg.aux_layer_ids).with_arch(cfg.arch)
    configure = getattr(arches.method_module(dcfg.method), "configure", None)
    if configure and not init:  # a method's own settings (its block, layers, mask token)
        dcfg = configure(dcfg, ckpt.hf_config, cfg)
    if init:
        vocab = _check_init_vocab(init, vocab, cfg.init_from)
        if init.config.arch != cfg.arch:
            raise UserError(f"--init-from {cfg.init_from} is an {init.config.arch} draft but "
                            f"--arch is {cfg.arch}; pass --arch {init.config.arch}")
    return _Setup(docs, eval_docs, tcfg, ckpt, dcfg, vocab, fingerprints, mesh, init,
                  int(vfile.metadata.get("filled", 0)))


def _stop_if_asked(stop: Preemption, what: str) -> None:
    if common.agree_max(int(stop.requested)):
        raise Preempted(f"stopped by {stop.name or 'a signal on another process'} {what}")


def _finish(cfg: TrainConfig, out: Path, state, step: int, setup: _Setup, wall: float,
            console, planned_steps: int) -> Path:
    """Writes OUT/final: the draft with its vocab, fingerprints and training record."""
    final = out / "final"
    if jax.process_index() == 0:
        docs, tcfg, mesh = setup.docs, setup.tcfg, setup.mesh
        training = {**cfg.to_json(), "steps": step, "wall_time_s": round(wall),
                    "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
                    "data_records": len(docs), "data_tokens": docs.num_tokens,
                    # what the card needs to say what was trained: the steps of --epochs
                    # (--max-steps may stop sooner) and the vocab's placeholder ids
                    "planned_steps": planned_steps, "vocab_filled": setup.vocab_filled,
                    "mesh": f"data={mesh.shape['data']},tensor={mesh.shape['tensor']}"}
        save_draft(final, Draft(setup.dcfg, state.params, setup.vocab, tcfg.name,
                                setup.ckpt.hf_config, setup.fingerprints, training),
                   force=True)
        console.print(f"done: {plural(step, 'step')} in {wall:.0f}s; draft written to {final}")
    return final


def _init_params(cfg: TrainConfig, ckpt, key: str) -> Draft | None:
    """The --init-from draft, refused unless it was made for this target and tokenizer."""
    if not cfg.init_from:
        return None
    return common.load_draft_for_target(cfg.init_from, cfg.target, ckpt, key)


def _check_init_vocab(init: Draft, vocab, where) -> Any:
    if not np.array_equal(init.vocab.used_ids, vocab.used_ids):
        raise MismatchError("--init-from draft uses another draft vocabulary than --vocab; "
                            "pass that draft's vocab (or re-select with its ids)", path=where)
    return init.vocab


def _initial_state(cfg: TrainConfig, trainer: Trainer, out: Path, init: Draft | None,
                   console, target_w, vocab_dev):
    """(state, step, epoch, position, elapsed seconds) to start from.

    With --resume: the newest checkpoint, or step 0 when the run stopped before its first
    one. Either way metrics.jsonl is cut back to that step, so after a kill and a resume it
    reads as one run (the steps re-run are logged once).
    """
    existing = checkpoints.list_checkpoints(out)
    if cfg.resume and existing:
        abstract = trainer.abstract_state()
        values, meta = checkpoints.load(existing[-1], abstract)
        state = jax.device_put(values, trainer.state_shardings)
        step = int(meta["step"])
        _truncate_metrics(out / "metrics.jsonl", step)
        console.print(f"resuming {out} from step {step} ({existing[-1].name})")
        return (state, step, int(meta["epoch"]), int(meta["position"]),
                float(meta.get("elapsed_s", 0.0)))
    if (out / "metrics.jsonl").exists():  # an earlier start that saved no checkpoint
        console.print(f"{out} holds a run that stopped before its first checkpoint: "
                      "starting it over from step 1")
        _truncate_metrics(out / "metrics.jsonl", 0)
    params = init.weights if init else None
    key = jax.random.key(cfg.seed)
    if params is None and hasattr(trainer.method, "initial_weights"):
        # a method that starts from some of the target's weights (P-EAGLE its embedding,
        # DFlash its head)
        params = trainer.method.initial_weights(trainer.dcfg, key, target_w, vocab_dev,
                                                trainer.mesh)
    return trainer.init_state(key, params), 0, 0, 0, 0.0


def _truncate_metrics(path: Path, step: int) -> None:
    """Keeps the records a run resumed at `step` will not write again.

    Records up to `step` stay (that step's train record is written before its checkpoint;
    its eval record, if any, after); an evaluation at step 0 is re-run, so none stays then.
    A line cut short by the kill is dropped.
    """
    if jax.process_index() != 0 or not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) < step or (0 < step == record.get("step")):
            kept.append(line + "\n")
    with atomic_path(path) as tmp:
        tmp.write_text("".join(kept))


def _step(trainer, state, target_w, vocab_dev, batch, step, cfg):
    with common.out_of_memory(
            f"--batch-size {cfg.batch_size} x --seq-len {cfg.seq_len} x --ttt-length "
            f"{cfg.ttt.steps}", "lower --batch-size (and raise --grad-accum to keep the global "
            "batch), shorten --seq-len, or add tensor parallelism (--mesh tensor=N)"):
        return trainer.train_step(state, target_w, vocab_dev, batch, step)


def _report(pending, log, progress) -> None:
    step, epoch, m, t = pending
    m = to_host(m)
    loss = float(m.loss)
    if not math.isfinite(loss):
        raise TrainingDiverged(f"the loss became {loss} at step {step}.")
    s = summarize(m.counts)
    record = {"step": step, "epoch": epoch, "loss": round(loss, 6), "lr": float(m.lr),
              "grad_norm": round(float(m.grad_norm), 6), "tokens": int(m.tokens),
              "acc": s["acc"], "cond_acc": s["cond_acc"], "tau": s["tau"]}
    record["tokens_per_s"] = progress.update(step, record, t)
    if log:
        log.write(record)


def _save(out, state, step, epoch, position, cfg, elapsed_s: float) -> None:
    if jax.process_index() == 0:
        checkpoints.save(out, state, {"step": step, "epoch": epoch, "position": position,
                                      "seed": cfg.seed, "elapsed_s": round(elapsed_s, 1)},
                         keep=cfg.keep_checkpoints)


def _evaluate(trainer, state, target_w, vocab_dev, docs, cfg, step, log, progress) -> None:
    s = common.teacher_forced(trainer, state.params, target_w, vocab_dev, docs,
                              cfg.batch_size, cfg.seq_len)
    record = {"step": step, "eval": True, **s}
    progress.note_eval(record)
    if log:
        log.write(record)
