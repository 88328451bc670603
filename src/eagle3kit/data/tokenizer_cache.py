"""Tokenizers built from GGUF files, kept on disk between processes.

Converting a GGUF file's vocabulary into a `tokenizers` backend is slow for the large
vocabularies of current targets (Qwen's, Gemma's), and every `tokenize`, `regenerate`,
`train` and `eval` process reads its target's tokenizer; loading the converted one is not. The
converted backend (its `tokenizer.json`) and the arguments of its transformers class are kept
under EAGLE3KIT_TOKENIZER_CACHE (default ~/.cache/eagle3kit/tokenizers), keyed by a digest of
the file's tokenizer metadata and the versions that convert it: a copied or renamed GGUF
finds its entry, and another vocabulary, template or transformers never meets a stale one.
An entry is written atomically; one that cannot be read is built again, with one warning.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3kit.errors import first_line
from eagle3kit.io.atomic import atomic_path
from eagle3kit.io.gguf import open_reader

TOKENIZER_CACHE = "~/.cache/eagle3kit/tokenizers"  # default of EAGLE3KIT_TOKENIZER_CACHE
FORMAT = 1  # the entry's layout; raised when it changes (old entries are then not read)

Built = tuple[type, Any, dict[str, Any]]  # (tokenizer class, tokenizers.Tokenizer, kwargs)


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3KIT_TOKENIZER_CACHE") or TOKENIZER_CACHE).expanduser()


def entry_key(path: str) -> str:
    """A digest of what the conversion reads (the file's `tokenizer.*` metadata and its
    architecture) and of what converts it (transformers, tokenizers, this layout)."""
    import tokenizers
    import transformers

    fields = open_reader(path).fields  # read once a process: the weights come from it too
    meta = {k: v for k, v in fields.items()
            if k.startswith("tokenizer.") or k == "general.architecture"}
    h = hashlib.sha256(json.dumps([FORMAT, transformers.__version__, tokenizers.__version__],
                                  ).encode())
    h.update(json.dumps(meta, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:32]


def built(path: str, build: Callable[[str], Built]) -> Built:
    """`build(path)`, or what it returned for a GGUF file of the same tokenizer metadata
    in an earlier process. The class is one of transformers' own, found by name."""
    from tokenizers import Tokenizer

    entry = cache_dir() / f"{entry_key(path)}.json"
    if entry.is_file():
        try:
            kept = json.loads(entry.read_text(encoding="utf-8"))
            module, name = kept["class"]
            if not module.startswith("transformers."):
                raise ValueError(f"class {module}.{name} is not transformers'")
            cls = getattr(importlib.import_module(module), name)
            return cls, Tokenizer.from_str(kept["backend"]), dict(kept["kwargs"])
        except Exception as e:  # any damage: a truncated file, a hand edit, another format
            _warn(f"tokenizer cache {entry}: unreadable ({first_line(e, type(e).__name__)}); "
                  f"building the tokenizer of {path} again")
    cls, backend, kwargs = build(path)
    try:
        text = json.dumps({"class": [cls.__module__, cls.__name__], "kwargs": kwargs,
                           "backend": backend.to_str()}, ensure_ascii=False)
    except TypeError:  # arguments JSON cannot hold: built each time, as before
        return cls, backend, kwargs
    try:
        with atomic_path(entry) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except OSError as e:
        _warn(f"tokenizer cache {entry.parent}: cannot write ({e.strerror or e}); the next "
              "process builds this tokenizer again (set EAGLE3KIT_TOKENIZER_CACHE to a "
              "writable directory)")
    return cls, backend, kwargs


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)
