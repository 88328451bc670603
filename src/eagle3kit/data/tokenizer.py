"""Loading the target's tokenizer from a local directory, a Hub id or a GGUF file, and chat
templates from files."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import io
import json
import logging
from pathlib import Path
from typing import Any

from eagle3kit.core import families
from eagle3kit.errors import InputError, first_line
from eagle3kit.io.gguf import open_reader
from eagle3kit.io.hub import is_hub_id, snapshot

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _looks_local(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf")


def load_tokenizer(spec: str) -> Any:
    """A transformers fast tokenizer for `spec` (directory, `.gguf` file or Hub id)."""
    path = Path(spec).expanduser()
    if not path.exists() and _looks_local(spec):
        raise InputError("no such file or directory", path=spec)
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if path.is_file() and path.suffix == ".gguf":
                return _gguf_tokenizer(path)
            if path.exists() and not path.is_dir():
                raise InputError("not a tokenizer (expected a directory, .gguf file or Hub id)",
                                 path=spec)
            if path.is_dir() and not any((path / f).is_file() for f in _TOKENIZER_FILES):
                raise InputError("no tokenizer in this directory (expected "
                                 f"{' or '.join(_TOKENIZER_FILES[:2])})", path=spec)
            if not path.exists() and is_hub_id(spec):  # one line, in seconds, when offline
                path = snapshot(spec, ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"],
                                "the tokenizer")
            elif not path.exists():
                raise InputError("no such directory or .gguf file, and not a Hub id", path=spec)
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(str(path))
    except InputError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/... with long texts
        if _needs_torch(e):
            import transformers
            raise InputError(f"cannot load a tokenizer: transformers {transformers.__version__} "
                             "reads a GGUF file's tokenizer only with torch installed: upgrade "
                             "transformers (5.18 or later needs no torch), install torch, or "
                             "pass the model's tokenizer directory or Hub id", path=spec) from None
        raise InputError(f"cannot load a tokenizer ({first_line(e, type(e).__name__)})",
                         path=spec) from None
    finally:
        quiet.setLevel(level)


# tokenizer.ggml.* ids of the special tokens transformers sets from a GGUF file
_GGUF_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                 "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _gguf_tokenizer(path: Path) -> Any:
    """A GGUF file's tokenizer, as transformers builds it, without torch.

    transformers' own GGUF loading imports torch only to read the file (5.17+: its reader;
    before: `load_gguf_checkpoint`). Here io.gguf reads the metadata and
    transformers' converter builds the tokenizer from it, as `AutoTokenizer.from_pretrained(
    dir, gguf_file=...)` does (tests/data/test_tokenizer.py checks they agree). A transformers
    without that converter module (< 5.18) takes its own path, which needs torch, with the
    file's control tokens added as 5.18+ adds them; for Gemma, whose tokenizer that path
    builds wrong, `_gemma_tokenizer`.
    """
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: F401
            convert_gguf_tokenizer,
        )
    except ImportError:
        fields = open_reader(path).fields
        if _tokenizer_class(fields.get("general.architecture")) == _GEMMA:
            return _gemma_tokenizer(fields)  # transformers' own build before 5.18 is wrong
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return with_gguf_added_tokens(tok, fields)
    stat = path.stat()
    return _copy(*_gguf_converted(str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=2)
def _gguf_converted(path: str, mtime_ns: int, size: int) -> tuple[Any, str]:
    """The tokenizer of a GGUF file (as it is at `mtime_ns`, `size`), never handed out, and
    its backend's serialisation less the model and added tokens (see `_copy`): converting a
    262,144-token vocabulary takes seconds, and commands run one after another in one
    process (tests, notebooks) read the same file again."""
    from tokenizers.models import BPE

    from eagle3kit.data.tokenizer_cache import built

    cls, backend, kwargs = built(path, _gguf_build)  # another process's build, if kept
    tokenizer = cls(tokenizer_object=backend, **kwargs)
    backend = tokenizer.backend_tokenizer
    model, backend.model = backend.model, BPE()  # serialised without its vocabulary
    try:
        rest = json.loads(backend.to_str())
    finally:
        backend.model = model
    rest["added_tokens"] = []  # their ids are the model's: added in _copy
    return tokenizer, json.dumps(rest)


def _copy(tokenizer: Any, rest: str) -> Any:
    """A tokenizer of the caller's own, equal to `tokenizer`, in milliseconds.

    `copy.deepcopy` serialises the backend and builds its model again from JSON (about 1.3 s
    for Gemma's 262,144 tokens and their merges). Here the new backend is built from `rest`
    (normalizer, pre-tokenizer, post-processor, decoder, truncation, padding) and the added
    tokens, in id order. Only the model (vocabulary and merges) is shared; of it `tokenizers`
    lets a caller set only options such as dropout or unk_token, which no caller sets. So a
    caller may set truncation or padding, change a normalizer or pre-tokenizer in place, add
    tokens or change the template of its copy without touching the next caller's. Should
    the added tokens not come back with their ids, the copy is a whole one."""
    from tokenizers import Tokenizer

    original = tokenizer.backend_tokenizer
    backend = Tokenizer.from_str(rest)
    backend.model = original.model
    added = original.get_added_tokens_decoder()
    backend.add_tokens([added[i] for i in sorted(added)])
    backend.encode_special_tokens = original.encode_special_tokens
    if {i: repr(t) for i, t in backend.get_added_tokens_decoder().items()} != {
            i: repr(t) for i, t in added.items()}:
        backend = copy.deepcopy(original)
    return copy.deepcopy(tokenizer, memo={id(original): backend})


def _gguf_build(path: str) -> tuple[type, Any, dict[str, Any]]:
    """The tokenizer class, converted backend and arguments for a GGUF file."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    meta = {k: v for k, v in open_reader(path).fields.items()
            if k.startswith("tokenizer.") or k == "general.architecture"}
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # sentencepiece: BOS unless told otherwise
        config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":  # its chat template writes <bos>
        config["add_bos_token"] = False
    for name, key in _GGUF_SPECIAL.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    arch = meta["general.architecture"]
    backend, extra = convert_gguf_tokenizer(arch, tokenizer)
    cls = PreTrainedTokenizerFast
    named = _tokenizer_class(arch)
    if named:  # AutoTokenizer's class for the family's model types
        module, _, name = named.partition(":")
        cls = getattr(importlib.import_module(module), name)
    return cls, backend, {**config, **extra}


def _tokenizer_class(arch: str | None) -> str | None:
    """The transformers tokenizer class ("module:Class") a family names for the GGUF
    architecture `arch` (`GGUF_TOKENIZER_ARCHS`); None: `PreTrainedTokenizerFast`."""
    return next((f.tokenizer_class for f in families.families()
                 if arch in f.gguf_tokenizer_archs), None)


_GEMMA = "transformers.models.gemma.tokenization_gemma:GemmaTokenizer"


def _gemma_tokenizer(fields: dict[str, Any]) -> Any:
    """A Gemma GGUF's tokenizer for transformers before 5.18, built as 5.18+ builds it.

    Those versions build it from the file's token scores, which for Gemma do not follow the
    merge order (`world` came out as `w`, `or`, `ld`); the order of the tokens in the file
    does. Tokens of two or more spaces are stored as spaces and looked up as U+2581 runs.
    tests/data/test_tokenizer.py checks this build against transformers' current one.
    """
    try:
        from transformers.tokenization_utils_base import generate_merges
    except ImportError:  # before 5.18
        from transformers.convert_slow_tokenizer import generate_merges
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    file_tokens = fields["tokenizer.ggml.tokens"]
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in file_tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    config = {name: file_tokens[i] for name, key in _GGUF_SPECIAL.items()
              if (i := fields.get(f"tokenizer.ggml.{key}")) is not None}
    config["add_bos_token"] = fields.get("tokenizer.ggml.add_bos_token", True)
    config["add_eos_token"] = fields.get("tokenizer.ggml.add_eos_token", False)
    return with_gguf_added_tokens(GemmaTokenizer(vocab=vocab, merges=merges, **config), fields)


def with_gguf_added_tokens(tokenizer: Any, fields: dict[str, Any]) -> Any:
    """`tokenizer` with the tokens the GGUF file marks CONTROL (type 3: `<end_of_turn>`,
    `<|im_end|>`) added as special tokens and USER_DEFINED (4: `<think>`) as plain added
    tokens, as transformers 5.18+ builds a GGUF tokenizer; before 5.18 they are missing, so
    they were cut into pieces and no assistant turn ended in a special token. A control token
    of a byte-level vocabulary spelled outside its byte alphabet is a llama.cpp mislabel and
    is skipped, as transformers does."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = fields.get("tokenizer.ggml.tokens") or []
    types = fields.get("tokenizer.ggml.token_type") or []
    byte_level = fields.get("tokenizer.ggml.model") == "gpt2"
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    backend = tokenizer.backend_tokenizer
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types, strict=False)
               if kind == 3 and t not in have and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == 4 and t in vocab and t not in have]
    if user:
        backend.add_tokens(user)
    return tokenizer


def _needs_torch(e: BaseException | None) -> bool:
    """Whether `e` or an exception it was raised from is torch's absence."""
    while e is not None:
        if isinstance(e, ModuleNotFoundError) and e.name == "torch":
            return True
        e = e.__cause__ or e.__context__
    return False


def tokenizer_name(spec: str) -> str:
    """A readable name for fingerprints: the Hub id, or the file / directory name."""
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve().name
    return spec


# Chat templates by name, for targets whose tokenizer has none (base models): each family's
# (core/families, `CHAT_TEMPLATES`), rendering a string-content conversation exactly as the
# family's own template does, with the model's turns marked by {% generation %}
# (transformers' assistant-token masks).
KNOWN_TEMPLATES = {name: template for family in families.families()
                   for name, template in family.chat_templates.items()}
TEMPLATE_OPTION = ("--chat-template FILE (a Jinja file or a JSON file with a chat_template) "
                   "or a known name: " + ", ".join(KNOWN_TEMPLATES))


def chat_template_for(tokenizer: Any, template: str | None, target: object = None) -> str:
    """The chat template to render with: `template` (from `load_chat_template`) when given,
    else the tokenizer's own; a tokenizer without one (a base model) needs --chat-template."""
    if template:
        return template
    if not tokenizer.chat_template:
        raise InputError(f"the tokenizer has no chat template (a base model?); pass "
                         f"{TEMPLATE_OPTION}", path=target)
    return tokenizer.chat_template


def load_chat_template(path: str) -> str:
    """A chat template by name (KNOWN_TEMPLATES; a bare name, so `./gemma` is a file), from a
    Jinja file, or from a JSON file with a "chat_template" key (tokenizer_config.json,
    chat_template.json)."""
    if path in KNOWN_TEMPLATES:
        return KNOWN_TEMPLATES[path]
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("no such file (nor a known chat template: "
                         f"{', '.join(KNOWN_TEMPLATES)})", path=path) from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise InputError(f"not a chat template file ({e})", path=path) from None
    if p.suffix == ".json":
        try:
            value = json.loads(text).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as e:
            raise InputError(f"not a JSON object with a chat_template ({e})", path=path) from None
        if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
            value = next((t.get("template") for t in value if t.get("name") == "default"), None)
        if not isinstance(value, str):
            raise InputError("no (default) chat_template string in this JSON file", path=path)
        text = value
    if "{%" not in text and "{{" not in text:
        raise InputError("not a Jinja chat template (no {% %} or {{ }})", path=path)
    return text
