"""File CRCs recorded while writing equal zlib's CRC of the file, however they are assembled."""

from __future__ import annotations

import io
import zlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpckpt
from fsdpckpt._io.checksums import ChecksumStream, crc32_combine, resolve_pieces
from fsdpckpt.training.manifest import read_manifest


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300), zeros=st.integers(0, 2**33))
def test_combine_equals_the_crc_of_the_concatenation(a, b, zeros):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    # Long lengths, past 4 GiB, through zeros whose CRC is known without the bytes: the CRC
    # of n zero bytes is combine(0, 0, n) composed with the affine part, so test the law
    # combine(combine(x, y, m), z, n) == combine(x, combine(y, z, n), m + n) instead.
    x, y, z = zlib.crc32(a), zlib.crc32(b), zlib.crc32(a[::-1])
    assert crc32_combine(crc32_combine(x, y, zeros), z, 7) == \
        crc32_combine(x, crc32_combine(y, z, 7), zeros + 7)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 5, 100, 2**20, 2**20 + 3]), max_size=8),
       known=st.booleans())
def test_a_stream_with_holes_resolves_to_the_crc_of_the_file(sizes, known):
    out = io.BytesIO()
    stream = ChecksumStream(out, None)
    for i, size in enumerate(sizes):
        stream.write(bytes([i % 251]) * size)
    data = out.getvalue()
    holes = {(o, n): zlib.crc32(data[o:o + n]) for o, n, c in stream.pieces if c is None}
    reads = []

    def read_back(offset, length):
        reads.append((offset, length))
        return zlib.crc32(data[offset:offset + length])

    crc = resolve_pieces(stream.pieces, holes if known else {}, read_back)
    assert crc == zlib.crc32(data) and stream.size == len(data)
    assert reads == ([] if known else list(holes))


def test_a_saved_manifest_holds_each_files_real_crc(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 3))
    fsdpckpt.save_state(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()))
    files = read_manifest(tmp_path / "ckpt")["files"]
    assert any(info["size"] > 2**21 for info in files.values())  # has holes to resolve
    for name, info in files.items():
        data = (tmp_path / "ckpt" / name).read_bytes()
        assert (info["size"], info["crc32"]) == (len(data), zlib.crc32(data)), name


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=70_000), st.integers(0, 2**32 - 1), st.integers(0, 64))
def test_the_fast_crc_is_zlibs_crc(data, start, skip):
    """ISA-L's CRC-32 (fsdpckpt[fast]) gives zlib's sums, from any start value, over any
    slice of a buffer: the sums zip archives record."""
    from fsdpckpt._io.checksums import crc32

    view = memoryview(data)[min(skip, len(data)):]
    assert crc32(view, start) == zlib.crc32(view, start)
    assert crc32(view) == zlib.crc32(view)


def test_without_isal_the_crc_is_zlibs():
    import os
    import subprocess
    import sys

    code = ("import sys, zlib; sys.modules['isal'] = None\n"  # as if not installed
            "from fsdpckpt._io.checksums import crc32\n"
            "assert crc32 is zlib.crc32, crc32")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root,
                   env=dict(os.environ, PYTHONPATH=root))
