"""Executables kept on disk (decode/executables.py): a program met again in a new process is
loaded whole, and only where everything it was made from is the same: the source, every
argument's shape, dtype and devices, the static arguments, the bound configuration. A
damaged entry or a directory that cannot be written is reported and the program compiled.

A fresh `Program` stands for a fresh process: it holds no executable in memory and its jit
has traced nothing, so whatever it does not compile comes from the directory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle3kit.decode import executables
from eagle3kit.jobs import eval_batched


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float


def scaled(x, y, *, cfg: Config, steps: int):
    for _ in range(steps):
        x = x * cfg.scale + y.sum()
    return {"x": x, "norm": jnp.linalg.norm(x)}


def program(scale: float = 2.0) -> executables.Program:
    return executables.Program(functools.partial(scaled, cfg=Config(scale)), "test.scaled",
                               static_argnames=("steps",), donate_argnums=0)


def reference(x, y, scale: float = 2.0, steps: int = 3):
    return scaled(np.asarray(x), np.asarray(y), cfg=Config(scale), steps=steps)


@pytest.fixture
def kept(tmp_path):
    """The directory in use for the test, and what was reported: (kind, detail) pairs."""
    said: list[tuple[str, str]] = []
    executables.use(str(tmp_path / "exe"), lambda kind, detail: said.append((kind, detail)))
    yield tmp_path / "exe", said
    executables.use(None, said.append)


def hits() -> int:
    return eval_batched.cache_hits()[1]


def call(p: executables.Program, x, y, steps: int = 3):
    """p's result as host arrays, and whether it was loaded from the directory."""
    before = hits()
    out = p(jnp.asarray(x), jnp.asarray(y), steps=steps)
    return jax.tree.map(np.asarray, out), hits() - before


