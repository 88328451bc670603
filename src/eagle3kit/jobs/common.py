"""Pieces shared by the train and eval jobs: loading artifacts, checking they belong
together, distributed start-up, and teacher-forced evaluation (one implementation)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eagle3kit.core.config import TargetConfig
from eagle3kit.core.metrics import StepCounts, summarize
from eagle3kit.core.vocab import VocabMap
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.data.fingerprint import Fingerprint, require_same, tokenizer_fingerprint
from eagle3kit.data.packing import TokenDocs, pack_epoch
from eagle3kit.decode import executables
from eagle3kit.errors import (
    InputError,
    MismatchError,
    ResourceError,
    UserError,
    device_out_of_memory,
    first_line,
)
from eagle3kit.io import dtypes
from eagle3kit.io.checkpoints import file_sha256
from eagle3kit.io.draft_io import Draft
from eagle3kit.io.hf import TargetCheckpoint

DTYPES = {name: dtypes.DTYPES[name] for name in dtypes.COMPUTE}  # what train and eval take


def init_distributed(coordinator: str | None, num_processes: int | None,
                     process_id: int | None) -> None:
    """Starts multi-host JAX when asked, or when a cluster environment is detected
    (Cloud TPU, SLURM, ... through jax.distributed's own auto-detection)."""
    if coordinator or num_processes:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    elif os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()
    elif os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
        jax.distributed.initialize()


COMPILE_CACHE = "~/.cache/eagle3kit/xla"  # default of EAGLE3KIT_COMPILE_CACHE


def compile_cache(warn: Callable[[str], None]) -> str | None:
    """On accelerators, keeps compiled programs on disk for `regenerate`, `eval` and `train`
    (EAGLE3KIT_COMPILE_CACHE, default ~/.cache/eagle3kit/xla; JAX_COMPILATION_CACHE_DIR
    wins where set): a repeated or resumed run loads the programs an earlier one compiled.
    On a CPU only where EAGLE3KIT_COMPILE_CACHE asks for it. Call before anything starts
    JAX's backend: this starts it, with this process's share of a GPU others may use
    (jobs/gpu_share.py). Returns the directory in use (None: none)."""
    from eagle3kit.jobs.gpu_share import share_gpu

    share_gpu(warn)
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    asked = os.environ.get("EAGLE3KIT_COMPILE_CACHE")
    if not asked and jax.default_backend() == "cpu":  # compiles in seconds; not worth the disk
        return None
    return use_compile_cache(asked or COMPILE_CACHE, warn)


def use_compile_cache(path: str, warn: Callable[[str], None]) -> str | None:
    """Compiled programs go to and come from `path`, if it is a directory this process can
    write (made if missing); else one warning and the run compiles without a cache. JAX's
    cache keeps XLA's compiles; the engine's programs are kept whole under EXECUTABLES
    (decode/executables.py: a hit neither traces, lowers nor compiles). A corrupt entry of
    either: that program is compiled again (and one line here says so)."""
    path = os.path.expanduser(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        warn(f"warning: compile cache {path}: {e.strerror or e}; compiling without it (set "
             "EAGLE3KIT_COMPILE_CACHE to a writable directory)")
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    say = _cache_errors_once(path, warn)
    executables.use(os.path.join(path, EXECUTABLES), say)
    return path


EXECUTABLES = "executables"  # the compile cache's folder of whole programs
_CACHE_ERRORS = ("Error reading persistent compilation cache entry",
                 "Error writing persistent compilation cache entry")


def _cache_errors_once(path: str, warn: Callable[[str], None]) -> Callable[[str, str], None]:
    """JAX warns once per program whose cache entry it cannot read (corrupt) or write (a full
    disk), each a Python warning of two lines, and decode/executables reports its own: one
    line of ours for all of them. Other warnings pass to the hook that was there. Returns
    the reporter of executables (kind "read" or "write", detail)."""
    shown = warnings.showwarning
    shown = getattr(shown, "passes_to", shown)  # set up once per process, not stacked
    said: list[str] = []

    def say(kind: str, detail: str) -> None:
        if not said:
            said.append(detail)
            warn(f"warning: compile cache {path}: an entry could not be read ({detail}); "
                 "compiling such programs again" if kind == "read" else
                 f"warning: compile cache {path}: an entry could not be written ({detail}); "
                 "the run goes on without keeping such programs")

    def show(message, category, filename, lineno, file=None, line=None):
        text = first_line(message)
        if not text.startswith(_CACHE_ERRORS):
            return shown(message, category, filename, lineno, file, line)
        say("read" if text.startswith(_CACHE_ERRORS[0]) else "write", text.split(": ", 1)[-1])

    show.passes_to = shown  # type: ignore[attr-defined]
    warnings.showwarning = show
    return say


@contextlib.contextmanager
def out_of_memory(shape: str, advice: str) -> Iterator[None]:
    """Turns XLA's out-of-memory inside the block (a runtime error saying RESOURCE_EXHAUSTED,
    raised by an allocation or a program's temporaries), and the generation engine's
    pre-flight refusal (`decode.engine.OutOfMemory`), into a `ResourceError` (exit 4) that
    names the options of `shape` and what to lower."""
    from eagle3kit.decode.engine import OutOfMemory

    try:
        yield
    except OutOfMemory as e:
        raise ResourceError(f"out of device memory for {shape}: {e}; {advice}") from None
    except Exception as e:
        if device_out_of_memory(e):
            raise ResourceError(f"out of device memory for {shape}: {advice}") from None
        raise


def check_seq_len(seq_len: int, tcfg: TargetConfig, target: str) -> None:
    """A --seq-len row longer than the target's positions is refused, before any loading (a
    document that long would run past the positions the target was trained for)."""
    if seq_len > tcfg.max_position_embeddings:
        raise UserError(f"--seq-len {seq_len} exceeds the target's "
                        f"{tcfg.max_position_embeddings} positions ({target})")


def file_digest(path: str | os.PathLike) -> str:
    """16 hex digits of sha256 over a file's bytes ("-" for stdin, which has none)."""
    if str(path) == "-":
        return "-"
    return file_sha256(path)[:16]


def target_tokenizer(target: str, required: bool) -> tuple[Any, str | None]:
    """The target's tokenizer and its fingerprint key; (None, None) when the checkpoint has
    no tokenizer files and one is not `required` (the vocab size checks still apply)."""
    from eagle3kit.data.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(target)
    except UserError:
        if required:
            raise
        return None, None
    return tok, tokenizer_fingerprint(tok, target).key


def agree_max(n: int) -> int:
    """The largest `n` over all processes (every process must run the same step count)."""
    if jax.process_count() == 1:
        return n
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray([n], np.int64))))


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@dataclasses.dataclass
class VocabFile:
    vocab: VocabMap
    fingerprint: Fingerprint
    path: Path
    metadata: dict[str, str]


