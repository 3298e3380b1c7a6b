"""The ``fsdpckpt`` command, warm, for the docs' shell blocks (tests/test_docs.py).

A new ``fsdpckpt`` process spends about 1.3 s importing torch before it does anything; the
docs run about a hundred such commands. :func:`start` launches one server process that
imports torch and fsdpckpt's command line once, and writes a ``fsdpckpt`` shim into a folder
to put first on ``PATH``. The shim (plain Python, no site-packages: milliseconds) hands the
server its arguments, working folder, environment and its standard input, output and error
(the descriptors themselves, over a Unix socket); the server forks, and the child takes
them over and runs :func:`fsdpckpt.__main__.run`, the console script's own function, then
sends the exit status back, which the shim exits with. A signal the shim gets (Ctrl-C,
SIGTERM) is passed on to the child. The console script itself is tested on its own
(tests/test_entry_point.py).

Run as ``python warmcli.py SOCKET``: the server (it ends when its parent, the test session,
closes the pipe on its standard input).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["start"]

_SHIM = """#!{python} -SE
import json, os, signal, socket, struct, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect({path!r})
request = {{"argv": ["fsdpckpt", *sys.argv[1:]], "cwd": os.getcwd(), "env": dict(os.environ)}}
socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
pid = struct.unpack("!i", conn.recv(4))[0]
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(number, lambda n, _f: os.kill(pid, n))
answer = conn.recv(4)
sys.exit(struct.unpack("!i", answer)[0] if len(answer) == 4 else 1)
"""


@contextlib.contextmanager
def start(folder: Path) -> Iterator[Path]:
    """A running server and its shim: the folder (in ``folder``) to put first on ``PATH``."""
    path = str(folder / "fsdpckpt.sock")
    bin_folder = folder / "bin"
    bin_folder.mkdir(parents=True)
    shim = bin_folder / "fsdpckpt"
    shim.write_text(_SHIM.format(python=sys.executable, path=path))
    shim.chmod(0o755)
    server = subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.PIPE,
                              cwd=folder)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm fsdpckpt server did not start ({server.returncode})")
            time.sleep(0.05)
        yield bin_folder
    finally:
        assert server.stdin is not None
        server.stdin.close()  # the server's signal to end
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _serve(path: str) -> None:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as fsdpckpt.__main__.run sets it
    import torch  # noqa: F401 - the warm part: imported once, before any fork

    import fsdpckpt.__main__
    import fsdpckpt.cli  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # there once it accepts
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:  # the test session ended (its pipe closed)
            return
        conn, _ = listener.accept()
        message, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            os._exit(_child(conn, message, fds))
        for fd in fds:
            os.close(fd)
        conn.close()


def _child(conn: socket.socket, message: bytes, fds: list[int]) -> int:
    import json

    for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    request = json.loads(message)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own, never closed
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    conn.send(struct.pack("!i", os.getpid()))
    code: int | str | None
    try:
        from fsdpckpt.__main__ import run

        run()
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - shown as the console script would show it
        import traceback

        traceback.print_exc()
        code = 1
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
    status = code if isinstance(code, int) else (0 if code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(struct.pack("!i", status))
    return status


if __name__ == "__main__":
    _serve(sys.argv[1])
