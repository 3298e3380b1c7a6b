"""Per-rank files' remaining cases: FSDP1 ShardedTensors, placements that cannot be placed,
FSDP1 LOCAL_STATE_DICT, and the optimizer's param_groups.

The FSDP1 fixture comes from a real 2-rank FSDP1 run saved by Accelerate's own
``save_fsdp_model``/``save_fsdp_optimizer`` (fixtures/generate_perrank.py). torch allowlists no
ShardedTensor class for ``weights_only`` and its ``__setstate__`` needs the writer's process
group, so the reference is torch's ``weights_only`` loader with exactly those classes allowed
and ``__setstate__`` keeping the state it is given (no process group check).
"""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # registers DTensor's classes for weights_only loading
from safetensors import safe_open

from fsdpckpt import inspect_checkpoint, load_full_state_dict, merge, verify_checkpoint
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsafePickleError,
)

from conftest import torch_loads_fixture
from deep_compare import tensor_bytes

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FSDP1 = FIXTURES / "accelerate_rank_bin_fsdp1"
FSDP2 = FIXTURES / "accelerate_rank_bin"
VERL = FIXTURES / "verl"


def _flat(value, prefix=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, (*prefix, key))
    else:
        yield ".".join(map(str, prefix)), value


def _load_sharded(path: Path, monkeypatch) -> dict:
    """torch's weights_only loader, allowing exactly the classes a ShardedTensor pickles."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        MEM_FORMAT_ENCODING,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.remote_device import _remote_device

    def keep_state(self, state):  # torch's checks the process group of the writing rank
        self._local_shards, self._metadata, _, self._sharding_spec, _ = state

    monkeypatch.setattr(ShardedTensor, "__setstate__", keep_state)
    allowed = [ShardedTensor, Shard, ShardedTensorMetadata, ShardMetadata, TensorProperties,
               MEM_FORMAT_ENCODING, _remote_device, ChunkShardingSpec, getattr,
               ShardedTensor.ProcessGroupState]
    with torch.serialization.safe_globals(allowed):
        return torch_loads_fixture(path)


def _torch_reference(folder: Path, pattern: str, monkeypatch) -> dict[str, torch.Tensor]:
    """Full tensors: every rank's local shards placed at their own ShardMetadata offsets."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    full: dict[str, torch.Tensor] = {}
    for rank in range(2):
        state = _load_sharded(folder / pattern.format(rank), monkeypatch)
        for name, value in _flat(state):
            if type(value) is ShardedTensor:
                out = full.setdefault(name, torch.zeros(tuple(value._metadata.size),
                                                        dtype=value._local_shards[0].tensor.dtype))
                for shard in value._local_shards:
                    index = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets,
                                                                   shard.metadata.shard_sizes))
                    out[index] = shard.tensor
            elif isinstance(value, torch.Tensor):
                full.setdefault(name, value)
    return full


def test_fsdp1_sharded_tensor_files_are_inspected():
    report = inspect_checkpoint(FSDP1)
    assert report.ok, report.problems
    assert report.world_size == 2
    model = report.parts[0]
    assert {t.name: t.shape for t in model.tensors} == {
        "model.0.weight": (33, 16), "model.0.bias": (33,), "model.2.weight": (5, 33),
        "model.2.bias": (5,)}
    weight = {t.name: t for t in model.tensors}["model.0.weight"]  # listed by name: 2nd
    assert [c.offsets for c in weight.chunks] == [(0, 0), (17, 0)]


def test_fsdp1_sharded_tensor_files_verify():
    assert verify_checkpoint(FSDP1).ok


def test_fsdp1_merge_is_bit_exact_against_torchs_loader(tmp_path, monkeypatch):
    merge(FSDP1, tmp_path, optimizer=True)
    for stem, pattern in (("model", "pytorch_model_fsdp_0_rank{}.bin"),
                          ("optimizer", "optimizer_0_rank{}.bin")):
        want = _torch_reference(FSDP1, pattern, monkeypatch)
        with safe_open(str(tmp_path / f"{stem}.safetensors"), framework="pt") as merged:
            assert set(merged.keys()) == set(want)
            for name, tensor in want.items():
                got = merged.get_tensor(name)
                assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
                assert tensor_bytes(got) == tensor_bytes(tensor), name


def test_fsdp1_load_full_state_dict_is_bit_exact_against_torchs_loader(monkeypatch):
    want = _torch_reference(FSDP1, "pytorch_model_fsdp_0_rank{}.bin", monkeypatch)
    got = load_full_state_dict(FSDP1)["model"]
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert tensor_bytes(got[name]) == tensor_bytes(tensor), name


