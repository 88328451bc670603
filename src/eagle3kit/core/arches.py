"""The draft architectures `train --arch` builds, by name: one registry, one line per
architecture (at the end of this module; docs/architecture.md, "How to add a draft").

A registration names the architecture (`train --arch`, a draft's `DraftConfig.arch`), the name
a reader knows it by (model cards, --help), one clause for --help, the `DraftConfig.method`
it is built on, the boolean `DraftConfig` fields it turns on, the `train` options (fields of
jobs/config.TrainConfig) only its method reads, and the module that implements the method,
imported on first use. Every run records every option, so the model card shows a method's
own options only for its drafts (`foreign_options`). The module defines

    Weights                             the weights' pytree class: `Weights.abstract(cfg,
                                        dtype)` describes every array, `Weights(**arrays)`
                                        builds one from arrays by field name
    export_keys(fmt, cfg) -> tuple[Key] the tensors format `fmt` writes and reads, in order;
                                        None when `fmt` cannot express the draft
    export_fields(fmt, cfg) -> dict     the config fields the method adds in format `fmt`
    read_flags(fmt, config) -> dict     `DraftConfig` fields read back from such a config

and, for a method that is not EAGLE-3's step (core/draft.py, which `core/ttt.py` trains and
`decode/` runs), what its trainer and decoder call. The registry itself imports nothing of
eagle3kit but `named`, so `core/config.py` and the CLI's --help read it without JAX.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

from eagle3kit.named import Registry, imported


@dataclasses.dataclass(frozen=True)
class Key:
    """One tensor of an engine format: its name there, the weights' field it holds, how many
    leading axes of the eagle3kit array are the linear's input (0 for a vector: the engine's
    [out, in] is then reshape(prod(in), prod(out)).T), and for a stacked field, the row."""

    name: str
    field: str
    n_in: int
    index: int | None = None


@dataclasses.dataclass(frozen=True)
class DraftArch:
    name: str
    display: str
    summary: str
    method: str
    flags: tuple[str, ...]
    module: str | ModuleType
    options: tuple[str, ...] = ()

    @property
    def impl(self) -> Any:
        return imported(self.module)


_ARCHES: Registry[DraftArch] = Registry("draft architecture")


def register(name: str, display: str, module: str | ModuleType, *, summary: str = "",
             method: str | None = None, flags: tuple[str, ...] = (),
             options: tuple[str, ...] = ()) -> DraftArch:
    """Adds an architecture (`method` defaults to `name`); --arch lists them in this order."""
    return _ARCHES.add(name, DraftArch(name, display, summary, method or name, tuple(flags),
                                       module, tuple(options)))


unregister, names, arches, get = _ARCHES.remove, _ARCHES.names, _ARCHES.values, _ARCHES.get


def flag_fields() -> tuple[str, ...]:
    """Every boolean `DraftConfig` field some architecture turns on, in registration order."""
    return tuple(dict.fromkeys(f for a in _ARCHES.values() for f in a.flags))


def method_module(method: str) -> Any:
    """The implementation of `method` (the module of its first registered architecture)."""
    arch = next((a for a in _ARCHES.values() if a.method == method), None)
    if arch is None:
        raise KeyError(f"no draft architecture implements the method {method!r}")
    return arch.impl


def foreign_options(name: str) -> set[str]:
    """The `train` options some other method reads but the architecture `name` (or its
    method) does not: recorded by its run at their defaults, they say nothing of its draft."""
    arch = get(name) or get(name.split("+")[0])
    own = {o for a in _ARCHES.values() if arch and a.method == arch.method for o in a.options}
    return {o for a in _ARCHES.values() for o in a.options} - own


def display(name: str) -> str:
    """The name cards and help give the architecture `name`; an unregistered mix of flags
    (`eagle3+norm_output`) goes by its method's."""
    arch = get(name) or get(name.split("+")[0])
    return arch.display if arch else name


def help_text() -> str:
    """`train --arch`'s help: each architecture and what it is."""
    return "Draft architecture: " + "; ".join(
        f"{a.name}{f' ({a.summary})' if a.summary else ''}" for a in _ARCHES.values()) + "."


register("eagle3", "EAGLE3", "eagle3kit.core.draft")
register("eagle3.1", "EAGLE-3.1", "eagle3kit.core.draft", method="eagle3",
         flags=("fc_norm", "norm_output"),
         summary="an RMSNorm per captured state before fc, and the post-norm state carried "
                 "to the next step")
register("eagle3.1-fc", "EAGLE-3.1 (fc norms)", "eagle3kit.core.draft", method="eagle3",
         flags=("fc_norm",), summary="the fc norms only")
register("peagle", "P-EAGLE", "eagle3kit.core.peagle",
         summary="parallel EAGLE: one pass proposes a block of draft tokens; speculators "
                 "format only")
register("dflash", "DFlash", "eagle3kit.core.dflash",
         summary="a block-diffusion drafter: one pass of --draft-layers layers proposes "
                 "--block-size - 1 tokens",
         options=("block_size", "draft_layers", "mask_token_id", "anchors"))
