"""The model card: rendered from the export directory alone, showing only what was recorded."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from eagle3kit.errors import InputError
from eagle3kit.formats import export_draft
from eagle3kit.hub import card
from tests.formats.helpers import make_draft, tiny_target

# what `eagle3kit train` records (jobs/train.py), for an 8-GPU run
TRAINING = {
    "attention": "auto", "aux_layer_ids": None, "b1": 0.9, "b2": 0.95, "batch_size": 4,
    "clip_norm": 0.5, "data": "/data/mixed-54k.jsonl", "data_records": 54000,
    "data_tokens": 61234567, "decay": 0.8, "device_kind": "NVIDIA H100", "devices": 8,
    "dtype": "bfloat16", "epochs": 3, "eval_data": None, "eval_every": 500, "grad_accum": 2,
    "init_from": None, "keep_checkpoints": 2, "log_every": 10, "lr": 0.0003, "max_steps": None,
    "mesh": "data=8,tensor=1", "min_lr_ratio": 0.0, "out": "/scratch/runs/llama",
    "resume": False, "save_every": 500, "seed": 0, "seq_len": 2048, "steps": 14949,
    "target": "/models/llama", "target_dtype": "bfloat16", "ttt_length": 7,
    "vocab": "/data/vocab.safetensors", "wall_time_s": 9000, "warmup_ratio": 0.03,
    "weight_decay": 0.0}
TEACHER = {"mode": "teacher-forced", "dataset": "mt-bench", "acc": [0.605, 0.582, 0.572, 0.55],
           "cond_acc": [0.605, 0.7, 0.72, 0.74], "tau": 2.41}
GENERATE = {"mode": "generate", "dataset": "humaneval", "acc": [0.7, 0.65],
            "accept_rate": [0.72, 0.6], "prompts": 164, "masked_tokens": 9000,
            "tau": 2.2, "tau_generate": 2.64, "tau_pooled": 2.64,
            "tau_per_request_mean": 2.51, "speedup": 2.31, "tokens_per_s_speculative": 91.5,
            "tokens_per_s_baseline": 39.6, "device": "NVIDIA H100", "steps": 3,
            "temperature": 0.0}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def sglang_export(target, tmp_path_factory):
    d = make_draft(target, training=TRAINING)
    return export_draft(d, "sglang", tmp_path_factory.mktemp("e") / "sglang")


def _evals(tmp_path):
    (tmp_path / "tf.json").write_text(json.dumps(TEACHER))
    (tmp_path / "gen.json").write_text(json.dumps(GENERATE))
    return [tmp_path / "tf.json", tmp_path / "gen.json"]


def test_front_matter_and_usage(sglang_export, tmp_path):
    text = card.render_card(sglang_export, "my-org/tiny-Eagle3", evals=_evals(tmp_path))
    meta = ModelCard(text).data.to_dict()
    assert meta["base_model"] == "org/tiny-llama" and meta["library_name"] == "sglang"
    assert "license" not in meta  # unknown for org/tiny-llama: never invented
    assert {"eagle3", "speculative-decoding", "sglang"} <= set(meta["tags"])
    assert card.is_generated(text)
    for flag in ("--model-path org/tiny-llama", "--speculative-algorithm EAGLE3",
                 "--speculative-draft-model-path my-org/tiny-Eagle3",
                 "--speculative-num-steps 3", "--speculative-eagle-topk 1",
                 "--speculative-num-draft-tokens 4", "--dtype bfloat16"):
        assert flag in text, flag
    # default layers: vLLM loads the midlayer export as well
    assert ('vllm serve org/tiny-llama \\\n    --speculative-config \'{"method": "eagle3", '
            '"model": "my-org/tiny-Eagle3", "num_speculative_tokens": 3}\'') in text
    assert "could not be determined" in text and "--license" in text


def test_training_table_renders_what_was_recorded(sglang_export):
    text = card.render_card(sglang_export, "my-org/x")
    for row in ("| Hardware | 8 x NVIDIA H100 (mesh data=8,tensor=1) |",
                "| Training data | mixed-54k.jsonl, 54,000 records, 61,234,567 tokens |",
                "| Epochs | 3 |", "| Optimizer steps | 14,949 (4,983 per epoch) |",
                "| Optimizer | AdamW (betas 0.9, 0.95), weight decay 0, gradient clip 0.5 |",
                "| Learning rate | 0.0003 peak, 3.0% warmup, final 0 x peak |",
                "| Batch | B=4, sequence length T=2048, gradient accumulation 2 |",
                "| TTT length | 7 steps (training-time test, loss weight 0.8^k) |",
                "| Precision | draft bfloat16 (fp32 master weights), target bfloat16 |",
                "| Training time | 2.5 h |", "| seed | 0 |"):
        assert row in text, row
    # the run's bookkeeping and local paths are not the reader's business
    for word in ("/scratch", "/models", "save_every", "log_every", "None", "null"):
        assert word not in text, word
    assert "No acceptance measurements were supplied" in text


@pytest.mark.parametrize("loss,weights,row", [
    ("kl", "geometric", "| Loss | forward KL (soft cross-entropy) against the target's "
     "distribution; step k weighs 0.8^k |"),
    ("lk-hybrid", "verify", "| Loss | LK hybrid (lambda KL + (1 - lambda) TV, lambda = "
     "exp(-3 alpha)) against the target's distribution; verification-aware step weights: full "
     "weight up to the draft's first miss, x0.8 per step after, each position's total as "
     "0.8^k |"),
])
def test_training_table_names_the_loss_and_step_weights(target, tmp_path, loss, weights, row):
    d = make_draft(target, training={**TRAINING, "loss": loss, "position_weights": weights})
    text = card.render_card(export_draft(d, "sglang", tmp_path / "e"), "my-org/x")
    assert row in text
    assert "| TTT length | 7 steps (training-time test) |" in text
    assert "position_weights" not in text and "| loss |" not in text


def test_absent_training_keys_are_skipped(target, tmp_path):
    d = make_draft(target, training={"epochs": 1})
    text = card.render_card(export_draft(d, "speculators", tmp_path / "v"), "my-org/x")
    assert "| Epochs | 1 |" in text
    for label in ("Hardware", "Training data", "Learning rate", "Batch", "Training time"):
        assert f"| {label} |" not in text, label
    meta = ModelCard(text).data.to_dict()
    assert meta["library_name"] == "vllm" and "speculators" in meta["tags"]
    assert "The short form `vllm serve my-org/x` also works" in text
    assert "sglang.launch_server" not in text


def test_python_usage_and_qwen3_thinking_mode(target, sglang_export, tmp_path):
    text = card.render_card(sglang_export, "my-org/x")
    assert 'speculative_draft_model_path="my-org/x",\n    speculative_num_steps=3,' in text
    assert ('speculative_config={"method": "eagle3", "model": "my-org/x", '
            '"num_speculative_tokens": 3},') in text
    assert "Thinking mode" not in text and "thinking" not in text.lower()
    # a Qwen3 target: how to serve in the draft's mode, and the caveat
    qwen3 = tiny_target(tmp_path / "qwen3", "qwen3")
    d = make_draft(qwen3, name="Qwen/Qwen3-8B", training={**TRAINING, "max_steps": 4000,
                                                          "steps": 4000})
    text = card.render_card(export_draft(d, "speculators", tmp_path / "q"), "my-org/q")
    assert "### Thinking mode" in text and '"enable_thinking": false' in text
    assert "Acceptance differs between Qwen3's thinking and non-thinking modes" in text
    assert "sgl.Engine" not in text and "from vllm import LLM" in text
    # cut short by --max-steps: the epochs were not all run, so no steps per epoch
    assert "| Optimizer steps | 4,000 |" in text


def test_acceptance_tables(sglang_export, tmp_path):
    text = card.render_card(sglang_export, "my-org/x", evals=_evals(tmp_path))
    assert "| mt-bench (teacher-forced) | 2.41 | 60.5% | 58.2% | 57.2% | - |" in text
    assert "| humaneval, chain K=3 | 2.64 | 70.0% | 65.0% | - | 2.31x |" in text
    assert "### humaneval, chain K=3\n" in text
    assert "- tau (generation, pooled over verify steps): 2.64" in text
    assert "- tau (generation, mean per request): 2.51" in text
    assert "Draft tree" not in text  # chains say nothing of trees
    assert "| 4 | 55.0% | 74.0% |" in text  # every step of the per-eval table
    assert "| 2 | 65.0% | - | 60.0% |" in text  # generation: accepted share per token
    assert "- Tokens/s with the draft: 91.5" in text and "- Temperature: 0" in text
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps(GENERATE | {"steps": 5, "topk": 4, "draft_tokens": 8}))
    tree_text = card.render_card(sglang_export, "my-org/x", evals=[tree])
    assert "- Draft steps: 5\n- Draft tree (top-k, tokens verified): top-4, 8\n" in tree_text


def test_custom_layers_in_sglang_format_point_vllm_users_elsewhere(target, tmp_path):
    d = make_draft(target, aux_layer_ids=(1, 3, 4))
    text = card.render_card(export_draft(d, "sglang", tmp_path / "s"), "my-org/x")
    assert "vllm serve" not in text and "--to speculators" in text
    assert "hidden_states [1, 3, 4] (inputs of layers [1, 3, 4]; SGLang ids [0, 2, 3])" in text


@pytest.mark.parametrize("name,license_id", [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama3.1"), ("Qwen/Qwen3-8B", "apache-2.0"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"), ("someone/private-model", None)])
def test_license_of_known_targets(name, license_id):
    assert card.target_license(name) == license_id


def test_license_from_a_local_target_readme(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# a model\n")
    assert card.target_license(str(tmp_path)) == "mit"


def test_eval_files(tmp_path):
    (tmp_path / "two.jsonl").write_text(json.dumps(TEACHER) + "\n\n" + json.dumps(GENERATE))
    assert [e.mode for e in card.load_evals(tmp_path / "two.jsonl")] == ["teacher-forced",
                                                                        "generate"]
    (tmp_path / "bad.jsonl").write_text(json.dumps(TEACHER) + '\n{"mode": "generate", '
                                        '"acc": ["high"], "tau": 1}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: not an eval result.*acc\[0\]"):
        card.load_evals(tmp_path / "bad.jsonl")
    with pytest.raises(InputError, match="no such file"):
        card.load_evals(tmp_path / "missing.json")


def test_refuses_directories_that_are_not_exports(target, tmp_path):
    from eagle3kit.io.draft_io import save_draft

    save_draft(tmp_path / "final", make_draft(target))
    with pytest.raises(InputError, match="convert it first: eagle3kit convert"):
        card.render_card(tmp_path / "final", "my-org/x")


@pytest.mark.parametrize("arch, title, method", [
    ("eagle3", "# EAGLE3 draft head for tiny-llama", "trained with the EAGLE3 method"),
    ("eagle3.1", "# EAGLE-3.1 draft head for tiny-llama", "trained with the EAGLE-3.1 method"),
])
def test_the_title_names_the_drafts_method(target, tmp_path, arch, title, method):
    """The main job's v2 draft is EAGLE-3.1 (exported for vLLM): its card says so up front."""
    d = make_draft(target, training=TRAINING, arch=arch)
    text = card.render_card(export_draft(d, "speculators", tmp_path / "v"), "my-org/x")
    assert title + "\n" in text and method in text


