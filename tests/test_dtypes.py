"""Every dtype torch saves through DCP is read, verified, merged and loaded bit-exactly.

The ``fixtures/dtypes`` folder (a real 2-rank gloo run, see ``fixtures/generate.py``)
holds each dtype sharded on dim 0 unevenly, on dim 1, replicated and 0-d, filled with
seeded random bit patterns (NaN payloads included), beside non-tensor entries holding
tensors, sets, frozensets and a complex number. Everything is compared byte for byte
with what torch's own loader gives.
"""

from __future__ import annotations

import io

import pytest
import torch

from fsdpckpt import _torch, inspect_checkpoint, load_full_state_dict
from fsdpckpt.dcp._archive import locate_tensor
from fsdpckpt.dcp.dtypes import DTYPES, dtype_from_name
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import TorchTooOldError
from fsdpckpt.inspection.verify import verify_checkpoint

from conftest import (
    FIXTURES,
    assert_one_line_error,
    reference_state_dict,
    run_cli,
    skip_unless_torch_has_dtypes,
)
from deep_compare import assert_same_deep as assert_same_state
from deep_compare import tensor_bytes as _bytes

MATRIX = FIXTURES / "dtypes"
#: What the matrix holds, as fixtures/generate.py writes it.
MATRIX_DTYPES = (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "bool",
    "float16", "float32", "float64", "bfloat16", "complex32", "complex64", "complex128",
)
LAYOUTS = ("dim0", "dim1", "replicated", "scalar")
#: The dtypes safetensors has no loadable code for.
NO_SAFETENSORS_CODE = ("float8_e8m0fnu", "float4_e2m1fn_x2", "complex32", "complex128")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def _without(tree: dict, dtypes) -> dict:
    model = {k: v for k, v in tree["model"].items() if k.split(".")[0] not in dtypes}
    return {**tree, "model": model}


# ----------------------------------------------------------------------------- the table

@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_known_dtype_is_torch_s_with_its_size(name):
    if not hasattr(torch, name):  # only a dtype _torch.DTYPE_SINCE dates, on an older torch
        since = _torch.DTYPE_SINCE[name]
        assert _release(torch.__version__) < _release(since), name
        pytest.skip(f"torch {torch.__version__} lacks {name} (torch {since} added it)")
    assert torch.empty(0, dtype=getattr(torch, name)).element_size() == DTYPES[name].itemsize


def test_safetensors_codes_are_exactly_those_its_torch_loader_maps():
    from safetensors.torch import _TYPES

    claimed = {d.safetensors: d.name for d in DTYPES.values() if d.safetensors}
    loadable = {code: str(dtype).removeprefix("torch.") for code, dtype in _TYPES.items()}
    assert claimed == loadable


def test_complex32_is_known_by_both_its_names():
    assert dtype_from_name("torch.complex32") is dtype_from_name("chalf") is DTYPES["complex32"]
    assert DTYPES["complex32"].itemsize == 4 and DTYPES["complex32"].safetensors is None


def test_the_matrix_holds_every_dtype_fsdpckpt_knows():
    assert sorted(MATRIX_DTYPES) == sorted(DTYPES)


# ----------------------------------------------------------------------------- the matrix

def test_the_matrix_inspects_whole_with_every_dtype_right():
    doc = inspect_checkpoint(MATRIX)
    assert doc["ok"] is True and doc["problems"] == [] and doc["world_size"] == 2
    stored = {t["name"]: t["dtype"] for t in doc["parts"][0]["tensors"]}
    for name in MATRIX_DTYPES:
        for layout in LAYOUTS:
            assert stored[f"model.{name}.{layout}"] == name


def test_the_matrix_verifies():
    report = verify_checkpoint(MATRIX)
    assert report["ok"] is True, report["problems"]


def test_every_located_chunk_is_what_torch_loads_byte_for_byte():
    skip_unless_torch_has_dtypes(MATRIX)
    folder = read_dcp_folder(MATRIX)
    for tensor in folder.metadata.tensors:
        for chunk in tensor.chunks:
            with open(MATRIX / chunk.file, "rb") as f:
                raw = locate_tensor(f, chunk.offset, chunk.length, source=tensor.name)
                f.seek(chunk.offset)
                expected = torch.load(io.BytesIO(f.read(chunk.length)), weights_only=True)
                f.seek(raw.data_start)
                data = f.read(raw.nbytes)
            assert raw.dtype.name == tensor.dtype.name and raw.shape == tuple(expected.shape)
            assert raw.is_contiguous and data == _bytes(expected), tensor.name


def test_the_matrix_loads_as_torch_loads_it():
    skip_unless_torch_has_dtypes(MATRIX)
    assert_same_state(load_full_state_dict(MATRIX), reference_state_dict(MATRIX))


