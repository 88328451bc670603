"""The draft formats `convert` reads and writes, by name: one registry, one line per format.

A format is a module (see docs/architecture.md, "How to add an export format") that defines

    EXPECTS                            what `detect` looks for, for the unknown-format error
    detect(directory, config) -> bool  whether `directory` holds this format (`config` is its
                                       parsed config.json, None without one)
    load(directory, target) -> Draft   the draft in memory; `target` as given to --target
    export(draft, out, options)        writes `out` whole or not at all (`ExportOptions`)

and may define `DTYPE` (the weights' dtype whatever --dtype says), `guess(directory, config) ->
bool` (a weaker sign, asked only when no format's
`detect` matched) and, for a format engines serve (one `export` gives an `eagle3kit.json`
sidecar, `engine.export`), `serving(draft_config, target_config, speculative_tokens) ->
Serving`: what its model card shows. The registry itself imports nothing of eagle3kit but `named`: the CLI reads the
names and display names for --help without loading JAX; a module is imported on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

from eagle3kit.named import Registry, imported


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """What `export_draft` passes to a format's `export`, already validated."""

    dtype: str = "bfloat16"  # of engine formats' weights (the eagle3kit format keeps fp32)
    force: bool = False  # replace an existing output (checked replaceable by the caller)
    speculative_tokens: int = 3
    source: str = ""  # the draft as given to convert, recorded in an export's sidecar


@dataclasses.dataclass(frozen=True)
class Serving:
    """How an engine format's model card says to serve it (hub/sections renders each engine's
    commands): `library` is the card's library_name and engine tag; `engines` those whose
    commands the card shows, in order; `refused` maps an engine that cannot load this export
    to the sentence shown instead; `notes[engine](repo, n)` is a sentence after that engine's
    command (`repo`: the draft's Hub id, `n`: the draft tokens the command passes)."""

    library: str
    engines: tuple[str, ...]
    tags: tuple[str, ...] = ()
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: dict[str, Callable[[str, int], str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DraftFormat:
    """A registered format: its name (--to, --from, an export's `engine_format`), the name a
    reader knows it by, and the module that implements it."""

    name: str
    display: str
    module: str | ModuleType

    @property
    def impl(self) -> Any:
        return imported(self.module)

    @property
    def dtype(self) -> str | None:
        return getattr(self.impl, "DTYPE", None)

    @property
    def expects(self) -> str:
        return self.impl.EXPECTS

    def detect(self, directory, config) -> bool:
        return bool(self.impl.detect(directory, config))

    def guess(self, directory, config) -> bool:
        guess = getattr(self.impl, "guess", None)
        return bool(guess and guess(directory, config))

    def load(self, directory, target: str | None):
        return self.impl.load(directory, target)

    def export(self, draft, out, options: ExportOptions):
        return self.impl.export(draft, out, options)

    def serving(self, draft_config, target_config, speculative_tokens: int) -> Serving | None:
        serving = getattr(self.impl, "serving", None)
        return serving(draft_config, target_config, speculative_tokens) if serving else None


_FORMATS: Registry[DraftFormat] = Registry("draft format", reserved=("auto",))


def register(name: str, display: str, module: str | ModuleType) -> DraftFormat:
    """Adds a format (`module`: a dotted module name, imported on first use, or a module);
    --to lists formats in the order they were registered."""
    return _FORMATS.add(name, DraftFormat(name, display, module))


unregister, names, formats, get = _FORMATS.remove, _FORMATS.names, _FORMATS.values, _FORMATS.get


def spoken(words: tuple[str, ...] | list[str], last: str = "or") -> str:
    """`a, b or c`: a list of names as a sentence says it."""
    return ", ".join(words[:-1]) + f" {last} " + words[-1] if len(words) > 1 else "".join(words)
