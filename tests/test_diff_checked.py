"""diff reads each chunk once, checking its CRC-32 as the tiles read it (issue 21).

Before, every chunk was read whole against its CRC, then read again tile by tile to be
compared. Now the tiles' reads are summed as they come (the CRC on the other core), the rest
of a chunk not read in storage order is read when the tensor is done, and a mismatch still
raises before anything is said of the tensor. Identical sides laid out alike are compared
as bytes, without importing torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import fsdpckpt
from fsdpckpt import ChecksumError
from fsdpckpt.dcp._checked import CheckedRead
from fsdpckpt.inspection import _diff_sources

from chunked import flip_stored_byte, split, write_dcp

ROOT = Path(__file__).resolve().parent.parent

# 2048x1024 fp32 in two dim-0 chunks: each chunk is two of diff's tiles (2^19 elements).
LAYOUTS = {"dim0": split([0]), "dim1": split([1]), "transposed": split([0], transpose=True)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("diff-checked")
    value = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0))
    for name, layout in LAYOUTS.items():
        write_dcp(root / name, {"w": (value, layout)})
    save_file({"w": value}, str(root / "ref.safetensors"))
    return root, value


def _flip(folder: Path, where: float, chunk_index: int) -> None:
    flip_stored_byte(folder, chunk=chunk_index, where=where)


@pytest.mark.parametrize("other", ["dim0", "dim1", "transposed", "ref.safetensors"])
@pytest.mark.parametrize("where", [0.0, 0.3, 0.75, 1.0])
def test_a_flipped_bit_anywhere_in_a_chunk_raises_whatever_the_other_side(folders, other,
                                                                          where, tmp_path):
    root, _ = folders
    damaged = Path(shutil.copytree(root / "dim0", tmp_path / "damaged"))
    _flip(damaged, where, chunk_index=1)
    for a, b in ((damaged, root / other), (root / other, damaged)):
        with pytest.raises(ChecksumError, match="CRC-32"):
            fsdpckpt.diff(a, b)


@pytest.mark.parametrize("layout", ["dim1", "transposed"])
def test_a_flipped_bit_in_a_side_read_out_of_its_storage_order_raises(folders, layout,
                                                                      tmp_path):
    # The other side leads the tiles: this side's chunk is checked whole when it is done.
    root, _ = folders
    damaged = Path(shutil.copytree(root / layout, tmp_path / "damaged"))
    _flip(damaged, 0.5, chunk_index=0)
    for a, b in ((root / "dim0", damaged), (damaged, root / "dim0")):
        with pytest.raises(ChecksumError, match="CRC-32"):
            fsdpckpt.diff(a, b)


@pytest.mark.parametrize("other", ["dim0", "dim1", "transposed", "ref.safetensors"])
def test_untouched_sides_are_identical_in_every_layout_pair(folders, other):
    root, _ = folders
    for a, b in ((root / "dim0", root / other), (root / other, root / "transposed")):
        report = fsdpckpt.diff(a, b)
        assert report.equal and all(t.identical for t in report.tensors), report.differing


def test_one_changed_element_is_still_found_among_identical_tiles(folders, tmp_path):
    root, value = folders
    changed = value.clone()
    changed[1500, 7] = torch.nextafter(changed[1500, 7], torch.tensor(float("inf")))
    write_dcp(tmp_path / "changed", {"w": (changed, split([0]))})
    report = fsdpckpt.diff(root / "dim0", tmp_path / "changed")
    assert [(t.name, t.mismatched, t.identical) for t in report.differing] == [("w", 1, False)]


def test_identical_checkpoints_are_compared_without_importing_torch(folders):
    root, _ = folders
    code = ("import sys, fsdpckpt\n"
            "report = fsdpckpt.diff(sys.argv[1], sys.argv[2])\n"
            "assert report.equal and report.tensors[0].identical\n"
            "print('torch' in sys.modules)\n")
    for other in ("dim0", "ref.safetensors"):
        out = subprocess.run([sys.executable, "-c", code, str(root / "dim0"), str(root / other)],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.stdout.strip() == "False", other


def test_a_finished_check_stays_finished(tmp_path):
    # Several tensors a diff reads from one stored entry (a trainer's fused gate_up_proj,
    # split into experts) finish its check each: the second finish, and reads after the
    # first, must not compare a partial CRC with the entry's.
    data = os.urandom(3 * 4096)
    path = tmp_path / "entry"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        checked = CheckedRead(fd, 0, len(data), zlib.crc32(data), source="entry")
        checked.read_at(memoryview(bytearray(4096)), 0, later=True)
        checked.finish()
        checked.read_at(memoryview(bytearray(4096)), 8192, later=True)
        checked.read_at(memoryview(bytearray(4096)), 0)
        checked.finish()
    finally:
        os.close(fd)


def test_the_byte_comparison_without_numpy_gives_the_same_answers(monkeypatch):
    a = torch.tensor([0.0, float("nan"), 1.0])
    b = torch.tensor([-0.0, float("nan"), 1.0])
    answers = [_diff_sources.same_bits(a, a.clone()), _diff_sources.same_bits(a, b),
               _diff_sources.same_bytes(memoryview(b"abc"), memoryview(b"abc")),
               _diff_sources.same_bytes(memoryview(b"abc"), memoryview(b"abd"))]
    assert answers == [True, False, True, False]
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy now raises ImportError
    assert [_diff_sources.same_bits(a, a.clone()), _diff_sources.same_bits(a, b),
            _diff_sources.same_bytes(memoryview(b"abc"), memoryview(b"abc")),
            _diff_sources.same_bytes(memoryview(b"abc"), memoryview(b"abd"))] == answers
