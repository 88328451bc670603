"""Draft formats: eagle3kit's own, SGLang's midlayer format, speculators (vLLM), and any
other registered in `registry` (one line below per format; docs/architecture.md says how).

The public API other modules call:

    load_any_draft(source, target=None, target_name=None, fmt="auto") -> Draft
        `source` is a local directory or a Hub id of a draft in any registered format
        (auto-detected). Engine formats do not always record their target; it comes from
        `target` (directory, .gguf or Hub id), the export's sidecar, or the speculators
        verifier name, in that order.
    export_draft(draft, fmt, out_dir, dtype="bfloat16", force=False, ...) -> Path
        Validates, then writes atomically: nothing appears at `out_dir` unless all of it does.
    detect_format(directory) -> "eagle3kit" | "sglang" | "speculators" | another registered
    check_replaceable(out_dir, source)
        Refuses an output that is, holds or lies inside the source, and an existing output
        that is not recognisably an earlier export (what `--force` may replace).
    names() -> the registered formats, in the order `convert --to` lists them

Importing this package is cheap (the CLI reads the names for --help); the API functions load
`formats.api`, and with it JAX, on first use.
"""

from __future__ import annotations

from eagle3kit.formats.registry import names, register

register("sglang", "SGLang", "eagle3kit.formats.sglang")
register("speculators", "speculators (vLLM)", "eagle3kit.formats.speculators")
register("eagle3kit", "eagle3kit", "eagle3kit.formats.native")

_API = ("check_replaceable", "detect_format", "export_draft", "load_any_draft")

__all__ = [*_API, "names", "register"]


def __getattr__(name: str):
    if name in _API:
        from eagle3kit.formats import api

        return getattr(api, name)
    raise AttributeError(f"module 'eagle3kit.formats' has no attribute {name!r}")
