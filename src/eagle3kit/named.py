"""A registry of named things in the order they were added: draft formats
(formats/registry.py) and draft architectures (core/arches.py). Imports nothing, so the CLI
reads either for --help without loading JAX."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, reserved: tuple[str, ...] = ()):
        self.kind = kind  # what the error calls an item, e.g. "draft format"
        self.reserved = reserved  # names that mean something else where names are chosen
        self.items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        if name in self.items or name in self.reserved:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self.items[name] = item
        return item

    def remove(self, name: str) -> None:
        del self.items[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self.items)

    def values(self) -> tuple[T, ...]:
        return tuple(self.items.values())

    def get(self, name: str) -> T | None:
        return self.items.get(name)


def imported(module: str | ModuleType) -> Any:
    """`module` itself, or the module of that dotted name, imported on first use."""
    return module if isinstance(module, ModuleType) else importlib.import_module(module)
