"""Non-tensor entries torch writes and loads are read, merged and loaded bit-exactly.

An optimizer may hold its hyperparameters as tensors (``lr=torch.tensor(1e-2)``): its
``param_groups`` entries are small torch.save archives holding real storages. Values may
also be sets, frozensets and complex numbers, which torch.save's protocol 2 names
``__builtin__.set`` and so on. A hostile blob is refused; key paths that cannot both hold
are one error. The JSON codec itself is specified in ``test_objects_codec.py``.
"""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch

from fsdpckpt import load_full_state_dict
from fsdpckpt.dcp._archive import read_archive_with_tensors
from fsdpckpt.dcp._objects import TensorValue
from fsdpckpt.dcp._safe_pickle import BUILTIN_GLOBALS
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.errors import CorruptCheckpointError, UnsafePickleError

from conftest import reference_state_dict, run_cli, single_process
from deep_compare import assert_same_deep


@pytest.fixture(scope="module")
def tensor_hyperparameters(tmp_path_factory):
    """A DCP folder of AdamW state with tensor hyperparameters, plus sets and a complex."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("objects") / "ckpt"
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2),
                                  betas=(torch.tensor(0.9), torch.tensor(0.99)))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {"optimizer": optimizer.state_dict(),
             "extra": {"tags": {"a", "b"}, "frozen": frozenset({1, 2}), "phase": 1 - 2.5j,
                       "nan_phase": complex(float("nan"), float("inf"))}}
    dcp.save(state, checkpoint_id=folder, **single_process())
    return folder


def _merge(folder, out, fmt):
    result = run_cli("merge", folder, out, "--format", fmt)
    assert result.exit_code == 0, result.output
    return out


def test_tensor_hyperparameters_load_from_the_folder_as_torch_loads_them(tensor_hyperparameters):
    got = load_full_state_dict(tensor_hyperparameters)
    group = got["optimizer"]["param_groups"][0]
    assert isinstance(group["lr"], torch.Tensor) and isinstance(group["betas"][0], torch.Tensor)
    assert_same_deep(got, reference_state_dict(tensor_hyperparameters))


def test_a_bin_merge_keeps_tensor_hyperparameters_as_real_tensors(tensor_hyperparameters,
                                                                   tmp_path):
    out = _merge(tensor_hyperparameters, tmp_path / "out", "bin")
    (merged,) = out.glob("*.bin")
    with torch.serialization.safe_globals([frozenset]):
        plain = torch.load(merged, weights_only=True)  # torch's own loader reads it
    assert all(isinstance(b, torch.Tensor) for b in plain["optimizer"]["param_groups"][0]["betas"])
    with zipfile.ZipFile(merged) as archive:  # sound, with the betas' own storage entries
        assert archive.testzip() is None
    assert_same_deep(plain, reference_state_dict(tensor_hyperparameters))
    assert_same_deep(load_full_state_dict(out), reference_state_dict(tensor_hyperparameters))


def test_a_safetensors_merge_keeps_tensor_hyperparameters_typed_in_its_metadata(
        tensor_hyperparameters, tmp_path):
    from safetensors import safe_open

    out = _merge(tensor_hyperparameters, tmp_path / "out", "safetensors")
    (merged,) = out.glob("*.safetensors")
    with safe_open(str(merged), framework="pt") as handle:
        objects = json.loads(handle.metadata()["fsdpckpt.objects"])
    # lr, a tensor itself, is a tensor entry; betas, a tuple of tensors, is an object.
    betas = objects["optimizer.param_groups.0.betas"]["__tuple__"]
    assert [b["__tensor__"]["dtype"] for b in betas] == ["float32", "float32"]
    assert_same_deep(load_full_state_dict(out), reference_state_dict(tensor_hyperparameters))


def test_sets_frozensets_and_complex_values_survive_both_merges(tensor_hyperparameters, tmp_path):
    for fmt in ("bin", "safetensors"):
        extra = load_full_state_dict(_merge(tensor_hyperparameters, tmp_path / fmt, fmt))["extra"]
        assert extra["tags"] == {"a", "b"} and type(extra["frozen"]) is frozenset
        assert extra["phase"] == 1 - 2.5j and repr(extra["nan_phase"]) == "(nan+infj)"


# ----------------------------------------------------------------------------- hostile blobs

class _Blob:
    """Pickles as torch.save pickles a float32 tensor whose storage the pid sizes at will."""

    def __init__(self, declared_elements, offset=0, shape=(3,), extra=None) -> None:
        self.declared, self.offset, self.shape, self.extra = declared_elements, offset, shape, extra

    def __reduce__(self):
        import collections

        return (torch._utils._rebuild_tensor_v2,
                (_STORAGE, self.offset, self.shape, (1,), False, collections.OrderedDict()))

    def archive(self, stored_bytes: bytes) -> bytes:
        import pickle

        declared = self.declared

        class _Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                return ("storage", torch.FloatStorage, "0", "cpu", declared) \
                    if obj is _STORAGE else None

        pkl = io.BytesIO()
        _Pickler(pkl, protocol=2).dump({"lr": self, "other": self.extra})
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr("archive/data.pkl", pkl.getvalue())
            archive.writestr("archive/data/0", stored_bytes)
        return out.getvalue()


_STORAGE = object()


def _read(blob: bytes):
    return read_archive_with_tensors(io.BytesIO(blob), 0, len(blob), source="the blob",
                                     allowed=BUILTIN_GLOBALS,
                                     make_tensor=lambda *a: TensorValue(*a))


def test_a_sound_blob_reads():
    value = _read(_Blob(3).archive(bytes(12)))
    assert value["lr"] == TensorValue(DTYPES["float32"], bytes(12), 0, (3,), (1,))


def test_a_storage_declared_larger_than_its_entry_is_corrupt():
    with pytest.raises(CorruptCheckpointError, match="storage holds 12 bytes"):
        _read(_Blob(10**15).archive(bytes(12)))


def test_a_tensor_past_its_storage_in_an_object_is_corrupt():
    with pytest.raises(CorruptCheckpointError, match="the blob.*reaches past its storage"):
        _read(_Blob(3, offset=2).archive(bytes(12)))


def test_a_hostile_global_beside_a_tensor_is_still_refused(tmp_path):
    from conftest import _RunsCommand

    sentinel = tmp_path / "pwned"
    with pytest.raises(UnsafePickleError):
        _read(_Blob(3, extra=_RunsCommand(f"touch {sentinel}")).archive(bytes(12)))
    assert not sentinel.exists()


@pytest.mark.parametrize("paths", [
    [("a", 0), ("a", "b")],  # a name used on a list
    [("a",), ("a", "b")],  # a path through another entry's value
    [("a", "b", 0), ("a", "b", "c", "d")],
])
def test_key_paths_that_cannot_both_hold_are_one_error(paths):
    from fsdpckpt import NotACheckpointError
    from fsdpckpt.dcp._nesting import unflatten

    with pytest.raises(NotACheckpointError, match="cannot both hold"):
        unflatten([(p, f"v{i}") for i, p in enumerate(paths)])


def test_an_int_key_on_a_dict_is_a_dict_key_as_in_dcp():
    from fsdpckpt.dcp._nesting import unflatten

    assert unflatten([(("a", "b"), 1), (("a", 0), 2)]) == {"a": {"b": 1, 0: 2}}


def _dcp_with_object(folder, value):
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming a single process"
        dcp.save({"model": {"w": torch.ones(2), "extra": value}}, checkpoint_id=str(folder))
    return folder


def test_a_slice_entry_merges_to_safetensors_and_back(tmp_path):
    import fsdpckpt

    folder = _dcp_with_object(tmp_path / "dcp", {"s": slice(1, None, 2), "n": 2**80})
    (result,) = fsdpckpt.merge(folder, tmp_path / "out")
    state = load_full_state_dict(result.path)
    assert state["extra"] == {"s": slice(1, None, 2), "n": 2**80}  # merge drops "model."


def test_an_entry_nested_past_any_state_dict_is_one_error_naming_it(tmp_path):
    import fsdpckpt
    from fsdpckpt.dcp._objects import MAX_VALUE_DEPTH

    deep: list = []
    for _ in range(MAX_VALUE_DEPTH + 5):
        deep = [deep]
    folder = _dcp_with_object(tmp_path / "dcp", deep)
    with pytest.raises(fsdpckpt.NotACheckpointError, match="extra.*nested more than"):
        fsdpckpt.merge(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
