"""The family registry as docs/architecture.md's "How to add a target family" describes it:
the doc's toy family, registered here and nowhere in src, is a tiny random Llama saved under
the toy's names, and `eagle3kit regenerate` answers with it exactly as with the Llama; the
built-in families register the way the doc says."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import msgspec
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from eagle3kit.cli.app import app
from eagle3kit.core import families
from eagle3kit.data.records import RegeneratedRecord, encode
from eagle3kit.io.hf import resolve_target
from tests import assets, doc_examples

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### How to add a target family"
# a registry line as the doc shows it and core/families/__init__.py holds them
LINE = re.compile(r'^\s*register\("(\w+)", "eagle3kit\.core\.families\.(\w+)"\)$', re.M)
# fp32, greedy, one device: the same weights give the same answers
COMMON = ["--max-new-tokens", "12", "--max-context", "256", "--slots", "4",
          "--target-dtype", "float32", "--mesh", "data=1,tensor=1"]


def doc_section() -> str:
    return doc_examples.doc_section(SECTION)


def doc_toy() -> types.ModuleType:
    """The doc's example module, executed as written."""
    return doc_examples.doc_module(SECTION, "toy_family_from_docs")


@pytest.fixture
def toy():
    (name, _), = LINE.findall(doc_section())
    families.register(name, doc_toy())
    yield name
    families.unregister(name)


@pytest.fixture(scope="module")
def llama_and_toy(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny Llama target, and the same model under the toy's names: model_type "toy",
    `attn_norm` for `input_layernorm`, `norm_eps` for `rms_norm_eps`."""
    llama = assets.train_assets() / "target"
    toy = tmp_path_factory.mktemp("families") / "toy"
    shutil.copytree(llama, toy)
    config = json.loads((toy / "config.json").read_text())
    config.update(model_type="toy", architectures=["ToyForCausalLM"],
                  norm_eps=config.pop("rms_norm_eps"))
    (toy / "config.json").write_text(json.dumps(config))
    tensors = load_file(toy / "model.safetensors")
    save_file({k.replace(".input_layernorm.", ".attn_norm."): v for k, v in tensors.items()},
              toy / "model.safetensors", metadata={"format": "pt"})
    return llama, toy


def regenerate(target: Path, chats: bytes):
    return CliRunner().invoke(app, ["regenerate", "--target", str(target), *COMMON],
                              input=chats, env={"COLUMNS": "250"})


def answers(stdout: bytes) -> list[tuple[str, list]]:
    out = [msgspec.json.decode(line, type=RegeneratedRecord) for line in stdout.splitlines()]
    return [(r.id, [(m.role, m.content) for m in r.messages]) for r in out]


def test_toy_family_through_regenerate(toy, llama_and_toy):
    llama, toy_dir = llama_and_toy
    ours, theirs = resolve_target(toy_dir).config, resolve_target(llama).config
    assert (ours.family, ours.model_type, ours.architectures) == (toy, "toy", ("ToyForCausalLM",))
    # the toy's `fields` read its epsilon; everything else is the Llama's
    assert ours.rms_norm_eps == theirs.rms_norm_eps != 1e-6
    chats = b"".join(encode(c) for c in assets.sharegpt_chats(2))
    r_toy = regenerate(toy_dir, chats)
    assert r_toy.exit_code == 0, r_toy.output
    r_llama = regenerate(llama, chats)
    assert r_llama.exit_code == 0, r_llama.output
    assert answers(r_toy.stdout_bytes) == answers(r_llama.stdout_bytes)
    assert len(answers(r_toy.stdout_bytes)) == 2


def test_an_unregistered_family_is_refused_in_one_line(llama_and_toy):
    _, toy_dir = llama_and_toy
    r = regenerate(toy_dir, b"".join(encode(c) for c in assets.sharegpt_chats(1)))
    assert r.exit_code == 2, r.output
    assert "unsupported architecture model_type='toy'" in r.output
    assert "llama (LlamaForCausalLM)" in r.output


def test_builtin_families_register_as_the_doc_says():
    init = ROOT / "src" / "eagle3kit" / "core" / "families" / "__init__.py"
    lines = LINE.findall(init.read_text())
    assert [name for name, _ in lines] == list(families.names())
    for name, module in lines:
        assert (init.parent / f"{module}.py").is_file(), module
        assert families.get(name).model_types, name
    every = [t for f in families.families() for t in f.model_types]
    assert len(every) == len(set(every)), "a model_type read by two families"
