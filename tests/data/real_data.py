"""Small files of real ShareGPT records (raw, as published) for CLI and pipeline tests."""

from __future__ import annotations

import functools
import itertools
import json
import tempfile
from pathlib import Path

from eagle3kit.data.sources import Reader, parse_source
from tests import assets


@functools.lru_cache(maxsize=4)
def sharegpt_array(n: int) -> Path:
    """The first `n` records of the real ShareGPT file, as a JSON array file (written once)."""
    raws = itertools.islice(Reader(parse_source(str(assets.sharegpt_path()))), n)
    path = Path(tempfile.mkdtemp(prefix="eagle3kit-sharegpt-")) / f"sharegpt_{n}.json"
    path.write_text(json.dumps([r.value for r in raws], ensure_ascii=False, indent=1))
    return path
