"""A tensor past 2 GiB stored in another dim order merges exactly, in flat memory: its boxes
of whole rows (``merging/_gather.py``) read their stored runs and write their rows at offsets
past 2 GiB, and every byte is checked beside them. A module of its own, so that the 2.25 GiB
of ``test_large_tensors.py`` are gone from the disk before these are written."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from chunked import whole, write_dcp

pytestmark = pytest.mark.slow

STORED = (6, 24_576, 4_096)  # 2.25 GiB of int32, every element different


def test_a_permuted_tensor_past_2_gib_merges_exactly_in_flat_memory(tmp_path):
    from safetensors import safe_open

    value = torch.arange(STORED[0] * STORED[1] * STORED[2], dtype=torch.int32).view(
        STORED).permute(1, 0, 2)  # torch.save keeps the strides: (4096, 24576 * 4096, 1)
    assert not value.is_contiguous() and value.nbytes > 2**31
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, whole)})
    code = (f"import fsdpckpt\nfrom fsdpckpt.merging import _copy\n"
            "boxes = []\nread = _copy.read_box\n"
            "_copy.read_box = lambda *a, **k: (boxes.append(1), read(*a, **k))[1]\n"
            f"fsdpckpt.merge({str(folder)!r}, {str(tmp_path / 'out')!r})\n"
            "assert boxes, 'not placed in boxes'\n"
            "print(open('/proc/self/status').read())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", done.stdout).group(1)) / 1024
    assert peak < 300, peak
    expected = value.contiguous()
    del value
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as merged:
        got = merged.get_tensor("w")
    tail = slice(2**31 // 4 // (STORED[0] * STORED[2]) - 1, None)  # rows from byte 2 GiB on
    assert torch.equal(got[tail], expected[tail])
    assert torch.equal(got, expected)
