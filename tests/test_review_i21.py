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