def test_a_bin_merge_of_the_matrix_is_what_torch_loads(tmp_path):
    result = run_cli("merge", MATRIX, tmp_path / "out", "--format", "bin")
    assert result.exit_code == 0, result.output
    expected = reference_state_dict(MATRIX)
    with torch.serialization.safe_globals([set, frozenset, complex]):
        plain = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert_same_state(plain, expected)
    assert_same_state(load_full_state_dict(tmp_path / "out"), expected)


def test_a_safetensors_merge_of_dtypes_without_a_code_says_use_format_bin(tmp_path):
    result = run_cli("merge", MATRIX, tmp_path / "out")
    assert_one_line_error(result, "complex32", "complex128", "float8_e8m0fnu", "--format bin")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_safetensors_merge_of_every_dtype_with_a_code_loads_in_safetensors(tmp_path):
    from safetensors.torch import load_file

    excludes = [arg for name in NO_SAFETENSORS_CODE for arg in ("--exclude", f"*{name}*")]
    result = run_cli("merge", MATRIX, tmp_path / "out", *excludes)
    assert result.exit_code == 0, result.output
    expected = _without(reference_state_dict(MATRIX), NO_SAFETENSORS_CODE)
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(loaded) == sorted(f"model.{k}" for k in expected["model"]) + \
        ["param_groups.0.lr"]
    for key, tensor in expected["model"].items():
        got = loaded[f"model.{key}"]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert _bytes(got) == _bytes(tensor), key
    assert_same_state(load_full_state_dict(tmp_path / "out"), expected)


def test_a_bf16_export_of_the_matrix_is_torch_s_own_cast(tmp_path):
    # Floating dtypes (every float8 included) become bfloat16 as tensor.to() makes them;
    # float4_e2m1fn_x2, integers, bool and complex keep their dtype and bytes.
    skip_unless_torch_has_dtypes(MATRIX)
    result = run_cli("merge", MATRIX, tmp_path / "out", "--format", "bin", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    with torch.serialization.safe_globals([set, frozenset, complex]):
        merged = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)["model"]
    for key, tensor in reference_state_dict(MATRIX)["model"].items():
        cast = tensor.dtype.is_floating_point and tensor.dtype != torch.float4_e2m1fn_x2
        want = tensor.to(torch.bfloat16) if cast else tensor
        assert merged[key].dtype == want.dtype, key
        assert _bytes(merged[key]) == _bytes(want), key


# ----------------------------------------------------------------- on a torch without a dtype
# torch 2.6 (the declared floor) lacks float8_e8m0fnu and float4_e2m1fn_x2. Taking one away
# from the installed torch makes that torch on any release, so CI pins the behaviour on
# every torch it runs.


@pytest.fixture
def torch_without_e8m0(monkeypatch):
    monkeypatch.delattr(torch, "float8_e8m0fnu", raising=False)  # 2.6 lacks it already


@pytest.mark.parametrize("verb", [("inspect",), ("verify",), ("diff", MATRIX),
                                  ("merge", "{out}", "--format", "bin")])
def test_a_torch_without_a_dtype_still_reads_it_as_bytes(verb, torch_without_e8m0, tmp_path):
    args = [str(a).format(out=tmp_path / "out") for a in verb[1:]]
    result = run_cli(verb[0], MATRIX, *args)
    assert result.exit_code == 0, result.output


def test_a_torch_without_a_dtype_says_which_torch_casts_it(torch_without_e8m0, tmp_path):
    result = run_cli("merge", MATRIX, tmp_path / "out", "--format", "bin", "--dtype", "bf16")
    assert_one_line_error(result, "float8_e8m0fnu", torch.__version__, "torch 2.7 or later")
    assert not (tmp_path / "out").exists()


def test_a_torch_without_a_dtype_says_which_torch_loads_it(torch_without_e8m0):
    with pytest.raises(TorchTooOldError, match="float8_e8m0fnu.*torch 2.7 or later"):
        load_full_state_dict(MATRIX)


def test_a_torch_without_a_dtype_says_which_torch_loads_its_bin(tmp_path):
    # Here torch's own loader meets the dtype, and caches the dtypes it knows: only a torch
    # that really lacks it (2.6, which CI runs) shows what a user of that torch sees.
    if hasattr(torch, "float8_e8m0fnu"):
        pytest.skip(f"torch {torch.__version__} has float8_e8m0fnu; CI runs this on torch 2.6")
    assert run_cli("merge", MATRIX, tmp_path / "out", "--format", "bin").exit_code == 0
    with pytest.raises(TorchTooOldError, match="pytorch_model.bin: float8_e8m0fnu"):
        load_full_state_dict(tmp_path / "out")
    result = run_cli("convert", tmp_path / "out" / "pytorch_model.bin", tmp_path / "back")
    assert_one_line_error(result, "float8_e8m0fnu", "torch 2.7 or later")
