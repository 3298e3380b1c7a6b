"""The SeaweedFS server a test run starts ends with the run, however the run ends (issue 33):
killed by ``timeout`` or SIGKILL (no fixture teardown runs), its watchdog kills the server
(which ignores SIGTERM) and removes its data folder and the sockets it leaves in /tmp."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import s3server

pytestmark = [pytest.mark.s3,
              pytest.mark.skipif(s3server.weed_binary() is None, reason="no weed binary")]

_TESTS = Path(__file__).resolve().parent

#: A test run that starts a server, says where it is, and waits to be killed.
_RUN = ("import json, sys, time\nsys.path.insert(0, sys.argv[1])\nimport s3server\n"
        "server = s3server.start()\n"
        "print(json.dumps({'data': str(server.data), 'pid': server.process.pid, "
        "'ports': server.ports, 'watchdog': server.watchdog.pid}), flush=True)\n"
        "time.sleep(600)\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie no one reaped yet is gone too.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1][0] != "Z"


def _sockets(ports) -> list[str]:
    return [p for port in ports for twin in (port, port + 10000)
            for p in glob.glob(f"/tmp/seaweedfs-*-{twin}.sock")]


def _gone(started: dict, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not (_alive(started["pid"]) or _alive(started["watchdog"]) or
                Path(started["data"]).exists() or _sockets(started["ports"])):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_test_run_leaves_no_server_folder_or_socket(how):
    run = subprocess.Popen([sys.executable, "-c", _RUN, str(_TESTS)], stdout=subprocess.PIPE,
                           text=True)
    try:
        started = json.loads(run.stdout.readline())
        assert _alive(started["pid"]) and Path(started["data"]).is_dir()
        assert _sockets(started["ports"])  # what SeaweedFS leaves in /tmp
    finally:
        run.send_signal(how)
        run.wait()
    assert _gone(started), started


def test_a_server_stopped_by_its_session_leaves_nothing():
    server = s3server.start()
    started = {"pid": server.process.pid, "watchdog": server.watchdog.pid,
               "data": str(server.data), "ports": server.ports}
    server.kill()
    server.stop()
    assert _gone(started, within=5.0), started


def test_its_logs_go_into_its_own_folder_not_tmp():
    before = set(glob.glob("/tmp/weed*"))
    server = s3server.start()
    try:
        assert any(name.startswith("weed.") for name in os.listdir(server.data))
    finally:
        server.kill()
        server.stop()
    assert set(glob.glob("/tmp/weed*")) == before