def same(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


X, Y = np.arange(4, dtype=np.float32), np.ones(3, np.float32)


def test_a_new_process_loads_what_an_earlier_one_compiled(kept):
    path, said = kept
    first, loaded = call(program(), X, Y)
    assert loaded == 0 and len(list(path.glob("*.exe"))) == 1
    again, loaded = call(program(), X, Y)
    assert loaded == 1 and not said
    same(first, reference(X, Y)), same(again, first)
    p = program()  # the same program called again: the executable it holds, no load
    call(p, X, Y)
    assert call(p, X + 1, Y)[1] == 0
    x5 = np.arange(5, dtype=np.float32)  # another shape, then the first again: each its own
    for x in (x5, X, x5):
        got, _ = call(p, x, Y)
        same(got, reference(x, Y))


def test_a_change_of_source_shape_dtype_static_or_config_misses(kept, monkeypatch):
    """Each call differs from the kept one in one thing, and must compile its own program
    (a load of the kept executable would give the wrong answer or refuse the arguments)."""
    path, said = kept
    call(program(), X, Y)
    for got, want in (
            (call(program(), np.arange(5, dtype=np.float32), Y),
             reference(np.arange(5, dtype=np.float32), Y)),
            (call(program(), X, np.ones(2, np.float32)), reference(X, np.ones(2, np.float32))),
            (call(program(), X.astype(np.int32), Y), reference(X.astype(np.int32), Y)),
            (call(program(), X, Y, steps=4), reference(X, Y, steps=4)),
            (call(program(3.0), X, Y), reference(X, Y, scale=3.0))):
        assert got[1] == 0
        same(got[0], want)
    kept_before = len(list(path.glob("*.exe")))
    monkeypatch.setattr(executables, "source_digest", lambda: "edited")
    executables._environment.cache_clear()
    try:
        got, loaded = call(program(), X, Y)
    finally:
        monkeypatch.undo()
        executables._environment.cache_clear()
    assert loaded == 0 and len(list(path.glob("*.exe"))) == kept_before + 1
    same(got, reference(X, Y))
    assert not said


def test_the_same_shapes_on_other_devices_miss(kept):
    """An executable is bound to its devices: the same arrays on another device, or split
    over a mesh of two, are other programs."""
    devices = jax.devices()
    assert len(devices) >= 6, "tests/conftest.py's simulated CPU devices"
    meshes = [Mesh(np.array(devices[i: i + 2]), ("data",)) for i in (2, 4)]
    call(program(), X, Y)
    for x_at, y_at in [(devices[1], devices[1])] + [  # a mesh of two, then the same on others
            (NamedSharding(m, PartitionSpec("data")), NamedSharding(m, PartitionSpec()))
            for m in meshes]:
        before = hits()
        out = program()(jax.device_put(X, x_at), jax.device_put(Y, y_at), steps=3)
        assert hits() == before
        same(jax.tree.map(np.asarray, out), reference(X, Y))


def test_arrays_laid_out_alike_under_other_sharding_objects_meet_one_program(kept):
    """On one device P('data') and P() lay an array out alike: a program compiled ahead for
    one (the engine's allocated cache) serves calls with the other (that cache as a step
    returns it), neither compiled again in this process nor loaded again in the next."""
    path, said = kept
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    split, whole = (NamedSharding(mesh, PartitionSpec(*spec)) for spec in (("data",), ()))
    p = program()
    p.compile(jax.device_put(X, split), jax.device_put(Y, whole), steps=3)
    assert len(list(path.glob("*.exe"))) == 1
    before = eval_batched.compile_totals()[1], hits()
    out = p(jax.device_put(X, whole), jax.device_put(Y, split), steps=3)
    assert (eval_batched.compile_totals()[1], hits()) == before  # the executable it holds
    same(jax.tree.map(np.asarray, out), reference(X, Y))
    q = program()  # a later process: loads the kept one, keeps no second
    out = q(jax.device_put(X, whole), jax.device_put(Y, whole), steps=3)
    assert hits() == before[1] + 1 and len(list(path.glob("*.exe"))) == 1 and not said
    same(jax.tree.map(np.asarray, out), reference(X, Y))


@pytest.mark.parametrize("damage", ["garbage", "cut", "flipped", "other key"])
def test_a_damaged_entry_is_reported_and_compiled_again(kept, damage):
    path, said = kept
    call(program(), X, Y)
    (entry,) = path.glob("*.exe")
    data = entry.read_bytes()
    if damage == "other key":  # a sound entry of another program under this one's name
        call(program(), X, Y, steps=5)
        data = next(p for p in path.glob("*.exe") if p != entry).read_bytes()
    entry.write_bytes({"garbage": b"not a program", "cut": data[: len(data) // 2],
                       "flipped": data[:-9] + bytes([data[-9] ^ 1]) + data[-8:],
                       "other key": data}[damage])
    got, loaded = call(program(), X, Y)
    assert loaded == 0
    same(got, reference(X, Y))
    assert len(said) == 1 and said[0][0] == "read" and str(entry) in said[0][1], said
    assert call(program(), X, Y)[1] == 1  # written again, sound


def test_a_loaded_executable_that_fails_to_run_is_dropped_and_compiled_again(kept, monkeypatch):
    """An entry that loads but cannot run (on a CPU, one JAX had itself loaded from its
    cache lost a kernel when serialized again): the answer comes from a fresh compile, the
    entry is reported once and removed."""
    path, said = kept
    call(program(), X, Y)

    def loads_but_fails(data, key):
        def run(*args):
            raise RuntimeError("Function wrapped_reduce not found")
        return run

    monkeypatch.setattr(executables, "_decode", loads_but_fails)
    got, loaded = call(program(), X, Y)
    same(got, reference(X, Y))
    assert loaded == 1 and len(said) == 1, said
    assert said[0][0] == "read" and "failed to run" in said[0][1]
    assert not list(path.glob("*.exe"))


def test_a_directory_that_cannot_be_written_is_reported_and_the_run_goes_on(tmp_path):
    (tmp_path / "file").write_text("")
    said: list[tuple[str, str]] = []
    executables.use(str(tmp_path / "file" / "exe"), lambda *a: said.append(a))
    try:
        got, loaded = call(program(), X, Y)
        again, _ = call(program(), X, Y)
    finally:
        executables.use(None, said.append)
    same(got, reference(X, Y)), same(again, got)
    assert loaded == 0 and [kind for kind, _ in said] == ["write", "write"]


def test_a_configuration_printed_by_address_is_never_kept(kept):
    path, said = kept

    class Opaque:  # no repr of its value: two of them cannot be told apart by their text
        scale = 2.0

    p = executables.Program(functools.partial(scaled, cfg=Opaque()), "test.opaque",
                            static_argnames=("steps",))
    got, _ = call(p, X, Y)
    same(got, reference(X, Y))
    assert not list(path.glob("*.exe")) and not said


@pytest.mark.slow  # each case compiles the engine's programs twice (jit, then kept)
@pytest.mark.parametrize("kind", ["speculative", "plain on data=2"])
def test_the_engine_answers_the_same_with_its_programs_loaded(tiny, tiny_dir, kept, kind):
    """The engine's own programs (prefill, step, allocators) kept by one run and loaded by
    the next (a fresh process: the module's program caches cleared) give the answers of
    jit, speculative on one device and plain with its rows split over two."""
    from eagle3kit.core.sharding import make_mesh
    from eagle3kit.decode import engine
    from eagle3kit.decode.speculative import DecodeConfig
    from eagle3kit.io.hf import load_target, resolve_target
    from tests.decode import engines

    path, said = kept
    tcfg, tw, dcfg, dw, vocab, mesh = tiny
    dec = DecodeConfig(3, 6, 0.0)
    if kind != "speculative":
        mesh = make_mesh("data=2,tensor=1", jax.devices()[:2])
        tw = load_target(resolve_target(tiny_dir), mesh, jnp.float32)
    rng = np.random.default_rng(3)
    todo = [engine.Request(i, [int(t) for t in rng.integers(1, 96, n)], 6, i)
            for i, n in enumerate((5, 40, 9))]

    def answers() -> tuple[list[list[int]], int]:
        engine._programs.cache_clear()
        engine._allocators.cache_clear()
        before = hits()
        e = engines.speculative(tcfg, tw, dcfg, dw, vocab, dec, [], mesh, rows=2,
                                max_context=128) if kind == "speculative" else \
            engines.plain(tcfg, tw, dec, [], mesh, rows=2, max_context=128, sync_every=4)
        return [c.tokens for c in e.generate(todo)], hits() - before

    # a fresh process, as the executables are meant for: no program of an earlier test is
    # held in memory (one JAX loaded from its own persistent cache, on when an earlier test
    # of this process turned it on, makes a kept executable that does not run on a CPU:
    # what the run-time check reports), and the reference compiles every program in a
    # directory of its own (under the same guard against JAX's cache, nothing to load)
    jax.clear_caches()
    executables.use(str(path.parent / "reference"), lambda *a: said.append(a))
    reference, _ = answers()
    executables.use(str(path), lambda *a: said.append(a))
    first, loaded_first = answers()
    again, loaded = answers()
    assert first == again == reference and not said
    assert loaded_first == 0 and loaded >= 3, (loaded_first, loaded)
