"""`eagle3kit` for the recipe tests, as a fork server: each command a recipe runs is a process
of its own, with its own arguments, working directory, environment, standard streams and exit
status, forked from a server that has imported eagle3kit, JAX and transformers once. A fresh
`python -m eagle3kit` spends 2-3 s of CPU on those imports before doing anything, and a toy
recipe run is a dozen short commands.

    python warm_cli.py serve SOCKET      the server (prints "ready" once it listens)
    python -I warm_cli.py SOCKET ARGS    one command: what E3K is in the recipe tests

The server forks before JAX initializes a backend (it only imports), so each command
initializes its own, as a fresh process does.
"""

from __future__ import annotations

import json
import os
import socket
import sys

_FDS = 3  # the client's stdin, stdout and stderr


def client(path: str, args: list[str]) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)})
        socket.send_fds(s, [request.encode() + b"\n"], [0, 1, 2])
        status = s.makefile("rb").readline()
    return int(status) if status else 1


def _command(conn: socket.socket) -> None:
    """In a forked child: become the client's command, run it, exit with its status."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, _FDS)
    with conn.makefile("rb") as rest:
        request = json.loads(msg + (b"" if msg.endswith(b"\n") else rest.readline()))
    command = os.fork()
    if command:  # this process waits and reports the command's exit status, however it ended
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(command, 0)
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        os._exit(0)
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["eagle3kit", *request["args"]]
    code = 0
    try:
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
    import signal

    import jax  # noqa: F401
    import jax.numpy  # noqa: F401
    import transformers  # noqa: F401
    from jax._src import xla_bridge
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    import eagle3kit.cli.app  # noqa: F401
    from eagle3kit.jobs import evaluate, regenerate, train  # noqa: F401
    assert not xla_bridge._backends, "a backend before fork: every command would share it"
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters reap themselves
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
        s.listen(16)
        print("ready", flush=True)
        while True:
            conn, _ = s.accept()
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
