"""Tokenizer loading (directory, GGUF) and chat templates from files."""

from __future__ import annotations

import json

import pytest

from eagle3kit.data.fingerprint import tokenizer_fingerprint
from eagle3kit.data.tokenizer import load_chat_template, load_tokenizer, tokenizer_name
from eagle3kit.errors import InputError
from tests.data import chat_tokenizers

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.slow
def test_directory_and_gguf_give_the_same_fingerprint(smollm2_gguf):
    from_gguf = chat_tokenizers.smollm2()  # loaded from the GGUF
    from_dir = load_tokenizer(str(chat_tokenizers.saved("smollm2")))
    assert tokenizer_fingerprint(from_dir, "a") == tokenizer_fingerprint(from_gguf, "a")
    assert tokenizer_name(str(smollm2_gguf)) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert tokenizer_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"


@pytest.mark.slow
def test_gguf_tokenizer_is_transformers_own_without_torch(smollm2_gguf):
    """The GGUF tokenizer read by the `gguf` package and built by transformers' converter
    equals `AutoTokenizer.from_pretrained(dir, gguf_file=...)` (whose reader needs torch):
    vocabulary, special and added tokens, chat template, and the ids of 40 real ShareGPT
    conversations through the template; and loading it imports neither torch nor JAX (with
    JAX loaded, tokenize's workers are spawned, each building the tokenizer again, not forked)."""
    import subprocess
    import sys

    from tests import assets

    ours = load_tokenizer(str(smollm2_gguf))
    ref = assets.transformers_gguf_tokenizer(smollm2_gguf)
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref) == 49152
    assert ours.special_tokens_map == ref.special_tokens_map
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: str(t) for i, t in ref.added_tokens_decoder.items()}
    assert ours.chat_template == ref.chat_template and ours.chat_template
    # data tokenized before (through transformers' loader) still matches its target
    assert tokenizer_fingerprint(ours, "a") == tokenizer_fingerprint(ref, "a")
    for chat in assets.sharegpt_chats(40):
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        text = ref.apply_chat_template(messages, tokenize=False)
        assert ours.apply_chat_template(messages, tokenize=False) == text
        assert ours(text).input_ids == ref(text).input_ids
        assert ours.decode(ours(text).input_ids) == ref.decode(ref(text).input_ids)
    probe = ("import sys; from eagle3kit.data.tokenizer import load_tokenizer; "
             f"t = load_tokenizer({str(smollm2_gguf)!r}); "
             "print(len(t), 'torch' in sys.modules, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["49152", "False", "False"], out


@pytest.mark.slow
def test_a_gguf_file_read_twice_gives_two_tokenizers(smollm2_gguf):
    """The converted vocabulary is kept per process (commands run one after another in one
    process read the same file again), but each caller owns its tokenizer."""
    first = load_tokenizer(str(smollm2_gguf))
    first.add_tokens(["<not-in-the-file>"])
    second = load_tokenizer(str(smollm2_gguf))
    assert len(second) == len(first) - 1 == 49152
    assert second.encode("<not-in-the-file>") != first.encode("<not-in-the-file>")


@pytest.mark.slow
def test_each_caller_owns_all_of_its_gguf_tokenizer(smollm2_gguf):
    """Each load is the tokenizer as transformers builds it from the converted file (its
    backend's whole serialisation: model, added tokens, normalizer, pre-tokenizer,
    post-processor, decoder, truncation, padding), in milliseconds after the first; what a
    caller sets on its copy, in place or not, reaches no later caller."""
    from tokenizers import Regex, normalizers

    from eagle3kit.data.tokenizer import _gguf_build

    cls, backend, kwargs = _gguf_build(str(smollm2_gguf.resolve()))
    built = cls(tokenizer_object=backend, **kwargs)
    first = load_tokenizer(str(smollm2_gguf))
    assert first.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    assert first.chat_template == built.chat_template and first.chat_template
    b = first.backend_tokenizer
    b.enable_truncation(8)
    b.enable_padding(length=16)
    b.pre_tokenizer.add_prefix_space = not b.pre_tokenizer.add_prefix_space
    b.normalizer = normalizers.Replace(Regex("a"), "b")
    b.post_processor = None
    first.add_tokens(["<not-in-the-file>"], special_tokens=True)
    first.add_special_tokens({"pad_token": "<pad-of-mine>", "extra_special_tokens": ["<x>"]})
    first.chat_template = TEMPLATE
    second = load_tokenizer(str(smollm2_gguf))
    assert second.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    assert second.chat_template == built.chat_template
    assert second.special_tokens_map == built.special_tokens_map != first.special_tokens_map
    text = "hello world <not-in-the-file>" * 3
    assert second(text).input_ids == built(text).input_ids != first(text).input_ids


def test_missing_local_paths_are_named(tmp_path):
    with pytest.raises(InputError, match="nope.gguf: no such file or directory"):
        load_tokenizer(str(tmp_path / "nope.gguf"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="not a tokenizer"):
        load_tokenizer(str(tmp_path / "notes.txt"))


def test_a_directory_without_a_tokenizer_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"empty: no tokenizer in this directory \(expected "
                       r"tokenizer.json or tokenizer_config.json\)"):
        load_tokenizer(str(tmp_path / "empty"))


def test_a_hub_id_offline_fails_at_once_in_one_line():
    with pytest.raises(InputError, match="org/no-such-model: no such directory, and the "
                       "tokenizer is not in the local Hub cache"):
        load_tokenizer("org/no-such-model")


def test_chat_template_files(tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (tmp_path / "multi.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]}))
    for name in ("t.jinja", "tokenizer_config.json", "multi.json"):
        assert load_chat_template(str(tmp_path / name)) == TEMPLATE


@pytest.mark.parametrize("name,text,match", [
    ("plain.txt", "hello", "not a Jinja chat template"),
    ("cfg.json", '{"eos_token": "x"}', "no \\(default\\) chat_template"),
    ("bad.json", "{", "not a JSON object"),
])
def test_bad_chat_template_files(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(InputError, match=f"{name}: {match}"):
        load_chat_template(str(tmp_path / name))
    with pytest.raises(InputError, match="missing.jinja: no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_torch_missing_under_a_gguf_reader_is_recognised():
    """transformers before 5.18 reads GGUF tokenizers only with torch: `load_tokenizer` names
    that cause when the import failure sits anywhere in the chain."""
    from eagle3kit.data.tokenizer import _needs_torch

    def fails(name):
        try:
            try:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            except ModuleNotFoundError as e:  # as transformers' lazy module re-raises it
                raise ModuleNotFoundError("Could not import module 'read_gguf_metadata'") from e
        except ModuleNotFoundError as e:
            return e

    assert _needs_torch(fails("torch"))
    assert not _needs_torch(fails("gguf")) and not _needs_torch(ValueError("bad file"))


@pytest.mark.slow
def test_known_gemma_template_renders_as_gemmas_own():
    """`--chat-template gemma` (for base Gemma models, whose tokenizer has none) renders real
    conversations exactly as Gemma-3's published template does, with and without the
    generation prompt, and refuses what it refuses; its {% generation %} block gives
    transformers' assistant-token mask, which equals ours."""
    from eagle3kit.data.chat import Renderer
    from eagle3kit.data.tokenizer import KNOWN_TEMPLATES
    from tests.data import chat_tokenizers
    from tests.data.test_chat import _conversations

    tok = chat_tokenizers.gemma3()  # Gemma's turn tokens, its published template
    ours = KNOWN_TEMPLATES["gemma"]
    assert load_chat_template("gemma") == ours
    renderer = Renderer(tok, chat_template=ours)
    rendered = 0
    for messages in _conversations():
        for prompt in (False, True):
            try:
                expected = tok.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=prompt)
            except Exception:  # roles that do not alternate: both refuse
                with pytest.raises(Exception, match="alternate"):
                    tok.apply_chat_template(messages, chat_template=ours, tokenize=False)
                break
            assert tok.apply_chat_template(messages, chat_template=ours, tokenize=False,
                                           add_generation_prompt=prompt) == expected
        else:
            ids, mask = renderer.render(messages)
            ref = tok.apply_chat_template(messages, chat_template=ours, tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)
            assert ref["input_ids"] == ids and ref["assistant_masks"] == mask
            rendered += 1
    assert rendered >= 10


@pytest.mark.slow
def test_gemma3_gguf_tokenizer_is_transformers_own_without_torch():
    """Gemma-3-270M's GGUF tokenizer (262,144 sentencepiece tokens, bos 2, eos 1, no chat
    template) read by the `gguf` package, built by transformers' converter in a process that
    never imports torch, equals `AutoTokenizer.from_pretrained(dir, gguf_file=...)`:
    vocabulary, special and added tokens, and the ids and decoding of 20 real ShareGPT
    conversations in Gemma's turn format. So does the build used under transformers before
    5.18, whose own is wrong for Gemma (merges by score: `world` as `w`, `or`, `ld`)."""
    import subprocess
    import sys

    from eagle3kit.data.tokenizer import KNOWN_TEMPLATES
    from tests import assets

    gguf = assets.gemma3_gguf()
    ref = assets.transformers_gguf_tokenizer(gguf)
    texts = []
    for chat in assets.sharegpt_chats(20):
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        try:
            texts.append(ref.apply_chat_template(messages, chat_template=KNOWN_TEMPLATES[
                "gemma"], tokenize=False))
        except Exception:  # roles that do not alternate
            continue
    probe = f"""
import json, sys
from eagle3kit.data.fingerprint import tokenizer_fingerprint
from eagle3kit.data.tokenizer import _gemma_tokenizer, load_tokenizer
from eagle3kit.io.gguf import open_reader
texts = json.loads(sys.stdin.read())
def probe(t):
    ids = [t(x).input_ids for x in texts]
    return {{"len": len(t),
        "fingerprint": tokenizer_fingerprint(t, "a").to_json(), "template": t.chat_template,
        "special": t.special_tokens_map, "ids": ids, "decoded": [t.decode(i) for i in ids],
        "bos_eos": [t.bos_token_id, t.eos_token_id],
        "added": {{i: str(a) for i, a in t.added_tokens_decoder.items()}}}}
path = {str(gguf)!r}
builds = [probe(load_tokenizer(path)), probe(_gemma_tokenizer(open_reader(path).fields))]
print(json.dumps({{"torch": "torch" in sys.modules, "builds": builds}}))
"""
    run = json.loads(subprocess.run([sys.executable, "-c", probe], input=json.dumps(texts),
                                    capture_output=True, text=True, check=True).stdout)
    assert run["torch"] is False
    for out in run["builds"]:
        _same_as(ref, out, texts)


def _same_as(ref, out, texts):
    assert out["len"] == len(ref) == 262144 and out["bos_eos"] == [2, 1]
    assert out["template"] is None and not ref.chat_template
    assert out["fingerprint"] == tokenizer_fingerprint(ref, "a").to_json()  # the vocabulary
    assert out["special"] == ref.special_tokens_map
    assert out["added"] == {str(i): str(a) for i, a in ref.added_tokens_decoder.items()}
    assert len(texts) >= 10
    for text, ids, decoded in zip(texts, out["ids"], out["decoded"], strict=True):
        assert ids == ref(text).input_ids
        assert decoded == ref.decode(ref(text).input_ids)
