"""Review of issue 21's fast paths: what the CRC thread must not cost the callers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from chunked import split, write_dcp

ROOT = Path(__file__).resolve().parent.parent


def test_a_diff_and_a_merge_run_from_an_atexit_handler(tmp_path):
    # At exit the interpreter shuts thread pools down before atexit handlers run: the CRC
    # thread can take no more work then, and a checked read must sum its bytes itself
    # rather than fail with concurrent.futures' RuntimeError (diff summed every byte on
    # the CRC thread since issue 21, a merge its blocks).
    value = torch.randn(256, 192, generator=torch.Generator().manual_seed(0))
    write_dcp(tmp_path / "a", {"w": (value, split([0]))})
    write_dcp(tmp_path / "b", {"w": (value, split([1]))})
    code = ("import atexit, sys, fsdpckpt\n"
            "def at_exit():\n"
            "    report = fsdpckpt.diff(sys.argv[1], sys.argv[2])\n"
            "    fsdpckpt.merge(sys.argv[1], sys.argv[3])\n"
            "    print('equal', report.equal)\n"
            "atexit.register(at_exit)\n"
            "fsdpckpt.diff(sys.argv[1], sys.argv[2])  # the CRC thread started before exit\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), str(tmp_path / "b"),
                          str(tmp_path / "merged")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.stdout.strip() == "equal True", out.stderr
    assert (tmp_path / "merged").is_dir()


def test_a_reader_failing_beside_the_whole_entry_check_does_not_wait_for_all_of_it(
        tmp_path, monkeypatch):
    # A column-major chunk's storage is summed on the CRC thread while its tiles are placed
    # (verify_entry_beside). When the placing fails (Ctrl-C, SIGTERM turned into an
    # exception, a full disk), the pass is stopped at its next block, not read to its end
    # first: for a large chunk that is the whole storage's read, seconds to minutes during
    # which Ctrl-C seems ignored (and a SIGTERM's grace period runs out before cleanup).
    import time

    import pytest

    from fsdpckpt._io import checksums
    from fsdpckpt.dcp import _checked

    size = 64 << 20
    path = tmp_path / "entry"
    with open(path, "wb") as file:
        file.truncate(size)
    read: list[int] = []
    real = checksums.pread_into

    def slow(fd, view, offset, *, source):  # 256 blocks of 256 KiB: half a second in all
        time.sleep(0.002)
        read.append(len(view))
        real(fd, view, offset, source=source)

    monkeypatch.setattr(checksums, "pread_into", slow)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(KeyboardInterrupt), \
                _checked.verify_entry_beside(set(), "entry", fd, 0, size, 0, source="entry"):
            raise KeyboardInterrupt
    finally:
        os.close(fd)
    assert sum(read) < size // 4
