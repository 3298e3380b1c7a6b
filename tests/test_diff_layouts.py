"""``diff`` of sides laid out differently: found right, read in tiles, and flat in memory.

A DCP folder cut on dim 1, or holding transposed chunks, against a row-major safetensors
file is compared tile by tile (:mod:`fsdpckpt.inspection._diff_tiles`); a ``.bin`` side
is read through its memory map with each box's pages released once compared.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import fsdpckpt
from fsdpckpt.inspection import diff as diff_module
from fsdpckpt.inspection._diff_tiles import tile_sizes, tiles_of

from conftest import peak_rss_mib

LAYOUTS = {"dim1": ([1], 3, False), "grid": ([0, 1], 3, False),
           "transposed": ([0], 2, True), "transposed_dim1": ([1], 3, True)}


def _folder(tmp_path, value, name):
    from chunked import split, write_dcp

    dims, parts, transpose = LAYOUTS[name]
    return write_dcp(tmp_path / name, {"w": (value, split(dims, parts, transpose=transpose))})


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_differently_chunked_equal_sides_are_identical(tmp_path, layout, monkeypatch):
    value = torch.randn(301, 257)
    save_file({"w": value}, str(tmp_path / "ref.safetensors"))
    monkeypatch.setattr(diff_module, "BOX_ELEMENTS", 1000)  # many tiles, ragged edges
    report = fsdpckpt.diff(_folder(tmp_path, value, layout), tmp_path / "ref.safetensors")
    assert report.equal and report.tensors[0].identical, report.to_json()
    assert report.tensors[0].numel == 301 * 257


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_element_far_from_the_start_is_found_with_its_values(tmp_path, layout,
                                                                  monkeypatch):
    value = torch.randn(301, 257)
    changed = value.clone()
    changed[297, 250] += 0.25
    save_file({"w": changed}, str(tmp_path / "ref.safetensors"))
    monkeypatch.setattr(diff_module, "BOX_ELEMENTS", 1000)
    report = fsdpckpt.diff(_folder(tmp_path, value, layout), tmp_path / "ref.safetensors")
    (bad,) = report.differing
    assert bad.name == "w" and bad.mismatched == 1 and not bad.identical
    assert bad.max_abs == pytest.approx(0.25, rel=1e-5)
    assert bad.max_rel == pytest.approx(0.25 / abs(changed[297, 250].item()), rel=1e-4)


def test_two_differently_chunked_dcp_folders_are_compared_chunk_against_chunk(tmp_path):
    value = torch.arange(90 * 70, dtype=torch.float32).reshape(90, 70)
    report = fsdpckpt.diff(_folder(tmp_path, value, "transposed"),
                           _folder(tmp_path, value, "grid"))
    assert report.equal and report.tensors[0].identical


def test_tiles_cover_a_box_once_and_stay_small():
    for sizes, sa, sb, limit in [((11, 13), (13, 1), (1, 11), 5), ((11, 13), (13, 1), (13, 1), 7),
                                 ((4, 5, 6), (1, 4, 20), (30, 6, 1), 9), ((7,), (1,), (1,), 3)]:
        tile = tile_sizes(sizes, sa, sb, limit)
        seen = set()
        for corner, part in tiles_of((2,) * len(sizes), sizes, tile):
            assert 0 < torch.Size(part).numel() <= limit
            cells = torch.cartesian_prod(*[torch.arange(c, c + p) for c, p in zip(corner, part)])
            seen |= {tuple(x) for x in cells.reshape(-1, len(sizes)).tolist()}
        assert len(seen) == torch.Size(sizes).numel()


def test_transposed_sides_read_long_runs_on_both():
    # A column-major side against a row-major one: square-ish tiles, not one-row strips.
    assert tile_sizes((8192, 4096), (1, 8192), (8192, 1), 2**19) == (724, 724)
    assert tile_sizes((8192, 4096), (4096, 1), (8192, 1), 2**19) == (128, 4096)


@pytest.mark.slow
def test_bin_diff_memory_does_not_grow_with_the_file(tmp_path):
    imports = "import torch, fsdpckpt, fsdpckpt.inspection.diff\n"
    peaks = []
    for rows in (2048, 8192):  # 64 MiB and 256 MiB
        value = torch.arange(rows * 8192, dtype=torch.float32).reshape(rows, 8192)
        torch.save({"w": value}, tmp_path / f"{rows}.bin")
        save_file({"w": value}, str(tmp_path / f"{rows}.safetensors"))
        del value
        peaks.append(peak_rss_mib(imports + f"report = fsdpckpt.diff("
                                  f"{str(tmp_path / f'{rows}.bin')!r}, "
                                  f"{str(tmp_path / f'{rows}.safetensors')!r})\n"
                                  "assert report.equal"))
    baseline = peak_rss_mib(imports)
    # Holding the larger file's pages would add 256 MiB; a fixed window adds tens.
    assert peaks[1] - peaks[0] < 32, (peaks, baseline)
    assert peaks[1] - baseline < 96, (peaks, baseline)


def test_tiles_come_in_a_sides_storage_order_when_asked():
    # Column-major storage: tiles walk down the columns, so a compressed side only reads on.
    corners = [c for c, _ in tiles_of((0, 0), (11, 13), (4, 5), (1, 11))]
    assert corners == sorted(corners, key=lambda c: (c[1], c[0]))
    assert [c for c, _ in tiles_of((0, 0), (11, 13), (4, 5))] == sorted(corners)
