"""merge's OUTPUT_DIR naming its one file: the names each --format writes, and a name of the
other format answered with the --format it needs."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, assert_one_line_error, run_cli

CKPT = FIXTURES / "fsdp2_accelerate"


@pytest.mark.parametrize("name", ["torch.pt", "model.pth"])
def test_a_torch_save_name_with_format_bin_is_the_one_file_written(name, tmp_path):
    result = run_cli("merge", CKPT, tmp_path / name, "--format", "bin", "-q")
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_a_pt_file_loads_with_weights_only_as_the_bin_merge(tmp_path):
    import torch

    assert run_cli("merge", CKPT, tmp_path / "pt" / "torch.pt", "--format", "bin").exit_code == 0
    assert run_cli("merge", CKPT, tmp_path / "bin", "--format", "bin").exit_code == 0
    got = torch.load(tmp_path / "pt" / "torch.pt", weights_only=True)
    want = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("name", ["y.bin", "y.pt"])
def test_a_bin_name_without_format_bin_says_to_add_it(name, tmp_path):
    out = tmp_path / name
    result = run_cli("merge", CKPT, out)
    suffix = name[1:]
    assert_one_line_error(result, f"{name}: a {suffix} name needs --format bin (the default is "
                                  f"safetensors): fsdpckpt merge {CKPT} {out} --format bin")
    assert not out.exists()


def test_a_safetensors_name_with_format_bin_says_which_format_it_needs(tmp_path):
    out = tmp_path / "y.safetensors"
    result = run_cli("merge", CKPT, out, "--format", "bin")
    assert_one_line_error(result, "y.safetensors: a .safetensors name needs --format "
                                  f"safetensors (the default), not --format bin: fsdpckpt merge "
                                  f"{CKPT} {out}")
    assert not out.exists()
