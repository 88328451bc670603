"""Several eagle3kit processes on one GPU (evaluations side by side, a regeneration beside a
training run): each takes a share of the memory that is free, or stops with one line.

JAX preallocates a fixed fraction of each GPU's *total* memory when its backend starts
(XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default). A second process on a GPU the first
already holds three quarters of cannot have that, and what then fails is outside Python:
the allocator, or a CUDA library starting with no memory left, aborts the process with a
C++ stack dump. So before the backend starts, `share_gpu` asks the driver (nvidia-smi) how
much of each visible GPU is free and

- leaves JAX's default alone where it fits (a GPU nobody else uses);
- where it does not, and the user set no fraction, sets XLA_PYTHON_CLIENT_MEM_FRACTION to what
  is free less a reserve for the process's own CUDA context and library workspaces, and
  says so in one line;
- refuses in one line (exit 4) where the user's own fraction does not fit, or where what is
  free is too little to work in.

Processes started at the same moment would all see an empty GPU: the measurement and the
backend's start (which takes the pool) are done under a lock file every eagle3kit process
on the host takes, so they start one after another. Processes of a multi-host run
(jax.distributed) start their backends together and are left alone, as are processes told
not to preallocate (XLA_PYTHON_CLIENT_PREALLOCATE=false, or the platform allocator).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping

from eagle3kit.errors import ResourceError, UserError, device_out_of_memory, first_line

FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_FRACTION = 0.75  # JAX's own, where the variable is not set
GiB = 2**30
MIN_POOL = 1 * GiB  # less than this to work in: refused rather than started
LOCK_WAIT_S = 300  # a start that holds the lock longer has hung; go on without it


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: str
    total: int  # bytes
    free: int

    def reserve(self) -> int:
        """Memory a process needs outside JAX's pool (its CUDA context, cuBLAS and cuDNN
        workspaces, autotuning scratch): 2 GiB, or 5% of a larger card."""
        return max(2 * GiB, self.total // 20)


def query_gpus() -> list[Gpu] | None:
    """The GPUs this process will see (CUDA_VISIBLE_DEVICES by index or UUID), as the
    driver reports them now; None where that cannot be told (no nvidia-smi, MIG slices)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,uuid,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line]
        gpus = {(i, uuid): Gpu(i, int(total) * 2**20, int(free) * 2**20)
                for i, uuid, total, free in rows}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(gpus.values()) or None
    chosen = []
    for name in filter(None, (v.strip() for v in visible.split(","))):
        found = [g for (i, uuid), g in gpus.items() if name == i or
                 (name.startswith("GPU-") and uuid.startswith(name))]
        if not found:
            return None  # MIG-..., or ids this cannot map: let JAX decide
        chosen += found
    return chosen or None


def plan(gpus: list[Gpu], env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the fraction to set, the line that says so), (None, None) where JAX's own setting
    fits every GPU; a `ResourceError` where nothing that fits is worth starting."""
    given = env.get(FRACTION)
    try:
        fraction = float(given) if given else DEFAULT_FRACTION
    except ValueError:
        raise UserError(f"{FRACTION}={given!r}: not a number (a share of each GPU's memory, "
                        "e.g. 0.3)") from None
    # a fraction the user chose is trusted with what the pool leaves (0.94 for a model that
    # needs it, on a GPU of its own); JAX's default must leave the reserve
    short = [g for g in gpus if fraction * g.total + (0 if given else g.reserve()) > g.free]
    if not short:
        return None, None
    g = min(short, key=lambda g: (g.free - g.reserve()) / g.total)
    fits = max(0, int(100 * (g.free - g.reserve()) / g.total)) / 100
    state = (f"GPU {g.index} has {g.free / GiB:.1f} of its {g.total / GiB:.1f} GiB free "
             "(other processes hold the rest)")
    if fits * g.total < MIN_POOL:
        raise ResourceError(f"{state}, too little to start in: wait for them to end, or give "
                            f"each process a share, e.g. {FRACTION}=0.3 for three")
    if given:
        raise ResourceError(f"{state}: {FRACTION}={given} asks for "
                            f"{fraction * g.total / GiB:.1f} GiB; set it to {fits:.2f} or "
                            "less, or free the GPU")
    return f"{fits:.2f}", (f"note: {state}: this process takes {fits:.2f} of its memory "
                           f"({FRACTION}={fits:.2f}; set it to choose)")


def share_gpu(warn: Callable[[str], None]) -> None:
    """Sets this process's share of the GPU and starts JAX's backend, under the host's start
    lock; see the module docstring. Call before anything starts the backend."""
    if not _may_start_gpu():
        return
    with _start_lock():
        gpus = query_gpus()
        if gpus:
            fraction, note = plan(gpus, os.environ)
            if fraction is not None:
                os.environ[FRACTION] = fraction
                warn(note)
        _start_backend(gpus)


def _may_start_gpu() -> bool:
    """Whether this process's backend is still to start, may be a GPU's, preallocates, and
    is not one of a multi-host run's (whose backends start together: no lock between)."""
    import jax
    from jax._src import distributed, xla_bridge

    platforms = jax.config.jax_platforms or ""
    return not (xla_bridge.backends_are_initialized()
                or (platforms and not {"cuda", "gpu"} & set(platforms.split(",")))
                or os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0")
                or os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform"
                or distributed.global_state.client is not None
                or shutil.which("nvidia-smi") is None or not _cuda_plugin())


def _cuda_plugin() -> bool:
    """Whether JAX has a CUDA plugin to start (without one, a GPU is not this process's)."""
    import importlib.metadata
    import pkgutil

    try:
        import jax_plugins

        names = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        names = []
    names += [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    return any("cuda" in name for name in names)


def _start_backend(gpus: list[Gpu] | None) -> None:
    """Starts the backend and allocates on every local device, so the pool is taken before
    the lock is let go; a GPU that could not start for want of memory is one line, exit 4
    (JAX would otherwise fall back to the CPU with a log message)."""
    import jax
    from jax._src import xla_bridge

    advice = (f"another process may hold its memory: give each process a share, e.g. "
              f"{FRACTION}=0.3, or wait for them to end")
    try:
        for device in jax.local_devices():
            jax.device_put(0, device).block_until_ready()
    except Exception as e:
        if device_out_of_memory(e):
            raise ResourceError(f"out of GPU memory starting JAX; {advice}") from None
        raise
    error = xla_bridge._backend_errors.get("cuda")
    if gpus and jax.default_backend() == "cpu" and error:
        raise ResourceError(f"the GPU did not start ({first_line(error)}); {advice}")


@contextlib.contextmanager
def _start_lock() -> Iterator[None]:
    """An exclusive lock on a file every eagle3kit process of this host opens (read-only, so
    any user may lock a file another user made); given up after LOCK_WAIT_S."""
    path = os.path.join(tempfile.gettempdir(), "eagle3kit-gpu-start.lock")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            yield  # no lock to be had: start as JAX would
            return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # lets go of the lock
