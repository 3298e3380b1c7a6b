"""The torch-free export casts give torch's own bits, and leave NaN to torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt.merging import _casts as casts

from chunked import split, write_dcp
from conftest import DCP_FOLDERS

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _torch_bits(src_bits: np.ndarray, source: str, target: str) -> np.ndarray:
    value = torch.from_numpy(src_bits).view(_TORCH[source])
    return value.to(_TORCH[target]).view(torch.int16 if target != "float32" else torch.int32) \
        .numpy().view(np.uint16 if target != "float32" else np.uint32)


def _fast_bits(src_bits: np.ndarray, source: str, target: str) -> np.ndarray:
    out = np.zeros(len(src_bits), dtype=np.uint32 if target == "float32" else np.uint16)
    assert casts.fast_cast(source, target)(memoryview(src_bits).cast("B"),
                                           memoryview(out).cast("B"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("target", ["bfloat16", "float16"])
def test_fast_float32_casts_match_torch_on_every_bit_pattern(target):
    # Blocks of 2**15: small enough to stay in cache (2**22 ran 5x slower) and below torch's
    # grain size, so its cast runs on one thread (parallel regions stall on a busy machine).
    step = 2**15
    offsets = np.arange(step, dtype=np.uint32)
    fast = casts.fast_cast("float32", target)
    bits = np.empty(step, dtype=np.uint32)
    got = np.empty(step, dtype=np.uint16)
    for start in range(0, 2**32, step):
        if start & 0x7FFFFFFF > 0x7F800000:
            continue  # a block of NaNs only: those are torch's (see below)
        np.add(offsets, np.uint32(start), out=bits)
        block = bits
        if start & 0x7FFFFFFF == 0x7F800000:  # infinity, then NaNs: the one block holding both
            block = bits[(bits & np.uint32(0x7FFFFFFF)) <= np.uint32(0x7F800000)]
        out = got[:len(block)]
        assert fast(memoryview(block).cast("B"), memoryview(out).cast("B"))
        want = torch.from_numpy(block).view(torch.float32).to(_TORCH[target])
        if not np.array_equal(out, want.view(torch.int16).numpy().view(np.uint16)):
            raise AssertionError(f"{target}: block at {start:#x} differs from torch")


def test_fast_bf16_widening_matches_torch_on_every_bit_pattern():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    bits = bits[(bits & 0x7FFF) <= 0x7F80]
    np.testing.assert_array_equal(_fast_bits(bits, "bfloat16", "float32"),
                                  _torch_bits(bits, "bfloat16", "float32"))


@pytest.mark.parametrize("source,target,nan", [("float32", "bfloat16", 0x7FC00001),
                                               ("float32", "float16", 0xFF800001),
                                               ("bfloat16", "float32", 0x7FC1)])
def test_a_block_holding_nan_is_left_to_torch(source, target, nan):
    src = np.array([0, nan, 7], dtype=np.uint16 if source == "bfloat16" else np.uint32)
    dst = bytearray(3 * (4 if target == "float32" else 2))
    assert not casts.fast_cast(source, target)(memoryview(src).cast("B"), memoryview(dst))
    assert dst == bytearray(len(dst))  # untouched
    casts.cast_block(source, target, memoryview(src).cast("B"), memoryview(dst))
    assert bytes(dst) == _torch_bits(src, source, target).tobytes()


def test_casts_torch_has_no_fast_form_for_are_none():
    assert casts.fast_cast("float64", "bfloat16") is None
    assert casts.fast_cast("float16", "float32") is None


@pytest.mark.parametrize("target", ["bf16", "fp16", "fp32"])
def test_an_export_without_numpy_gives_the_same_bytes(tmp_path, monkeypatch, target):
    value = torch.randn(64, 48).to(torch.bfloat16 if target == "fp32" else torch.float32)
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, split([0])), "v": (value, split([1]))})
    (fast,) = fsdpckpt.merge(folder, tmp_path / "fast", dtype=target)
    monkeypatch.setattr(casts, "_numpy", lambda: None)
    (slow,) = fsdpckpt.merge(folder, tmp_path / "slow", dtype=target)
    assert fast.path.read_bytes() == slow.path.read_bytes()
    want = value.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[target])
    assert torch.equal(load_file(fast.path)["w"], want)


def test_a_bf16_export_of_an_fsdp_checkpoint_does_not_import_torch(tmp_path):
    code = (f"import sys, fsdpckpt\nfsdpckpt.merge({str(DCP_FOLDERS['fsdp2-model'])!r}, "
            f"{str(tmp_path / 'out')!r}, dtype='bf16')\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
