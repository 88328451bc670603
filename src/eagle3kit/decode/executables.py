"""Compiled programs kept on disk under a key of all they were made from (issue 36).

JAX's persistent compile cache (jobs/common.compile_cache) skips XLA's compile, but a new
process still traces and lowers every program before it can look there, and for a whole
target's prefill or step that is most of the time. A `Program` is `jax.jit(fun)` whose
executables, while a directory is in use (`use`), are serialized there when compiled and
loaded by a later process that meets the same program: no tracing, lowering or compiling.

The key (`Program._key`, kept as text in the entry and checked on load) holds everything
an executable depends on, so that a stale one cannot be loaded:

- the program: its name, its function's module and qualified name, the static configuration
  bound to it (functools.partial's arguments, by repr) and jit's options;
- the call: the static arguments' values, the dynamic arguments' pytree structure and every
  leaf's shape, dtype, weak type, layout (its sharding as XLA reads it and its devices in
  order, not the sharding object: `_layout`) and commitment, and the mesh of
  `core.sharding.use_mesh` (which pins activations while tracing);
- the machine and the software: platform, device kind and count, the backend's version,
  jax, jaxlib, numpy and Python versions, JAX's tracing configuration (`trace_context`:
  x64, matmul precision, ...), XLA_FLAGS, and a digest of eagle3kit's own source, so that
  any code change misses.

What is kept was compiled by XLA in this process, never loaded from JAX's cache (`_fresh`).

A configuration whose repr is not stable (an object printed by address) is never stored.
An entry that cannot be read (unreadable, damaged: a checksum covers it, another key's, of
devices this process lacks) and a directory that cannot be written each give one report (the
job turns it into a warning line) and the program is compiled as if there were no entry.
Entries are written to a temporary file and renamed, so a reader never sees half of one.
One process only (jax.process_count() == 1): several hosts use JAX's cache alone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from eagle3kit.core.sharding import active_mesh

MAGIC = b"eagle3kit-executable-1\n"  # then the payload's sha256, then the payload (a pickle)
SUFFIX = ".exe"
HIT = "/eagle3kit/executables/hit"  # events (jax.monitoring) for the jobs' compile counts
LOAD = "/eagle3kit/executables/load_duration"
SAVE = "/eagle3kit/executables/save_duration"

Report = Callable[[str, str], None]  # (kind: "read" or "write", detail)
_store: _Store | None = None


def use(path: str | None, report: Report) -> None:
    """Executables go to and come from directory `path` (made when first written to); None:
    programs are plain jax.jit. `report(kind, detail)` hears an entry that could not be read
    ("read") or written ("write")."""
    global _store
    _store = _Store(path, report) if path and jax.process_count() == 1 else None


class Program:
    """`jax.jit(fun, **options)`, callable the same way (static arguments by position in
    `static_argnums` or by name in `static_argnames`), whose executables are kept on disk
    while a directory is in use. `name` says which program it is (events, keys)."""

    def __init__(self, fun: Callable, name: str, *, static_argnums: tuple[int, ...] = (),
                 static_argnames: tuple[str, ...] = (), **options: Any):
        self.name = name
        self.jit = jax.jit(fun, static_argnums=static_argnums, static_argnames=static_argnames,
                           **options)
        self._static_argnums = frozenset(static_argnums)
        self._made = _made(fun, static_argnums=static_argnums,
                           static_argnames=static_argnames, **options)
        self._known: dict[tuple, Any] = {}  # in-process signature -> executable
        self._last: dict[tuple, tuple] = {}  # static arguments -> (signature, executable)
        self._lock = threading.Lock()  # compile_ahead calls from threads
        self._unproven: dict[tuple, str] = {}  # loaded, not yet run: signature -> key

    def __call__(self, *args: Any, **static: Any) -> Any:
        if _store is None or self._made is None:
            return self.jit(*args, **static)
        dynamic, fixed = self._split(args, static)
        last = self._last.get(fixed)
        if last is not None:
            # the executable this call's static arguments met last checks the arguments
            # itself (tree, shapes, dtypes, shardings; not weak types, which the programs
            # kept here never take) before it runs: a per-leaf signature on every call costs
            # more than jit's own dispatch
            try:
                return last[1](*dynamic)
            except Exception:
                if _signature(dynamic, fixed) == last[0]:
                    raise  # the program's own error, not another shape
        sig = _signature(dynamic, fixed)
        executable = self._executable(args, static, dynamic, sig)
        with self._lock:
            key = self._unproven.pop(sig, None)
        if key is not None:
            # a loaded executable's first run: one that loads but cannot run (a kernel
            # missing from what was serialized, as JAX's own cache entries re-serialized
            # were on a CPU) is reported and dropped, and the program compiled again (had
            # the failed run consumed donated inputs, the second run fails as a plain
            # jit's would)
            try:
                out = executable(*dynamic)
            except Exception as e:
                if _store is None:
                    raise
                _store.discard(key, self.name, e)
                executable = self.jit.trace(*args, **static).lower().compile()
                with self._lock:
                    self._known[sig] = executable
            else:
                self._last[fixed] = sig, executable
                return out
        self._last[fixed] = sig, executable
        return executable(*dynamic)

    def compile(self, *args: Any, **static: Any) -> None:
        """Compiles (or loads) ahead the executable a call with these arguments runs."""
        if _store is None or self._made is None:
            self.jit.trace(*args, **static).lower().compile()
            return
        dynamic, fixed = self._split(args, static)
        self._executable(args, static, dynamic, _signature(dynamic, fixed))

    def trace(self, *args: Any, **static: Any) -> Any:
        """jit's trace (inspection: the lowered text, its cost): never kept."""
        return self.jit.trace(*args, **static)

    def lower(self, *args: Any, **static: Any) -> Any:
        return self.jit.lower(*args, **static)

    def _split(self, args: tuple, static: dict) -> tuple[tuple, tuple]:
        """(dynamic positional arguments, the static ones by position and name)."""
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._static_argnums)
        fixed = tuple((i, a) for i, a in enumerate(args) if i in self._static_argnums)
        return dynamic, fixed + tuple(sorted(static.items()))

    def _executable(self, args: tuple, static: dict, dynamic: tuple, sig: tuple) -> Any:
        with self._lock:
            found = self._known.get(sig)
        if found is not None:
            return found
        store, key = _store, self._key(dynamic, sig[0])
        found = store and key and store.load(key, self.name)
        if found:
            with self._lock:
                self._unproven[sig] = key
        elif store and key:
            with _fresh() as fresh:
                found = self.jit.trace(*args, **static).lower().compile()
            if fresh():
                store.save(key, found, self.name)
        elif not found:
            found = self.jit.trace(*args, **static).lower().compile()
        with self._lock:
            self._known[sig] = found
        return found

    def _key(self, dynamic: tuple, fixed: tuple) -> str | None:
        """The text an executable of this call is stored under (None: not storable)."""
        leaves, tree = jax.tree.flatten(dynamic)
        lines = [f"program {self.name}: {self._made}", f"static {_text(fixed)}",
                 f"tree {tree}", *(f"arg {i}: {_leaf_text(x)}" for i, x in enumerate(leaves)),
                 f"mesh {_text(active_mesh())}", f"trace {_text(_trace_context())}",
                 *_environment()]
        key = "\n".join(lines)
        return None if " at 0x" in key else key


