"""The `eval` job: how many tokens a draft gets accepted, measured two ways.

teacher-forced   the trainer's own rollout and counting (jobs/common.teacher_forced) on token
                 records: acc_k, cond_acc_k and the estimated tau.
generate         real speculative decoding of a prompt set by the engine (decode/engine.py)
                 with one row, turn after turn in each conversation's own context
                 (decode/conversations.drive, `regenerate`'s loop), against plain decoding
                 of the same target by the same engine: tau (tokens per target forward),
                 per-position acceptance, tokens/s of both and the speedup (timed one
                 answer at a time after a pass that compiles, jobs/eval_batched.py). The
                 generated answers are then scored teacher-forced too, so the estimate and
                 the real tau are reported on the very same text.

Both print one JSON object (the contract `push` renders into the model card, docs/eval.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from eagle3kit.core import arches, target, ttt
from eagle3kit.core import draft as draft_lib
from eagle3kit.core.optim import OptimConfig
from eagle3kit.core.sharding import batch_ways, make_mesh, parse_mesh_spec
from eagle3kit.core.train_attention import check_attention, resolve_attention
from eagle3kit.core.trainer import Trainer
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.data.chat import Renderer
from eagle3kit.data.fingerprint import Fingerprint
from eagle3kit.data.packing import TokenDocs
from eagle3kit.data.prompts import PromptSet, load_prompts
from eagle3kit.data.records import GenerationSample, TokenRecord, display_name, encode
from eagle3kit.data.tokenizer import load_chat_template
from eagle3kit.data.tokenizing import make_renderer
from eagle3kit.decode import parallel_draft
from eagle3kit.decode.acceptance import acceptance_summary
from eagle3kit.decode.conversations import Dialogue, Turn
from eagle3kit.decode.engine import Request
from eagle3kit.decode.speculative import DecodeConfig, Speculation
from eagle3kit.errors import InputError, UserError
from eagle3kit.formats.common import draft_digest
from eagle3kit.io.atomic import open_output
from eagle3kit.io.hf import TargetCheckpoint, load_target, resolve_target
from eagle3kit.jobs import common, eval_batched
from eagle3kit.jobs.config import TTTSettings
from eagle3kit.jobs.progress import Progress

MODES = ("teacher-forced", "generate")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    target: str
    draft: str
    data: str | None = None  # token records (teacher-forced)
    prompts: str | None = None  # prompt set name or JSONL file (generate)
    mode: str | None = None  # default: generate with --prompts, else teacher-forced
    steps: int | None = None  # K; default: the draft's trained --ttt-length (trained_steps)
    topk: int = 1  # generate: children per tree node (1: chain)
    draft_tokens: int | None = None  # generate: tree nodes verified, root included
    max_new_tokens: int = 256
    temperature: float = 0.0
    limit: int | None = None  # first N conversations of the prompt set
    batch_size: int = 8  # teacher-forced rows per batch
    seq_len: int = 2048
    mesh: str | None = None
    dtype: str = "bfloat16"
    target_dtype: str = "bfloat16"
    attention: str = "auto"
    seed: int = 0
    samples: str | None = None
    thinking: bool | None = None  # Qwen3-style templates: the mode prompts are rendered in
    chat_template: str | None = None  # generate: a template file or known name (base models)
    concurrency: str | None = None  # generate: batch sizes, "1,8,32" (jobs/eval_batched.py)
    sweep: bool = False  # generate: try the drafting shapes of sweep_grid at those sizes
    sweep_grid: str | None = None  # "3;5;5/4/8" (default eval_batched.DEFAULT_SWEEP)

    @property
    def resolved_mode(self) -> str:
        return self.mode or ("generate" if self.prompts else "teacher-forced")


def check_config(cfg: EvalConfig) -> None:
    """Option combinations that cannot work, refused before anything is loaded."""
    mode = cfg.resolved_mode
    if mode not in MODES:
        raise UserError(f"--mode {mode!r}: choose {' or '.join(MODES)}")
    if mode == "teacher-forced":
        if not cfg.data:
            raise UserError("teacher-forced evaluation needs --data (token records from "
                            "`eagle3kit tokenize`); for generation pass --prompts")
        if cfg.prompts or cfg.samples or cfg.chat_template:
            raise UserError("--prompts, --samples and --chat-template belong to --mode "
                            "generate (token records are rendered already)")
        if cfg.topk != 1 or cfg.draft_tokens is not None:
            raise UserError("--topk and --draft-tokens shape the draft trees of --mode "
                            "generate; teacher-forced scoring rolls out chains of --steps")
    else:
        if not cfg.prompts:
            raise UserError("--mode generate needs --prompts (mt-bench, humaneval or a JSONL "
                            "file of conversations)")
        if cfg.data:
            raise UserError("--data is scored teacher-forced; run `eagle3kit eval` once per "
                            "mode (their --json lines can go to one file for `push`)")
    if cfg.chat_template:
        load_chat_template(cfg.chat_template)  # a missing file fails before any loading
    if (cfg.concurrency or cfg.sweep or cfg.sweep_grid) and mode != "generate":
        raise UserError("--concurrency and --sweep measure generation: pass --prompts")
    if cfg.sweep_grid and not cfg.sweep:
        raise UserError("--sweep-grid is the grid of --sweep: pass --sweep too")
    eval_batched.parse_concurrency(cfg.concurrency)
    if cfg.sweep:
        eval_batched.parse_sweep(cfg.sweep_grid, decode_config(cfg))
    for name, value in (("--dtype", cfg.dtype), ("--target-dtype", cfg.target_dtype)):
        if value not in common.DTYPES:
            raise UserError(f"{name} {value!r}: choose {' or '.join(common.DTYPES)}")
    check_attention(cfg.attention)
    if cfg.steps is not None and not 1 <= cfg.steps <= 64:
        raise UserError(f"--steps {cfg.steps}: must be in 1..64")
    if cfg.temperature < 0:
        raise UserError(f"--temperature {cfg.temperature}: must be >= 0 (0 is greedy)")
    if cfg.steps is not None:  # else K is the draft's: checked once the draft is read
        check_shape(cfg)


def check_shape(cfg: EvalConfig, steps_from: str = "") -> None:
    """The drafting tree of --steps, --topk and --draft-tokens, as SGLang would check it."""
    try:
        decode_config(cfg).check()
    except ValueError as e:
        raise UserError(f"--steps {cfg.steps}{steps_from} --topk {cfg.topk} --draft-tokens "
                        f"{decode_config(cfg).nodes}: {e}") from None


def check_block(cfg: EvalConfig, dcfg) -> EvalConfig:
    """A parallel drafter (decode/parallel_draft.py) verifies the tokens of its one pass: by
    default all of them, --steps N the first N; no trees, no sweep of chain shapes."""
    if cfg.sweep:
        raise UserError(f"--sweep tries chain and tree shapes; a {dcfg.arch} draft proposes "
                        f"one block (measure it with --concurrency)")
    cfg = dataclasses.replace(cfg, steps=cfg.steps or parallel_draft.proposals(dcfg))
    try:
        parallel_draft.check(dcfg, cfg.steps, cfg.topk)
    except ValueError as e:
        raise UserError(f"{cfg.draft}: --steps {cfg.steps} --topk {cfg.topk}: {e}") from None
    return cfg


def prompt_renderer(tokenizer: Any, cfg: EvalConfig) -> Renderer:
    """Renders prompts with --chat-template or the tokenizer's own, in the --thinking mode
    (refused on a template without a thinking switch)."""
    return make_renderer(tokenizer, cfg.chat_template, cfg.thinking, cfg.target)


def decode_config(cfg: EvalConfig) -> DecodeConfig:
    return DecodeConfig(cfg.steps or TTTSettings().steps, cfg.max_new_tokens, cfg.temperature,
                        cfg.topk, cfg.draft_tokens)


def trained_steps(draft) -> int:
    """The TTT length K the draft was trained with (recorded by `train` as ttt_length);
    drafts from elsewhere record none: the default K."""
    return int((draft.training or {}).get("ttt_length") or TTTSettings().steps)


def run(cfg: EvalConfig, console) -> dict[str, Any]:
    """Evaluates as configured; returns the result object (see the module docstring)."""
    check_config(cfg)
    common.compile_cache(console.print)  # a repeated eval loads its programs from disk
    generate = cfg.resolved_mode == "generate"
    tokenizer, key = common.target_tokenizer(cfg.target, required=generate)
    # the template and --thinking checked before any loading; built once, used throughout
    renderer = prompt_renderer(tokenizer, cfg) if generate else None
    ckpt = resolve_target(cfg.target)
    tcfg = ckpt.config
    draft = common.load_draft_for_target(cfg.draft, cfg.target, ckpt, key)
    if generate and not getattr(arches.method_module(draft.config.method), "ENGINE", True):
        raise UserError(f"{cfg.draft}: the generation engine does not run {draft.config.arch} "
                        "drafts yet; measure it teacher-forced with --data")
    if key is None:  # a target without tokenizer files: trust the draft's record
        if "tokenizer" not in draft.fingerprints:
            raise UserError(f"cannot tell which tokenizer made the data: {cfg.target} has no "
                            "tokenizer files and the draft records none")
        key = Fingerprint.from_json(draft.fingerprints["tokenizer"]).key
    if generate and parallel_draft.is_parallel(draft.config):
        cfg = check_block(cfg, draft.config)
    if cfg.steps is None:
        cfg = dataclasses.replace(cfg, steps=trained_steps(draft))
        check_shape(cfg, " (the draft's --ttt-length)")
    if not generate:
        common.check_seq_len(cfg.seq_len, tcfg, cfg.target)
    vocab = common.fit_vocab_to_target(draft.vocab, tcfg.vocab_size, cfg.draft)
    # read the inputs before the weights: a bad file fails in a second, not after loading 8B
    prompts = load_prompts(cfg.prompts, cfg.limit) if generate else None
    docs = None if generate else common.read_docs(cfg.data, key, cfg.seq_len)
    mesh = generation_mesh(cfg.mesh) if generate else make_mesh(cfg.mesh)
    rows = batch_ways(mesh) if generate else cfg.batch_size
    if rows % batch_ways(mesh):
        raise UserError(f"--batch-size {rows} must be a multiple of the data axis "
                        f"({batch_ways(mesh)})")
    dtype, target_dtype = common.DTYPES[cfg.dtype], common.DTYPES[cfg.target_dtype]
    t0 = time.perf_counter()
    # per-layer arrays, held once: teacher-forced scoring and every engine read these
    target_w = target.unstack_in_place(load_target(ckpt, mesh, target_dtype), tcfg)
    trainer = Trainer(tcfg, draft.config, ttt.TTTConfig(
        cfg.steps, TTTSettings().decay, dtype,
        resolve_attention(cfg.attention, jax.default_backend(), target_dtype, dtype)),
        OptimConfig(), mesh)
    params = jax.device_put(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), draft.weights),
                            trainer.param_shardings)
    vocab_dev = jax.device_put(VocabArrays.from_map(vocab), trainer.replicated)
    console.print(f"eval: draft {cfg.draft} on {tcfg.name} "
                  f"({jax.device_count()} x {_device()}; weights loaded in "
                  f"{time.perf_counter() - t0:.1f}s)")
    base = {"draft": cfg.draft, "draft_digest": draft_digest(draft), "target": tcfg.name,
            "steps": trainer.ttt.steps, "device": _device()}
    if not generate:
        progress = Progress(console, "teacher-forced batches")
        with progress, common.out_of_memory(
                f"--batch-size {cfg.batch_size} x --seq-len {cfg.seq_len} x --steps {cfg.steps}",
                "lower --batch-size or --seq-len"):
            tf = common.teacher_forced(trainer, params, target_w, vocab_dev, docs,
                                       cfg.batch_size, cfg.seq_len, progress.update)
        return {"mode": "teacher-forced", "dataset": display_name(cfg.data), **tf, **base}

    setup = eval_batched.Setup(
        tcfg, target_w, mesh, stop_ids(tokenizer, ckpt, renderer),
        Speculation(draft.config, draft_lib.cast(params, dtype), vocab_dev, decode_config(cfg)),
        cfg.seed)
    sizes = eval_batched.parse_concurrency(cfg.concurrency)  # the --concurrency batch sizes
    shape = f"--max-new-tokens {cfg.max_new_tokens}" + (
        f" at --concurrency {cfg.concurrency}" if cfg.concurrency else "")
    with common.out_of_memory(shape, "lower --max-new-tokens, the --concurrency batch sizes "
                              "or --limit (long prompts), or add devices: --mesh tensor=N"):
        if cfg.concurrency or cfg.sweep:
            eval_batched.check_sizes(setup, sizes or (1,), cfg.max_new_tokens)
        gen, samples = generate_samples(setup, prompts, tokenizer, cfg, console, renderer)
        if cfg.concurrency or cfg.sweep:
            # the very prompts batch 1 answered (later turns hold its answers), B at a time
            gen.update(eval_batched.measure(
                setup, [s.prompt_ids for s in samples],
                sizes or (1,),
                eval_batched.parse_sweep(cfg.sweep_grid, setup.draft.dec) if cfg.sweep
                else None, console))
        # the same text, teacher-forced: the estimate next to what generation measured
        docs = TokenDocs.from_records(
            (TokenRecord(s.id, s.prompt_ids + s.generated_ids,
                         [0] * len(s.prompt_ids) + [1] * len(s.generated_ids), key)
             for s in samples), 1 << 30)
        seq_len = -(-max(len(x) for x in docs.ids) // 128) * 128
        tf = common.teacher_forced(trainer, params, target_w, vocab_dev, docs, rows, seq_len)
    if cfg.samples:
        with open_output(cfg.samples, "wb") as f:
            for s in samples:
                f.write(encode(s))
    return {"mode": "generate", "dataset": prompts.name, **tf, **gen, **base,
            "topk": cfg.topk, "draft_tokens": setup.draft.dec.nodes,
            "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
            # how the engine ran (docs/benchmarks.md, issue 22): the caches' reads, and the
            # steps between a program's checks at batch 1 and at the --concurrency sizes
            "kv_attention": setup.attention().value,
            "check_every": {str(b): setup.checks(b) for b in (1, *sizes)}}


def generate_samples(setup: eval_batched.Setup, prompts: PromptSet, tokenizer: Any,
                     cfg: EvalConfig, console, renderer: Renderer | None = None,
                     timed: bool = True) -> tuple[dict[str, Any], list[GenerationSample]]:
    """Answers every turn speculatively with one row, each in the context of the earlier
    answers, then plainly (not with `timed` False: acceptance alone, e.g. on a CPU), each
    turn on the smallest cache its prompt fits, both ways the same. Each answer is timed
    alone; one during which JAX compiled is run again and timed again (the same request
    takes the same shapes), so compiling costs only the answers that met a new shape.
    Returns the summary and the samples. `renderer`: the prompts' (default:
    prompt_renderer's for `cfg`)."""
    tcfg, dec = setup.tcfg, setup.draft.dec
    context = tcfg.max_position_embeddings
    dialogues = [Dialogue.from_user_turns(c.turns, c.system) for c in prompts.conversations]
    render = (renderer or prompt_renderer(tokenizer, cfg)).prompt_ids  # the served mode
    firsts = [render(d.prompt()) for d in dialogues]
    for conv, ids in zip(prompts.conversations, firsts, strict=True):  # fail before compiling
        _check_context(conv.id, 1, len(ids), cfg.max_new_tokens, context, prompts.name,
                       dec.verified)
    # request j (the j-th turn of the set, in order) samples from stream j at every batch size
    offsets = [sum(len(c.turns) for c in prompts.conversations[:i])
               for i in range(len(prompts.conversations))]
    answers: dict[tuple[int, int], tuple[Request, Any, float]] = {}
    longest = [min(_longest_prompt(d, render, cfg.max_new_tokens), context - cfg.max_new_tokens)
               for d in dialogues]
    # one cache for every turn (not the smallest each prompt fits): a cache size is a shape
    # of every program, and each one compiled again per size a later turn's prompt met
    setup.slots = max(setup.slots, eval_batched.slots_for_length(max(longest),
                                                                 cfg.max_new_tokens, [dec]))
    t0, (compiling0, programs0) = time.perf_counter(), eval_batched.compile_totals()
    hits0 = eval_batched.cache_hits()
    engines: dict[tuple[int, bool], Any] = {  # (slots, speculative)
        (setup.slots, s): setup.engine(1, setup.slots, dec if s else None)
        for s in ((True, False) if timed else (True,))}
    # what the turns will compile, compiled at once: first turns' prompts are known, later
    # ones about as long as `longest` (one that is not compiles its own shape when it comes)
    eval_batched.compile_ahead([c for e in engines.values() for c in e.compilers(
        [len(ids) for ids in firsts] + longest)])
    retimed = 0
    progress = Progress(console, "generate turns", total=prompts.num_turns)

    def prompt(c: int) -> list[int] | None:
        turn = len(dialogues[c].turns)
        if dialogues[c].finished:
            return None
        ids = firsts[c] if turn == 0 else render(dialogues[c].prompt())
        _check_context(prompts.conversations[c].id, turn + 1, len(ids), cfg.max_new_tokens,
                       context, prompts.name, dec.verified)
        return ids

    def run(request: Request, speculative: bool) -> tuple[Any, float]:
        """One answer alone on the cache its prompt fits: (completion, seconds)."""
        nonlocal retimed
        # a prompt longer than foreseen grows the cache (each program compiles once more)
        slots = setup.slots = max(setup.slots, eval_batched.slots_for(
            [request.prompt], cfg.max_new_tokens, [dec]))
        if (slots, speculative) not in engines:
            engines[slots, speculative] = setup.engine(1, slots, dec if speculative else None)
        engine = engines[slots, speculative]
        (done,), seconds, compiled = eval_batched.timed_call(lambda: engine.generate([request]))
        if compiled and timed:
            retimed += 1
            _, seconds, _ = eval_batched.timed_call(lambda: engine.generate([request]))
        return done, seconds

    with progress:
        for c in range(len(dialogues)):  # a conversation at a time, turn by turn
            while (ids := prompt(c)) is not None:
                turn = len(dialogues[c].turns)
                request = Request(offsets[c] + turn, ids, cfg.max_new_tokens, offsets[c] + turn)
                done, seconds = run(request, True)
                answers[c, turn] = request, done, seconds
                text = tokenizer.decode(done.tokens, skip_special_tokens=True)
                dialogues[c].answer(Turn(text.strip(), len(ids), len(done.tokens),
                                         done.finish_reason))
                progress.update(len(answers), prompts.num_turns)
    order = sorted(answers)
    spec = [answers[k][1] for k in order]
    spec_seconds = [answers[k][2] if timed else 0.0 for k in order]
    plain, plain_seconds = [], [0.0] * len(order)  # not timed: acceptance alone
    if timed:
        runs = [run(answers[k][0], False) for k in order]
        plain, plain_seconds = [done for done, _ in runs], [seconds for _, seconds in runs]
        untimed_s = time.perf_counter() - t0 - sum(spec_seconds) - sum(plain_seconds)
        compiling, programs = eval_batched.compile_totals()
    samples = []
    for (c, t), s_, s_sec, p_sec in zip(order, spec, spec_seconds, plain_seconds,
                                         strict=True):
        r = answers[c, t][0]
        samples.append(GenerationSample(
            prompts.conversations[c].id, t + 1, r.prompt, s_.tokens,
            tokenizer.decode(s_.tokens, skip_special_tokens=True), s_.accept_lengths,
            round(s_sec, 6), round(p_sec, 6)))
    summary = acceptance_summary([s.accept_lengths for s in samples], cfg.steps)
    if not timed:
        return {**summary, "prompts": len(samples), "conversations": len(prompts.conversations),
                "new_tokens": sum(len(s.generated_ids) for s in samples)}, samples
    spec_tokens = sum(len(s.generated_ids) for s in samples)
    plain_tokens = sum(len(p.tokens) for p in plain)
    identical = sum(s.generated_ids == p.tokens for s, p in zip(samples, plain, strict=True))
    spec_tps, plain_tps = spec_tokens / sum(spec_seconds), plain_tokens / sum(plain_seconds)
    if cfg.temperature == 0 and identical < len(samples):
        # exact in fp32; in 16-bit a verify over K+1 tokens may round differently from a
        # one-token step, and a near-tie then flips
        console.print(f"warning: {len(samples) - identical} of {len(samples)} "
                      "greedy answers differ from plain decoding (numerics of "
                      f"--target-dtype {cfg.target_dtype}; use float32 to check losslessness)")
    jax_hits, exe_hits = (now - before for now, before in zip(eval_batched.cache_hits(), hits0,
                                                               strict=True))
    return {**summary, "speedup": round(spec_tps / plain_tps, 4),
            "tokens_per_s_speculative": round(spec_tps, 2),
            "tokens_per_s_baseline": round(plain_tps, 2), "prompts": len(samples),
            "conversations": len(prompts.conversations), "new_tokens": spec_tokens,
            "baseline_new_tokens": plain_tokens,
            # sampled answers differ by chance; only greedy ones must be identical
            "identical_to_baseline": identical if cfg.temperature == 0 else None,
            # JAX's tracing, lowering and compiling (or loading from the compile cache) of
            # the programs it met; untimed: that and the first runs of the answers that
            # compiled (each timed on a second run)
            "compile_s": round(compiling - compiling0, 2),
            "compiled_programs": programs - programs0,
            # of those, how many a cache served: JAX's (XLA's compile skipped) or the kept
            # executables (decode/executables.py: nothing traced, lowered or compiled)
            "programs_from_cache": jax_hits + exe_hits,
            "programs_from_executables": exe_hits,
            "untimed_s": round(untimed_s, 2),
            "retimed_answers": retimed}, samples


