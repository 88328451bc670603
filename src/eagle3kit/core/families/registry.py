"""The target families eagle3kit reads, by name: one registry, one line per family.

A family is a module (see docs/architecture.md, "How to add a target family") that defines

    MODEL_TYPES                          HF `model_type` -> its `architectures` class, for
                                         every model_type the family reads

and may define

    fields(d, num_layers, source) -> dict
                                         the `TargetConfig` fields of this family beyond the
                                         common ones (read from the parsed config.json `d`;
                                         `source` names it in errors): windows, ropes, experts,
                                         the layer's variant flags (`attention_bias`, `qk_norm`,
                                         `attention_sinks`, `gemma_norms`, ...)
    QUANTISATIONS                        `quantization_config.quant_method`s it understands
    HF_KEYS                              pytree path -> (HF tensor name, transform name):
                                         where its weights differ from io/hf's Llama table
    GGUF_ARCH                            its `general.architecture` in GGUF files (none: GGUF
                                         files of this family are refused)
    GGUF_MODEL_TYPE                      the model_type a GGUF of it reads as (default: the
                                         first of MODEL_TYPES)
    GGUF_NAMES                           (regex, HF name) pairs looked up before io/gguf's own
    gguf_config(get, scaling, path) -> dict
                                         config.json fields its GGUF header lacks (`get(key,
                                         default)` reads `<arch>.<key>`); none: rope scaling
                                         must be absent
    GGUF_ROTARY_PERMUTED                 llama.cpp stored q and k with the rotary halves
                                         interleaved (undone on read)
    GGUF_NORMS_PLUS_ONE                  llama.cpp stored the norms as 1 + w (undone on read)
    GGUF_TOKENIZER_ARCHS                 GGUF architectures whose tokenizer is this family's
                                         transformers class (`TOKENIZER_CLASS`, "module:Class")
    CHAT_TEMPLATES                       name -> Jinja chat template for its base models
                                         (`--chat-template NAME`)

The registry itself imports nothing of eagle3kit: a module is imported on first use, so that
a family's module may import `core.config`, which looks families up here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    """A registered family: its name (`TargetConfig.family`) and the module that holds it."""

    name: str
    module: str | ModuleType

    @property
    def impl(self) -> Any:
        if isinstance(self.module, ModuleType):
            return self.module
        return importlib.import_module(self.module)

    @property
    def model_types(self) -> dict[str, str]:
        return self.impl.MODEL_TYPES

    def fields(self, d: dict[str, Any], num_layers: int, source: object) -> dict[str, Any]:
        fields = getattr(self.impl, "fields", None)
        return fields(d, num_layers, source) if fields else {}

    @property
    def quantisations(self) -> tuple[str, ...]:
        return tuple(getattr(self.impl, "QUANTISATIONS", ()))

    @property
    def hf_keys(self) -> dict[str, tuple[str, str]]:
        return dict(getattr(self.impl, "HF_KEYS", {}))

    @property
    def gguf_arch(self) -> str | None:
        return getattr(self.impl, "GGUF_ARCH", None)

    @property
    def gguf_model_type(self) -> str:
        return getattr(self.impl, "GGUF_MODEL_TYPE", next(iter(self.model_types)))

    @property
    def gguf_names(self) -> list[tuple[str, str]]:
        return list(getattr(self.impl, "GGUF_NAMES", []))

    @property
    def gguf_config(self) -> Callable[..., dict[str, Any]] | None:
        return getattr(self.impl, "gguf_config", None)

    @property
    def gguf_rotary_permuted(self) -> bool:
        return bool(getattr(self.impl, "GGUF_ROTARY_PERMUTED", False))

    @property
    def gguf_norms_plus_one(self) -> bool:
        return bool(getattr(self.impl, "GGUF_NORMS_PLUS_ONE", False))

    @property
    def gguf_tokenizer_archs(self) -> tuple[str, ...]:
        return tuple(getattr(self.impl, "GGUF_TOKENIZER_ARCHS", ()))

    @property
    def tokenizer_class(self) -> str | None:
        return getattr(self.impl, "TOKENIZER_CLASS", None)

    @property
    def chat_templates(self) -> dict[str, str]:
        return dict(getattr(self.impl, "CHAT_TEMPLATES", {}))


_FAMILIES: dict[str, Family] = {}


def register(name: str, module: str | ModuleType) -> Family:
    """Adds a family (`module`: a dotted module name, imported on first use, or a module);
    errors list families in the order they were registered."""
    if name in _FAMILIES:
        raise ValueError(f"target family {name!r} is already registered")
    _FAMILIES[name] = family = Family(name, module)
    return family


def unregister(name: str) -> None:
    del _FAMILIES[name]


def names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def get(name: str) -> Family:
    return _FAMILIES[name]


def model_types() -> dict[str, tuple[Family, str]]:
    """Every model_type a registered family reads -> (the family, its architectures class)."""
    return {t: (f, cls) for f in families() for t, cls in f.model_types.items()}


def by_model_type(model_type: str) -> Family | None:
    found = model_types().get(model_type)
    return found[0] if found else None


def by_gguf_arch(arch: str) -> Family | None:
    return next((f for f in families() if f.gguf_arch == arch), None)


def gguf_archs() -> tuple[str, ...]:
    return tuple(f.gguf_arch for f in families() if f.gguf_arch)