_fresh_lock = threading.Lock()
_fresh_count = 0  # compiles of ours running, JAX's persistent cache set aside meanwhile
_fresh_saved: tuple = ()
_thread = threading.local()  # JAX cache hits of the compile this thread runs


@contextlib.contextmanager
def _fresh() -> Iterator[Callable[[], bool]]:
    """A compile that JAX's persistent cache neither serves nor keeps while it runs; yields
    whether it was so (to be asked after). Only an executable XLA compiled here may be
    kept: one JAX loaded from its cache serializes without its code on a CPU, and its load
    then fails to run. JAX decides once per process whether its cache is in use
    (compilation_cache.is_cache_used): that answer is set aside while compiles of ours run
    (another program compiled meanwhile compiles without the cache, never wrongly)."""
    global _fresh_count, _fresh_saved
    from jax._src import compilation_cache as cc

    settable = all(hasattr(cc, a) for a in ("_cache_checked", "_cache_used",
                                            "_cache_initialized_mutex"))
    if settable:
        with _fresh_lock, cc._cache_initialized_mutex:
            if _fresh_count == 0:
                _fresh_saved = cc._cache_checked, cc._cache_used
                cc._cache_checked, cc._cache_used = True, False
            _fresh_count += 1
    hits = getattr(_thread, "hits", 0)
    try:
        yield lambda: settable and getattr(_thread, "hits", 0) == hits
    finally:
        if settable:
            with _fresh_lock, cc._cache_initialized_mutex:
                _fresh_count -= 1
                if _fresh_count == 0:
                    cc._cache_checked, cc._cache_used = _fresh_saved