def load_vocab_file(path: str | os.PathLike) -> VocabFile:
    from eagle3kit.io.draft_io import read_vocab

    vocab, meta = read_vocab(path)
    if "tokenizer" not in meta:
        raise InputError("vocab file has no tokenizer fingerprint (not written by "
                         "`eagle3kit vocab-select`?)", path=path)
    return VocabFile(vocab, Fingerprint.from_json(meta["tokenizer"]), Path(path), meta)


def fit_vocab_to_target(vocab: VocabMap, target_vocab_size: int, where: object) -> VocabMap:
    """t2d must span the target's *config* vocab (e.g. Qwen3: 151936 > 151669 tokenizer ids);
    ids the tokenizer never produces are simply not draft tokens."""
    if vocab.target_size == target_vocab_size:
        return vocab
    if vocab.target_size > target_vocab_size:
        raise MismatchError(f"vocab covers {vocab.target_size} target ids but the target has "
                            f"only {target_vocab_size}", path=where)
    return VocabMap.from_ids(vocab.used_ids, target_vocab_size)


def read_docs(path: str | os.PathLike, tokenizer_key: str, seq_len: int) -> TokenDocs:
    """Token records of `path`, refusing another tokenizer's data.

    Every process of a multi-host run reads them all and packs the same epochs, so each
    step's global batch (of which a process places its own devices' rows, `put_batch`) is
    the one a single process would train on.
    """
    from eagle3kit.data.records import read_token_records

    def checked():
        for r in read_token_records(path):
            if r.tokenizer != tokenizer_key:
                require_same(tokenizer_key, r.tokenizer, f"record {r.id!r}", path,
                             "the vocab file's", "the data and --vocab must come from one "
                             "tokenizer: tokenize the data with the vocab's tokenizer, or "
                             "select the vocab from this data")
            yield r

    docs = TokenDocs.from_records(checked(), seq_len)
    if len(docs) == 0:
        raise InputError("no trainable records (every record lacks masked tokens?)", path=path)
    return docs


def teacher_forced(trainer, params, target_w, vocab: VocabArrays, docs: TokenDocs,
                   rows: int, seq_len: int, progress: Any = None) -> dict[str, Any]:
    """Acceptance of `params` on `docs` (packed rows, no gradient): acc_k, cond_acc_k, tau.

    The same rollout and counting code as training (core.ttt, core.metrics).
    """
    from eagle3kit.core.trainer import put_batch

    packed = pack_epoch(docs, seq_len, seed=0, epoch=0)
    batches = -(-len(packed.rows) // rows)
    total = StepCounts.zeros(trainer.ttt.steps)
    for i in range(batches):
        batch = put_batch(trainer, packed.batch(i * rows, rows), eval_batch=True)
        total = total + trainer.eval_step(params, target_w, vocab, batch)
        if progress is not None:
            progress(i + 1, batches)
    return summarize(total)


def load_draft_for_target(spec: str, target_spec: str, ckpt: TargetCheckpoint,
                          tokenizer_key: str | None) -> Draft:
    """A draft in any format, refused unless it was made for this target: the engines' own
    shape checks against the actual target config, the recorded target's architecture, and
    the tokenizer fingerprint (ids from another tokenizer are another vocabulary)."""
    from eagle3kit.formats import load_any_draft
    from eagle3kit.formats.common import check_exportable

    try:
        try:
            draft = load_any_draft(spec)
        except (MismatchError, InputError):
            # an engine export that does not record its target, or names one that cannot be
            # fetched (offline): read it with ours
            draft = load_any_draft(spec, target=target_spec)
        recorded = draft.target_config
        check_exportable(dataclasses.replace(draft, target_config=ckpt.hf_config), 0)
    except MismatchError as e:
        raise MismatchError(f"the draft does not fit the target {target_spec}: {e}",
                            path=spec) from None
    if recorded:
        was = TargetConfig.from_hf_config(recorded, source=spec)
        for field in ("family", "num_layers", "hidden_size", "intermediate_size", "num_heads",
                      "num_kv_heads", "vocab_size"):
            if getattr(was, field) != getattr(ckpt.config, field):
                raise MismatchError(
                    f"the draft was trained for {draft.target_name or 'another target'} "
                    f"({field} {getattr(was, field)}), but {target_spec} has "
                    f"{getattr(ckpt.config, field)}", path=spec)
    recorded_tok = draft.fingerprints.get("tokenizer")
    if recorded_tok and tokenizer_key:
        require_same(tokenizer_key, Fingerprint.from_json(recorded_tok).key,
                     "the draft", spec, f"the tokenizer of {target_spec}",
                     "a draft serves only the target (tokenizer) it was trained for")
    return draft
