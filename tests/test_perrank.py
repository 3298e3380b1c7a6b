"""Per-rank torch.save checkpoints (Accelerate use_dcp=False, VeRL) read as DCP folders.

The fixtures come from real 2-rank FSDP2 runs (fixtures/generate_perrank.py). The reference
for every merge is torch's own loader on the same files: ``torch.load(weights_only=True)``
of each rank file, and the ranks' local tensors put together along their placements.
"""

from __future__ import annotations

import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # registers DTensor's classes for weights_only loading
from safetensors import safe_open

from fsdpckpt import (
    find_layout,
    inspect_checkpoint,
    load_full_state_dict,
    merge,
    verify_checkpoint,
)
from fsdpckpt.errors import CheckpointNotFoundError, UnsafePickleError

from conftest import torch_loads_fixture
from deep_compare import tensor_bytes

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ACCELERATE = FIXTURES / "accelerate_rank_bin"
VERL = FIXTURES / "verl"

#: (checkpoint, rank file prefix of the model set, of the optimizer set)
SETS = {
    "accelerate": (ACCELERATE, "pytorch_model_fsdp_0_rank{}.bin", "optimizer_0_rank{}.bin"),
    "verl": (VERL, "model_world_size_2_rank_{}.pt", "optim_world_size_2_rank_{}.pt"),
}


def _flat(value, prefix=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, (*prefix, key))
    else:
        yield ".".join(map(str, prefix)), value