def _count_jax_hits(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _thread.hits = getattr(_thread, "hits", 0) + 1


jax.monitoring.register_event_listener(_count_jax_hits)


def _signature(dynamic: tuple, fixed: tuple) -> tuple:
    """What tells two calls' executables apart within this process (as jit's cache does)."""
    leaves, tree = jax.tree.flatten(dynamic)
    return fixed, tree, active_mesh(), tuple(
        (jax.typeof(x), _layout(x.sharding, x.ndim), x.committed) if isinstance(x, jax.Array)
        else (type(x), np.shape(x), np.result_type(x)) for x in leaves)


def _layout(sharding: jax.sharding.Sharding, ndim: int) -> tuple:
    """How an argument lies on the devices, whatever object says so. A program's outputs may
    carry another sharding than the one its inputs were made with (on one device a cache
    allocated as P('data', None, 'tensor', None) comes back from a step as P()), and an
    executable runs either; keyed on the object, a program compiled ahead would be met
    again under another signature: traced again, or loaded again from disk."""
    try:
        return (str(sharding._to_xla_hlo_sharding(ndim)),
                tuple(d.id for d in sharding._device_assignment), sharding.memory_kind)
    except Exception:  # a sharding without JAX's private view: the object itself
        return (sharding,)


def _made(fun: Callable, **options: Any) -> str | None:
    """The function and the static configuration bound to it, as text (None: unstable)."""
    args: tuple = ()
    keywords: dict = {}
    while isinstance(fun, functools.partial):
        args, keywords = fun.args + args, {**fun.keywords, **keywords}
        fun = fun.func
    text = (f"{fun.__module__}.{fun.__qualname__} args {_text(args)} "
            f"keywords {_text(sorted(keywords.items()))} options {_text(sorted(options.items()))}")
    return None if " at 0x" in text else text


def _text(value: Any) -> str:
    """repr, with the devices of every sharding and mesh (their reprs leave them out)."""
    if isinstance(value, jax.sharding.Sharding):
        mesh = getattr(value, "mesh", None)
        return f"{value!r} on {_text(mesh) if mesh is not None else _device_ids(value)}"
    if isinstance(value, jax.sharding.Mesh):
        return f"{value!r} devices {[d.id for d in value.devices.flat]}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    return repr(value)


def _device_ids(sharding: Any) -> list[int]:
    return sorted(d.id for d in sharding.device_set)


def _leaf_text(x: Any) -> str:
    if isinstance(x, jax.Array):
        aval = jax.typeof(x)
        return (f"{aval.str_short()} weak={aval.weak_type} committed={x.committed} "
                f"sharding {_text(_layout(x.sharding, x.ndim))}")
    return f"{type(x).__name__} {np.shape(x)} {np.result_type(x)}"


def _trace_context() -> tuple:
    """JAX's configuration that changes what a function traces to (jit keys on it too)."""
    from jax._src import config

    return tuple(v if " at 0x" not in repr(v) else type(v).__name__
                 for v in config.trace_context())


@functools.cache
def _environment() -> tuple[str, ...]:
    devices = jax.devices()
    return (f"devices {devices[0].platform} {devices[0].device_kind!r} x{len(devices)} "
            f"backend {devices[0].client.platform_version!r}",
            f"jax {jax.__version__} jaxlib {jaxlib.__version__} numpy {np.__version__} "
            f"python {platform.python_version()}",
            f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r} "
            f"LIBTPU_INIT_ARGS {os.environ.get('LIBTPU_INIT_ARGS', '')!r}",
            f"eagle3kit source {source_digest()}")


