"""Ends a test session's SeaweedFS server when the session ends, however it ends.

Started by :func:`s3server.start` in a session of its own (no signal meant for the test run
reaches it): ``python s3watchdog.py PID DATA PORT...``. It waits while process ``PID`` (the
test run) lives and ``DATA`` (the server's folder) exists. When the test run is gone (killed
by ``timeout``, SIGKILL, a crash: no fixture teardown ran), it kills the server's process
group (recorded in ``DATA/weed.pgid``; the server ignores SIGTERM), removes ``DATA`` and the
sockets SeaweedFS leaves in /tmp for its ports, and exits. When ``DATA`` is gone (the
session stopped the server itself), it just exits.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import time
from pathlib import Path

#: SeaweedFS makes a unix socket per port, always in /tmp (not $TMPDIR), and keeps it.
SOCKETS = "/tmp/seaweedfs-*-{port}.sock"


def remove_sockets(ports: list[int]) -> None:
    """The sockets SeaweedFS made for ``ports`` and their gRPC twins (port + 10000)."""
    for port in ports:
        for twin in (port, port + 10000):
            for path in glob.glob(SOCKETS.format(port=twin)):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def end_server(data: Path, ports: list[int]) -> None:
    """Kill the server whose group ``data`` records, remove ``data`` and its sockets."""
    with contextlib.suppress(OSError, ValueError):
        os.killpg(int((data / "weed.pgid").read_text()), signal.SIGKILL)
    shutil.rmtree(data, ignore_errors=True)
    remove_sockets(ports)


def main() -> None:
    parent, data, ports = int(sys.argv[1]), Path(sys.argv[2]), [int(p) for p in sys.argv[3:]]

    def on_signal(*_args: object) -> None:
        end_server(data, ports)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while data.exists():
        # The test run is gone once this process is no longer its child.
        if os.getppid() != parent:
            end_server(data, ports)
            return
        time.sleep(0.2)


if __name__ == "__main__":
    main()
