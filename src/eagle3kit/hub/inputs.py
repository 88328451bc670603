"""What a model card is rendered from: the export's facts (`CardInputs`) and the eval results
(`EvalResult`). Its own module so that `card` (which reads them) and `sections` (which renders
them) both import it and not each other."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.formats.registry import Serving


class EvalResult(msgspec.Struct, forbid_unknown_fields=False):
    """What `eagle3kit eval --json` prints; every field optional so older files still render."""

    mode: str = "teacher-forced"  # or "generate"
    dataset: str = ""
    acc: list[float] = []
    cond_acc: list[float] = []
    accept_rate: list[float] = []  # generate: share of verify steps accepting token k
    tau: float | None = None
    tau_generate: float | None = None  # = tau_pooled (the older name)
    tau_pooled: float | None = None
    tau_per_request_mean: float | None = None
    speedup: float | None = None
    tokens_per_s_speculative: float | None = None
    tokens_per_s_baseline: float | None = None
    device: str | None = None
    steps: int | None = None
    topk: int | None = None  # generate: tree drafting (1 or absent: a chain)
    draft_tokens: int | None = None
    temperature: float | None = None
    masked_tokens: int | None = None
    prompts: int | None = None
    max_new_tokens: int | None = None
    # generate --concurrency / --sweep (jobs/eval_batched.py): one entry per batch size
    # (and drafting shape), the fastest shape per batch size, the fastest chain per size
    concurrency: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    best_chain: dict[str, dict[str, Any]] = {}
    # provenance: the draft measured, as given to eval, and its digest (formats.common)
    draft: str | None = None
    draft_digest: str | None = None
    origin: str = ""  # the file it was read from (set by load_evals)


@dataclasses.dataclass
class CardInputs:
    """Everything the card shows, read from an export directory."""

    repo_id: str
    engine_format: str  # a registered format's name: "sglang", "speculators", ...
    target_name: str
    target: TargetConfig
    draft: DraftConfig
    training: dict[str, Any]
    dtype: str
    speculative_tokens: int
    files: list[tuple[str, int]]
    serving: Serving  # what the format says engines load (formats/registry.py)
    evals: list[EvalResult] = dataclasses.field(default_factory=list)
    license: str | None = None
    source: str = ""
    serve_dtype: str = "bfloat16"  # the target's own dtype, for the engines' --dtype
    recipe: str | None = None  # what made the draft, as `push --recipe` names it
