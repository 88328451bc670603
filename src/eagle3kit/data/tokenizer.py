"""Loading the target's tokenizer from a local directory, a Hub id or a GGUF file."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Any

from eagle3kit.errors import InputError


def load_tokenizer(spec: str) -> Any:
    """A transformers fast tokenizer for `spec` (directory, `.gguf` file or Hub id)."""
    from transformers import AutoTokenizer

    path = Path(spec).expanduser()
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if path.is_file() and path.suffix == ".gguf":
                return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            if path.exists() and not path.is_dir():
                raise InputError("not a tokenizer (expected a directory, .gguf file or Hub id)",
                                 path=spec)
            return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else spec)
    except InputError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/... with long texts
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot load a tokenizer ({first})", path=spec) from None
    finally:
        quiet.setLevel(level)
