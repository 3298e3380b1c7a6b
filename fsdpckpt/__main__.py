"""``python -m fsdpckpt`` and the ``fsdpckpt`` command: the command line's entry point.

Kept tiny on purpose: the command line imports click, tqdm and, for some commands, torch,
which takes seconds; a Ctrl-C during those imports must still end in the one error line,
not a traceback.
"""

from __future__ import annotations

import os
import sys


def run() -> None:
    """Run the command line, exiting with its status.

    Under torchrun, after the process group fsdpckpt made is destroyed, the process ends
    with ``os._exit``: with torch 2.13, gloo's threads abort about one exit in six
    ("terminate called without an active exception", SIGABRT) while C++ statics are torn
    down, which would replace the exit status and the error line. Output is flushed first.
    """
    code: int | str | None
    # numpy (the torch-free casts and transposes) starts OpenBLAS's thread pool when it is
    # imported; those threads spin waiting for matrix maths numpy is never asked for here,
    # on the cores the copies need (a 2.4 GB column-major merge: 3.24 s of CPU, 3.00 s with
    # one thread). The command line's only such maths, a LoRA fuse's products, is torch's
    # (one thread where torch itself uses OpenBLAS: a small share of a fused export). A
    # user's own setting wins; a library caller's process is left as it is.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import signal  # under the package's start-up guard: a Ctrl-C here is its one line

    try:
        if signal.getsignal(signal.SIGINT) is _started_guard():
            # The package's start-up guard (fsdpckpt/__init__.py) hands over to Python's
            # own: from here a Ctrl-C is a KeyboardInterrupt, which the cleanups expect.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        from fsdpckpt.cli import main

        main(prog_name="fsdpckpt")
        code = 0
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # before the command's own error boundary was reached
        sys.stderr.write("fsdpckpt: error: interrupted\n")
        code = 130  # 128 + SIGINT, as shells report it
    except Exception as exc:
        from fsdpckpt.errors import interruption  # loaded with the package already

        if interruption(exc) is None:
            raise
        # A Ctrl-C Python wrapped while an import built a class (3.11's __set_name__)
        sys.stderr.write("fsdpckpt: error: interrupted\n")
        code = 130
    status = code if isinstance(code, int) else (0 if code is None else 1)
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    _distributed = sys.modules.get("fsdpckpt.merging._distributed")
    if _distributed is not None and getattr(_distributed, "made_a_process_group", False):
        os._exit(status)
    # The command is over and its output flushed: a Ctrl-C while Python shuts down (joining
    # threads, tearing down modules) ends the process at once with the command's status,
    # not with a KeyboardInterrupt traceback from threading._shutdown. Nothing of ours is
    # left to clean up: no atexit handler is registered.
    signal.signal(signal.SIGINT, lambda *_: os._exit(status))
    sys.exit(status)


def _started_guard() -> object:
    return getattr(sys.modules.get("fsdpckpt"), "_interrupted_at_start", None)


if __name__ == "__main__":
    run()
