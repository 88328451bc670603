"""CPU seconds per test, for finding where the suite's time goes on a loaded machine (wall
times there say more about the neighbours than about the tests):

    E3K_CPU_PROFILE=cpu.jsonl python -m pytest -p tests.cpu_profile ...

appends one JSON line per test: its node id, the CPU seconds (user + system) of the test
process, of the processes it started and waited for, and of the commands the eagle3kit fork
server (tests/warm_cli.py) ran for it, each summed over setup, call and teardown; and the
wall seconds; and, of this process only, how many programs JAX traced, lowered and compiled
(or read from the compile cache), with their seconds; and `fresh`, the programs any process
of the test compiled and wrote to the session's compile cache (conftest's
JAX_COMPILATION_CACHE_DIR) by name: the same name in several tests is one program compiled at
several shapes or configurations, a candidate for sharing one. A session fixture's cost lands
on the first test that uses it."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

_OUT = os.environ.get("E3K_CPU_PROFILE")
if _OUT:  # where the fork server's commands add their CPU seconds (warm_cli reads this)
    os.environ["E3K_CPU_LOG"] = f"{_OUT}.commands.{os.getpid()}"  # each xdist worker its own


_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}
_compiles = {name: [0, 0.0] for name in _EVENTS.values()}


def _count(event: str, seconds: float, **_) -> None:
    if event in _EVENTS:
        _compiles[_EVENTS[event]][0] += 1
        _compiles[_EVENTS[event]][1] += seconds


def pytest_configure(config):
    if _OUT:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_count)


def _commands() -> float:
    try:
        return sum(float(x) for x in Path(os.environ["E3K_CPU_LOG"]).read_text().split())
    except (KeyError, FileNotFoundError):
        return 0.0


def _cached() -> set[str]:
    """The compile cache's entries (JAX names each `MODULE-KEY-cache`)."""
    try:
        return set(os.listdir(os.environ["JAX_COMPILATION_CACHE_DIR"]))
    except (KeyError, FileNotFoundError):
        return set()


def _now() -> tuple[float, float, float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime, _commands(),
            time.monotonic())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _OUT:
        yield
        return
    start, cached = _now(), _cached()
    before = {k: list(v) for k, v in _compiles.items()}
    yield
    end = _now()
    fresh = sorted(name.rsplit("-", 2)[0] for name in _cached() - cached
                   if name.endswith("-cache"))
    compiles = {k: [v[0] - before[k][0], round(v[1] - before[k][1], 2)]
                for k, v in _compiles.items()}
    own, kids, commands, wall = (round(b - a, 2) for a, b in zip(start, end, strict=True))
    with open(_OUT, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "own": own, "children": kids,
                            "commands": commands, "cpu": round(own + kids + commands, 2),
                            "wall": wall, **compiles, "fresh": fresh}) + "\n")