def _torch_reference(folder: Path, pattern: str, world: int = 2) -> dict[str, torch.Tensor]:
    """The full tensors, from torch's own weights_only loader: local shards in rank order."""
    from torch.distributed.tensor import DTensor, Shard

    pieces: dict[str, list[torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    for rank in range(world):
        state = torch_loads_fixture(folder / pattern.format(rank))
        for name, value in _flat(state):
            if isinstance(value, DTensor):
                (placement,) = value.placements
                assert isinstance(placement, Shard)
                dims[name] = placement.dim
                pieces.setdefault(name, []).append(value._local_tensor)
            elif isinstance(value, torch.Tensor):
                dims[name] = None
                pieces.setdefault(name, []).append(value)
    return {name: torch.cat(parts, dims[name]) if dims[name] is not None else parts[0]
            for name, parts in pieces.items()}


@pytest.mark.parametrize("which", sorted(SETS))
def test_the_rank_files_are_one_model_part_and_one_optimizer_part(which):
    folder, model, optim = SETS[which]
    layout = find_layout(folder)
    assert layout.style == ("verl" if which == "verl" else "accelerate")
    assert [(p.kind, p.name) for p in layout.parts] == [
        ("model", model.format("*")), ("optimizer", optim.format("*"))]
    assert not any(name.startswith(("pytorch_model", "optimizer_", "model_", "optim_"))
                   for name in layout.other_files)


def test_verl_side_files_are_recognized():
    kinds = {f.name: f.kind for f in find_layout(VERL).side_files}
    assert kinds["fsdp_config.json"] == "fsdp_config"
    assert kinds["extra_state_world_size_2_rank_1.pt"] == "extra_state"


@pytest.mark.parametrize("which", sorted(SETS))
def test_inspect_reads_the_rank_files(which):
    report = inspect_checkpoint(SETS[which][0])
    assert report.ok, report.problems
    assert report.world_size == 2 and report.world_size_exact
    model = report.parts[0]
    assert {t.name: t.shape for t in model.tensors} == {
        "model.0.weight": (33, 16), "model.0.bias": (33,), "model.2.weight": (5, 33),
        "model.2.bias": (5,)}
    # 33 rows over 2 ranks: torch.chunk's split, 17 + 16.
    weight = {t.name: t for t in model.tensors}["model.0.weight"]  # listed by name: 2nd
    assert [c.offsets for c in weight.chunks] == [(0, 0), (17, 0)]


@pytest.mark.parametrize("which", sorted(SETS))
def test_merge_is_bit_exact_against_torchs_loader(which, tmp_path):
    folder, model, optim = SETS[which]
    merge(folder, tmp_path, optimizer=True)
    for stem, pattern in (("model", model), ("optimizer", optim)):
        # Named as the merge of Accelerate's DCP folders names them: the top key dropped.
        want = _torch_reference(folder, pattern)
        with safe_open(str(tmp_path / f"{stem}.safetensors"), framework="pt") as merged:
            assert set(merged.keys()) == set(want)
            for name, tensor in want.items():
                got = merged.get_tensor(name)
                assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
                assert tensor_bytes(got) == tensor_bytes(tensor), name


@pytest.mark.parametrize("which", sorted(SETS))
def test_load_full_state_dict_is_bit_exact_against_torchs_loader(which):
    folder, model, _ = SETS[which]
    want = _torch_reference(folder, model)
    got = load_full_state_dict(folder)["model"]  # nested as from Accelerate's DCP folders
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert tensor_bytes(got[name]) == tensor_bytes(tensor), name


def _globals_named(pickle_bytes: bytes) -> set[tuple[str, str]]:
    import pickletools

    found, strings = set(), []
    for opcode, arg, _ in pickletools.genops(pickle_bytes):
        if opcode.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif opcode.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif isinstance(arg, str):
            strings.append(arg)
    return found


def test_the_rank_files_name_only_globals_the_allowlist_knows():
    from fsdpckpt.dcp._perrank_file import _GLOBALS

    for folder in (ACCELERATE, VERL):
        for path in sorted(folder.glob("*_rank*")):
            if path.name.startswith("extra_state"):
                continue  # RNG and scheduler state: never read as tensors
            with zipfile.ZipFile(path) as archive:
                pkl = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
                unknown = _globals_named(archive.read(pkl)) - set(_GLOBALS)
            assert not unknown, f"{path.name} names {sorted(unknown)}"


def test_the_dtensor_allowlist_is_what_torch_itself_allowlists():
    """Nothing broader than torch's own weights_only allowlist for DTensors."""
    from fsdpckpt import _torch

    safe = {(g.__module__, g.__name__) for g in torch.serialization.get_safe_globals()
            if not isinstance(g, tuple)}
    beyond = (set(_torch.DTENSOR_SPEC_CLASSES) | {_torch.DTENSOR}) - safe
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if release < (2, 13):
        # An older torch allowlists fewer classes (2.6: no _StridedShard, no mesh layout); the
        # bound is torch 2.13's allowlist and every later one (CI runs 2.13 and the newest).
        pytest.skip(f"torch {torch.__version__} allowlists fewer DTensor classes than 2.13 "
                    f"(beyond it here: {sorted(beyond)})")
    assert not beyond


class _Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_global_in_a_rank_file_is_refused_and_never_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    marker = tmp_path / "ran"
    torch.save({"0.weight": torch.ones(2), "evil": _Hostile(marker)},
               ckpt / "pytorch_model_fsdp_0_rank0.bin")
    with pytest.raises(UnsafePickleError, match="system"):
        inspect_checkpoint(ckpt)
    with pytest.raises(UnsafePickleError):
        merge(ckpt, tmp_path / "out")
    with pytest.raises(UnsafePickleError):
        load_full_state_dict(ckpt)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which,missing", [("accelerate", 1), ("verl", 0), ("verl", 1)])
def test_a_missing_rank_file_is_named(which, missing, tmp_path):
    folder, model, _ = SETS[which]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(folder, ckpt)
    (ckpt / model.format(missing)).unlink()
    with pytest.raises(CheckpointNotFoundError, match=model.format(missing).replace(".", r"\.")):
        merge(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_rank_file_from_another_run_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ACCELERATE, ckpt)
    # rank 1's model file replaced by rank 0's: two ranks claim the same rows, none the rest.
    shutil.copy(ckpt / "pytorch_model_fsdp_0_rank0.bin", ckpt / "pytorch_model_fsdp_0_rank1.bin")
    report = inspect_checkpoint(ckpt)
    assert not report.ok


@pytest.mark.parametrize("which", sorted(SETS))
def test_verify_passes_intact_rank_files(which):
    assert verify_checkpoint(SETS[which][0]).ok


def test_verify_finds_a_changed_byte_in_a_rank_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ACCELERATE, ckpt)
    victim = ckpt / "pytorch_model_fsdp_0_rank1.bin"
    with zipfile.ZipFile(victim) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
    data = bytearray(victim.read_bytes())
    at = info.header_offset
    name_len, extra_len = struct.unpack("<HH", data[at + 26:at + 30])
    data[at + 30 + name_len + extra_len + 5] ^= 1  # one bit of a weight
    victim.write_bytes(bytes(data))
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any("pytorch_model_fsdp_0_rank1.bin" in p.path and "CRC" in p.message
               for p in report.problems)


def test_the_cli_names_a_verl_checkpoint_and_its_rank_sets():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fsdpckpt", "inspect", str(VERL), "--summary"],
                         capture_output=True, text=True, check=True).stdout
    assert "VeRL checkpoint, world size 2" in out
    assert "model_world_size_2_rank_*.pt " in out and "rank_*.pt/" not in out
