"""`eagle3kit` as a fork server for tests that run many commands as processes: each command is
a process of its own, with its own arguments, working directory, environment, standard
streams and exit status, forked from a server that has imported eagle3kit, JAX and
transformers once. A fresh `python -m eagle3kit` spends 2-3 s of CPU on those imports before
doing anything, and a toy recipe run is a dozen short commands.

    python warm_cli.py serve SOCKET      the server (prints "ready" once it listens)
    python -I warm_cli.py SOCKET ARGS    one command: what E3K is in the recipe tests

From Python: `serving(env)` starts a server, `Command(socket, args)` runs one command and
gives its pid (to signal the command itself) and `wait()` its exit status as subprocess
gives it (-N: killed by signal N). A command may run a module instead of eagle3kit's main
(`module=`, as `python -m MODULE ARGS`).

The server forks before JAX initializes a backend (it only imports), so each command
initializes its own, as a fresh process does. JAX reads its JAX_* settings when imported:
the server's environment gives them, a command's own environment gives everything else.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_FDS = 3  # the client's stdin, stdout and stderr
PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL


class Command:
    """One command run by the server at `path`: ARGS to eagle3kit (or to `module`), its
    stdin, stdout and stderr each this process's own (None), a file descriptor, DEVNULL or
    PIPE (then `.stdout`/`.stderr` read it, as subprocess.Popen's do; bytes, or str with
    `text`). `pid` is the command's own process: signal it as a Popen."""

    def __init__(self, path: str | Path, args: list[str], *, module: str | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 stdin: int | None = None, stdout: int | None = None,
                 stderr: int | None = None, text: bool = False):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(path))
        request = json.dumps({"args": [str(a) for a in args], "module": module,
                              "cwd": str(cwd or os.getcwd()),
                              "env": dict(os.environ if env is None else env)})
        fds, sent, pipes = [], [], []  # what the command gets, what to close, what we read
        for own, spec in enumerate((stdin, stdout, stderr)):
            read = None
            if spec == DEVNULL:
                spec = os.open(os.devnull, os.O_RDWR)
                sent.append(spec)
            elif spec == PIPE and own > 0:
                read, spec = os.pipe()
                sent.append(spec)
            fds.append(own if spec is None else spec)
            pipes.append(None if read is None else open(read, "r" if text else "rb"))
        try:
            socket.send_fds(self._sock, [request.encode() + b"\n"], fds)
        finally:
            for fd in sent:  # the command holds its own copies
                os.close(fd)
        self.stdin, self.stdout, self.stderr = pipes
        self.pid = int(self._line() or 0)
        self.returncode: int | None = None

    def _line(self) -> str:
        out = b""
        while not out.endswith(b"\n") and (byte := self._sock.recv(1)):
            out += byte
        return out.decode()

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
            return self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._sock.settimeout(timeout)
            status = self._line()
            self._sock.close()
            self.returncode = int(status) if status else 1
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """What is left in the stdout and stderr pipes (read one after the other: for
        commands that write little), once the command has ended."""
        out = [p.read() if p else None for p in (self.stdout, self.stderr)]
        self.wait(timeout)
        return out[0], out[1]


def client(path: str, args: list[str]) -> int:
    return Command(path, args).wait()


@contextlib.contextmanager
def serving(env: dict[str, str]):
    """A server in the environment `env` for the duration: yields its socket's path."""
    sock = Path(tempfile.mkdtemp(prefix="e3k-")) / "s"  # a short path: sockets take 107 bytes
    server = subprocess.Popen([sys.executable, __file__, "serve", str(sock)], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "ready\n", "the eagle3kit fork server did not start"
        yield sock
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(sock.parent, ignore_errors=True)


def _command(conn: socket.socket) -> None:
    """In a forked child: become the client's command, run it, exit with its status."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, _FDS)
    with conn.makefile("rb") as rest:
        request = json.loads(msg + (b"" if msg.endswith(b"\n") else rest.readline()))
    command = os.fork()
    if command:  # this process reports the command's pid, then its exit status however it ended
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{command}\n".encode())
        _, status, usage = os.wait4(command, 0)
        if log := os.environ.get("E3K_CPU_LOG"):  # tests/cpu_profile.py counts it
            with open(log, "a") as f:
                f.write(f"{usage.ru_utime + usage.ru_stime}\n")
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        os._exit(0)
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    code = 0
    try:
        if request.get("module"):
            import runpy
            sys.argv = [request["module"], *request["args"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["eagle3kit", *request["args"]]
            from eagle3kit.cli.app import main
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    import atexit
    atexit._run_exitfuncs()  # what a process does on its way out (XLA, logging, files)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    import jax  # noqa: F401
    import jax.numpy  # noqa: F401
    import transformers  # noqa: F401
    from jax._src import xla_bridge
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    import eagle3kit.cli.app  # noqa: F401
    from eagle3kit.jobs import evaluate, regenerate, train  # noqa: F401
    assert not xla_bridge._backends, "a backend before fork: every command would share it"
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters reap themselves
    parent = os.getppid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
        s.listen(16)
        s.settimeout(1)
        print("ready", flush=True)
        while True:
            try:
                conn, _ = s.accept()  # a blocking socket (no default timeout)
            except TimeoutError:
                if os.getppid() != parent:  # the test process is gone, however it ended
                    return
                continue
            if os.fork() == 0:
                s.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _command(conn)
            conn.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1], sys.argv[2:]))