def _sweep(speedup: float, steps: int) -> dict:
    best = {"shape": str(steps), "steps": steps, "topk": 1, "draft_tokens": steps + 1,
            "speedup": speedup, "batch": 1}
    return {**GENERATE, "sweep": [], "best": {"1": best}, "best_chain": {"1": best}}


def test_a_sweep_that_found_no_speedup_recommends_nothing(target, tmp_path):
    """The sweep's fastest shape ran at 0.70x: the card says no shape beat plain decoding
    and serves the export's own chain, the count its config carries (issue 39, item 8)."""
    export = export_draft(make_draft(target, training=TRAINING), "speculators",
                          tmp_path / "vllm", speculative_tokens=3)
    (tmp_path / "slow.json").write_text(json.dumps(_sweep(0.7, 2)))
    text = card.render_card(export, "my-org/x", evals=[tmp_path / "slow.json"])
    assert "found no drafting shape faster than plain decoding at batch 1 (the best, 2, ran " \
           "at 0.70x)" in text
    assert "These settings were measured" not in text
    assert '"num_speculative_tokens": 3' in text and '"num_speculative_tokens": 2' not in text
    assert "config names the verifier and 3 speculative tokens." in text
    # a chain that wins, of another length than the config's: the short form says so
    (tmp_path / "fast.json").write_text(json.dumps(_sweep(1.3, 5)))
    text = card.render_card(export, "my-org/x", evals=[tmp_path / "fast.json"])
    assert '"num_speculative_tokens": 5' in text and "1.30x for 5" in text
    assert "3 speculative tokens (not the 5 above: pass those with --speculative-config)" in text


