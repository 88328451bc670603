"""docs/architecture.md's "How to add ..." sections, read by the tests that keep them true:
a section's text, and its example module executed as written."""

from __future__ import annotations

import re
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def doc_section(heading: str) -> str:
    """The text under `heading` (a whole `### ...` line) up to the next heading."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split(heading, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def doc_module(heading: str, name: str) -> types.ModuleType:
    """The section's example module (its ```python block), executed as written."""
    code = re.search(r"```python\n(.*?)```", doc_section(heading), re.S)
    assert code, "the section has no example module"
    module = types.ModuleType(name)
    exec(compile(code.group(1), "docs/architecture.md", "exec"), module.__dict__)
    return module