@functools.cache
def source_digest() -> str:
    """sha256 over eagle3kit's Python files (their paths and contents)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


class _Store:
    def __init__(self, path: str, report: Report):
        self.path, self.report = path, report

    def file(self, key: str) -> str:
        return os.path.join(self.path, hashlib.sha256(key.encode()).hexdigest() + SUFFIX)

    def load(self, key: str, name: str) -> Any:
        """The executable stored under `key`, else None (reported unless simply absent)."""
        path, t0 = self.file(key), time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):  # none kept (the write says why)
            return None
        except OSError as e:
            self.report("read", f"{path}: {e.strerror or e}")
            return None
        try:
            executable = _decode(data, key)
        except Exception as e:  # whatever a damaged entry raises: compile instead
            self.report("read", f"{path}: {type(e).__name__}: {e}".splitlines()[0])
            return None
        jax.monitoring.record_event(HIT, fun_name=name)
        jax.monitoring.record_event_duration_secs(LOAD, time.perf_counter() - t0,
                                                  fun_name=name)
        return executable

    def discard(self, key: str, name: str, error: Exception) -> None:
        """A loaded entry that failed to run: reported and removed (compiled again)."""
        path = self.file(key)
        self.report("read", f"{path}: {name} loaded but failed to run "
                    f"({type(error).__name__}: {error})".splitlines()[0])
        with contextlib.suppress(OSError):
            os.unlink(path)

    def save(self, key: str, compiled: Any, name: str) -> None:
        t0 = time.perf_counter()
        try:
            data = _encode(key, compiled)
        except (ValueError, NotImplementedError, TypeError, pickle.PicklingError):
            return  # a program JAX cannot serialize (closed-over constants): not kept
        tmp = None
        try:
            os.makedirs(self.path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, suffix=".tmp",
                                             delete=False) as f:
                tmp = f.name
                os.fchmod(f.fileno(), 0o644)  # as JAX's entries: readable by who reads those
                f.write(data)
            os.replace(tmp, self.file(key))
        except OSError as e:
            self.report("write", f"{self.path}: {e.strerror or e}")
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return
        jax.monitoring.record_event_duration_secs(SAVE, time.perf_counter() - t0,
                                                  fun_name=name)


def _encode(key: str, compiled: Any) -> bytes:
    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    devices = [d.id for d in compiled._executable._unloaded_executable.device_list]
    payload = pickle.dumps((key, blob, in_tree, out_tree, devices))
    return MAGIC + hashlib.sha256(payload).digest() + payload


def _decode(data: bytes, key: str) -> Any:
    if not data.startswith(MAGIC):
        raise ValueError("not an entry of this format")
    digest, payload = data[len(MAGIC): len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("damaged (its checksum does not match)")
    stored, blob, in_tree, out_tree, ids = pickle.loads(payload)
    if stored != key:
        raise ValueError("another program's entry")
    by_id = {d.id: d for d in jax.devices()}
    if any(i not in by_id for i in ids):
        raise ValueError(f"made for devices {ids}, not all of this process's")
    devices = [by_id[i] for i in ids]
    return serialize_executable.deserialize_and_load(
        blob, in_tree, out_tree, backend=devices[0].client, execution_devices=devices)