def _rewrite_pickle(path: Path, change) -> None:
    """Rewrite a rank file's data.pkl through ``change(bytes) -> bytes``, keeping the rest."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for info, data in entries:
            archive.writestr(info, change(data) if info.filename.endswith("data.pkl") else data)
    path.write_bytes(buffer.getvalue())


def test_a_getattr_other_than_process_group_state_is_refused_and_never_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FSDP1, ckpt)
    # ShardedTensor's pickle asks getattr for ProcessGroupState; ask for something else.
    _rewrite_pickle(ckpt / "pytorch_model_fsdp_0_rank0.bin",
                    lambda data: data.replace(b"ProcessGroupState", b"__init_subclass"))
    with pytest.raises(UnsafePickleError, match="ProcessGroupState"):
        merge(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_hostile_global_inside_a_sharded_tensor_is_refused_and_never_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FSDP1, ckpt)
    marker = tmp_path / "ran"
    # The shards' placement class swapped for os.system, called with the marker command.
    _rewrite_pickle(ckpt / "pytorch_model_fsdp_0_rank1.bin", lambda data: data.replace(
        b"ctorch.distributed.remote_device\n_remote_device\n", b"cposix\nsystem\n").replace(
        b")\x81", b"X" + len(f"touch {marker}").to_bytes(4, "little") +
        f"touch {marker}".encode() + b"\x85R", 1))
    with pytest.raises(UnsafePickleError, match="system"):
        inspect_checkpoint(ckpt)
    with pytest.raises(UnsafePickleError):
        merge(ckpt, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_a_missing_fsdp1_rank_file_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FSDP1, ckpt)
    (ckpt / "optimizer_0_rank1.bin").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"optimizer_0_rank1\.bin"):
        merge(ckpt, tmp_path / "out", optimizer=True)
    assert not (tmp_path / "out").exists()


def test_fsdp1_local_state_dict_flat_params_are_refused_naming_the_state_dict_type(tmp_path):
    from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F401

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # LOCAL_STATE_DICT's file holds plain views and the module's padded flat parameter.
    for rank in range(2):
        torch.save({"0.weight": torch.ones(3), "_flat_param": torch.ones(8)},
                   ckpt / f"pytorch_model_fsdp_rank{rank}.bin")
    with pytest.raises(NotACheckpointError, match="LOCAL_STATE_DICT.*SHARDED_STATE_DICT"):
        merge(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- param_groups -------------------------------------------------------------------------


def _objects(path: Path) -> dict:
    import json

    from fsdpckpt.dcp._objects import loads

    with safe_open(str(path), framework="pt") as merged:
        meta = merged.metadata()
    return {k: loads(json.dumps(v)) for k, v in json.loads(meta["fsdpckpt.objects"]).items()}


@pytest.mark.parametrize("folder,pattern", [
    (FSDP2, "optimizer_0_rank{}.bin"), (VERL, "optim_world_size_2_rank_{}.pt"),
    (FSDP1, "optimizer_0_rank{}.bin")], ids=["fsdp2", "verl", "fsdp1"])
def test_param_groups_are_merged_as_the_writers_loader_reads_them(folder, pattern, tmp_path,
                                                                    monkeypatch):
    merge(folder, tmp_path, optimizer=True)
    got = _objects(tmp_path / "optimizer.safetensors")
    want = _load_sharded(folder / pattern.format(1), monkeypatch)["param_groups"]
    expected = {f"param_groups.{i}.{key}": value
                for i, group in enumerate(want) for key, value in group.items()}
    assert got == expected


def test_param_groups_are_kept_as_a_dcp_optimizer_merge_keeps_them(tmp_path):
    merge(FSDP2, tmp_path / "perrank", optimizer=True)
    merge(FIXTURES / "fsdp2_accelerate", tmp_path / "dcp", optimizer=True)
    perrank = _objects(tmp_path / "perrank" / "optimizer.safetensors")
    dcp = _objects(tmp_path / "dcp" / "optimizer.safetensors")
    assert set(perrank) == set(dcp)
    assert perrank["param_groups.0.params"] == dcp["param_groups.0.params"]
    assert perrank["param_groups.0.betas"] == dcp["param_groups.0.betas"] == (0.9, 0.999)


def test_ranks_whose_param_groups_disagree_are_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FSDP2, ckpt)
    state = torch_loads_fixture(ckpt / "optimizer_0_rank1.bin")
    state["param_groups"][0]["lr"] = 0.5
    torch.save(state, ckpt / "optimizer_0_rank1.bin")
    with pytest.raises(CorruptCheckpointError,
                       match=r"optimizer_0_rank1\.bin.*param_groups\.0\.lr"):
        merge(ckpt, tmp_path / "out", optimizer=True)
    assert not (tmp_path / "out").exists()


# -- placements ---------------------------------------------------------------------------


@pytest.mark.parametrize("placement,says", [
    (b"Partial", r"'0\.weight' is placed as Partial\(.*full"),
    (b"_StridedShard", r"'0\.weight' is placed as _StridedShard\(dim=0.*use_dcp=True")])
def test_placements_that_cannot_be_placed_are_refused_naming_key_and_placement(
        placement, says, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FSDP2, ckpt)
    for rank in range(2):
        _rewrite_pickle(ckpt / f"pytorch_model_fsdp_0_rank{rank}.bin", lambda data: data.replace(
            b"placement_types\nShard\n", b"placement_types\n" + placement + b"\n"))
    with pytest.raises(NotACheckpointError, match=says):
        merge(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