def test_a_run_cut_short_and_a_filled_vocab_are_said(target, tmp_path):
    """--max-steps stopped the run at step 4 of 39: not "Epochs | 3"; 15 of the 40 draft ids
    are placeholders vocab-select filled in: not "the 40 most frequent training tokens"
    (issue 39, item 9)."""
    training = {**TRAINING, "max_steps": 4, "steps": 4, "planned_steps": 39,
                "vocab_filled": 15}
    export = export_draft(make_draft(target, training=training), "sglang", tmp_path / "e")
    text = card.render_card(export, "my-org/x")
    assert "| Epochs | 0.31 of the 3 planned (stopped by --max-steps at step 4 of 39) |" in text
    assert "| Optimizer steps | 4 |" in text
    assert "the 25 tokens of the training data and 15 placeholder ids" in text
    assert ("proposes only the 25 distinct tokens of its training data" in text
            and "the other 15 of its 40 draft ids are placeholders" in text)
    assert "most frequent training tokens" not in text
    # an older record (no planned steps): what stopped it, not a number of epochs
    older = {k: v for k, v in training.items() if k not in ("planned_steps", "vocab_filled")}
    export = export_draft(make_draft(target, training=older), "sglang", tmp_path / "old")
    text = card.render_card(export, "my-org/x")
    assert "| Epochs | 3 planned; stopped by --max-steps at step 4 |" in text