def _longest_prompt(dialogue: Dialogue, render, max_new: int) -> int:
    """About the longest prompt of a conversation's turns: its last turn's with every answer
    empty, and max_new tokens for each answer before it (re-tokenized text may differ a
    little; a longer prompt grows the cache when it comes)."""
    try:
        ids = render(dialogue.kept[: dialogue.answer_at[-1]])
    except InputError:  # a template that refuses empty answers: the first prompt's length
        ids = render(dialogue.prompt())
    return len(ids) + (len(dialogue.answer_at) - 1) * max_new


def _check_context(cid: str, turn: int, length: int, max_new: int, context: int,
                   where: str, verified: int = 0) -> None:
    """The prompt, the answer and the tokens one verify step writes past it (a chain's
    K + 1, a tree's nodes, a parallel draft's block) in the target's positions."""
    if length + max_new + verified > context:
        block = f" + one verify's {verified} draft tokens" if verified else ""
        raise InputError(f"conversation {cid!r} turn {turn}: {length} prompt tokens + "
                         f"--max-new-tokens {max_new}{block} exceed the target's context of "
                         f"{context} tokens; shorten the prompt, lower --max-new-tokens or the "
                         "draft's block (--steps)", path=where)


def stop_ids(tokenizer: Any, ckpt: TargetCheckpoint, renderer: Renderer | None = None
             ) -> list[int]:
    """Tokens that end an answer: the tokenizer's eos, every eos id of the target config
    (Llama-3 lists <|eot_id|> and <|eom_id|> there) and the token the chat template closes an
    assistant turn with (a base model's config knows only <eos>, not Gemma's <end_of_turn>)."""
    ids = set()
    closing = end_of_turn(renderer) if renderer is not None else None
    if closing is not None:
        ids.add(tokenizer.convert_tokens_to_ids(closing))
    for value in (tokenizer.eos_token_id, ckpt.hf_config.get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return sorted(ids)


def end_of_turn(renderer: Renderer) -> str | None:
    """The special token that closes an assistant turn in the renderer's template (the last
    one of the generated span: content, then the end-of-turn); None if a probe conversation
    does not render."""
    try:
        text, spans = renderer.spans([{"role": "user", "content": "Hi."},
                                      {"role": "assistant", "content": "Hello."}])
    except InputError:
        return None
    hits = list(renderer.special_re.finditer(text, *spans[0]))
    return hits[-1].group() if hits else None


def generation_mesh(spec: str | None):
    """Generation decodes one sequence: data=1, the target split over `tensor` devices
    (`--mesh tensor=N`; the one mesh parser, `sharding.parse_mesh_spec`)."""
    given = spec or ""
    full = ",".join(filter(None, ("" if "data" in given else "data=1", given,
                                  "" if "tensor" in given else "tensor=1")))
    try:
        data, tensor = parse_mesh_spec(full, len(jax.devices()))
    except UserError as e:  # say it of the --mesh the user wrote
        raise type(e)(str(e).replace(repr(full), repr(given))) from None
    if data != 1:
        raise UserError("--mode generate decodes one sequence at a time: use --mesh tensor=N "
                        "(data must be 1)")
    return make_mesh(f"data=1,tensor={tensor}", jax.devices()[:tensor])


def _device() -> str:
    return jax.devices()[0].device_kind
