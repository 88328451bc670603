"""Checks a Pallas kernel's Triton module on a machine without a GPU: `verified(monkeypatch)`
makes every Triton lowering verify its module (raising MLIRError if invalid) and returns the
list each verification appends True to; lower the kernel with
`jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`."""

from __future__ import annotations

import pytest


def verified(monkeypatch) -> list:
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    lower = registration.lowering.lower_jaxpr_to_triton_module
    results = []

    def verifying(*args, **kwargs):
        result = lower(*args, **kwargs)
        with result.module.operation.context:
            results.append(result.module.operation.verify())  # raises MLIRError if invalid
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", verifying)
    return results
