"""Trainers' single-folder checkpoints (Lightning's ``*.ckpt/``, torchtune's ``dist_epoch_N/``,
torchtitan's ``step-N/``):
model, optimizer and training state read apart, each checked against the framework's own
consolidation committed beside the fixture (the tests run without the frameworks)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt.dcp.layout import find_layout
from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.inspection._diff_sources import same_value
from fsdpckpt.inspection.inspect import inspect_checkpoint

from conftest import FIXTURES

#: trainer -> (its checkpoint folder, its optimizer's top-level key)
TRAINERS = {
    "lightning": (FIXTURES / "lightning" / "epoch=0-step=3.ckpt", "optimizer_0"),
    "torchtune": (FIXTURES / "torchtune" / "dist_epoch_0", "optimizer"),
    "torchtitan": (FIXTURES / "torchtitan" / "checkpoint" / "step-2", "optimizer"),
}
#: Some of the training state each keeps in its DCP folder (Lightning keeps its in meta.pt).
STATE = {
    "lightning": set(),
    "torchtune": {"seed", "epochs_run", "total_epochs", "max_steps_per_epoch"},
    "torchtitan": {"train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch",
                   "dataloader.dp_rank_0", "dataloader.dp_rank_1"},
}
#: The model's entries sit under "model" in these (torchtitan's sit at the top level).
NESTED = ("lightning", "torchtune")
trainers = pytest.mark.parametrize("trainer", sorted(TRAINERS))


def _reference_file(trainer: str):
    return FIXTURES / trainer / "reference_model.safetensors"


def _reference(trainer: str) -> dict[str, torch.Tensor]:
    """The model as the framework's own consolidation (Lightning) or load (torchtune,
    torchtitan) gave it."""
    return load_file(_reference_file(trainer))


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        bytes_of = tensor.reshape(-1).view(torch.uint8)
        assert got[name].reshape(-1).view(torch.uint8).equal(bytes_of), name


@trainers
def test_layout_names_model_optimizer_and_state(trainer):
    layout = find_layout(TRAINERS[trainer][0])
    assert layout.style == trainer
    assert [p.kind for p in layout.parts] == ["model", "optimizer", "state"]


@trainers
def test_inspect_shows_the_parts_apart(trainer):
    report = inspect_checkpoint(TRAINERS[trainer][0])
    assert report.ok, report.problems
    kinds = {p.kind: p for p in report.parts}
    # inspect shows the names as stored; merge drops the shared "model." (below)
    prefix = "model." if trainer in NESTED else ""
    assert sorted(t.name for t in kinds["model"].tensors) == sorted(
        prefix + name for name in _reference(trainer))
    assert all(t.name.startswith(TRAINERS[trainer][1] + ".") for t in kinds["optimizer"].tensors)
    if STATE[trainer]:
        assert not kinds["state"].tensors
        assert STATE[trainer] <= {o.name for o in kinds["state"].objects}


def test_inspect_leaves_out_a_part_the_folder_holds_nothing_of():
    # Lightning keeps its training state in meta.pt, not in the DCP folder: no empty "state"
    # part, the file listed as what it is.
    report = inspect_checkpoint(TRAINERS["lightning"][0])
    assert [p.kind for p in report.parts] == ["model", "optimizer"]
    assert [f.kind for f in report.side_files] == ["trainer_meta"]


@trainers
def test_merge_writes_the_model_alone_with_clean_names(trainer, tmp_path):
    fsdpckpt.merge(TRAINERS[trainer][0], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    _same(load_file(tmp_path / "out" / "model.safetensors"), _reference(trainer))


def _whole_reference(trainer: str, tmp_path):
    """The file of the folder's whole state as the framework's own consolidation writes it:
    Lightning's ``consolidate_checkpoint`` (``consolidated.ckpt``, written by Lightning 2.6.6:
    model, optimizer and meta.pt's entries). torchtune 0.6 and torchtitan 0.3 have none of
    their own for a DCP folder (torchtune's ``DistributedCheckpointer`` only loads into a live
    state dict; torchtitan's ``CheckpointManager`` exports the model alone, and its
    docs/checkpoint.md converts a ``step-N/`` folder with torch's ``format_utils
    dcp_to_torch``): for them, torch's ``dcp_to_torch_save`` of the folder."""
    if trainer == "lightning":
        return FIXTURES / "lightning" / "consolidated.ckpt"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(TRAINERS[trainer][0], tmp_path / "torch.pt")
    return tmp_path / "torch.pt"


def _optimizer_reference(trainer: str, tmp_path) -> dict:
    """The optimizer state in the framework's own consolidation (:func:`_whole_reference`)."""
    return torch.load(_whole_reference(trainer, tmp_path), weights_only=True)[
        TRAINERS[trainer][1]]


@trainers
def test_merge_optimizer_writes_the_optimizer(trainer, tmp_path):
    """Bit for bit the framework's own (:func:`_optimizer_reference` says which)."""
    folder, _ = TRAINERS[trainer]
    fsdpckpt.merge(folder, tmp_path / "out", optimizer=True)
    want: dict[str, torch.Tensor] = {}

    def flatten(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{prefix}{k}.", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                flatten(f"{prefix}{i}.", v)
        elif isinstance(value, torch.Tensor):
            want[prefix[:-1]] = value

    reference = _optimizer_reference(trainer, tmp_path)
    flatten("", reference)
    _same(load_file(tmp_path / "out" / "optimizer.safetensors"), want)
    # its non-tensor entries (param_groups) too, nested again from the kept key paths
    merged = fsdpckpt.load_full_state_dict(tmp_path / "out" / "optimizer.safetensors")
    assert same_value(merged, reference)


@trainers
def test_load_full_state_dict_matches_the_frameworks_own(trainer):
    state = fsdpckpt.load_full_state_dict(TRAINERS[trainer][0])
    if trainer in NESTED:  # Lightning's consolidate_checkpoint, dcp_to_torch_save's nesting
        state = state["model"]
    else:  # torchtitan's model entries sit at the top level, beside its other state
        state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    _same(state, _reference(trainer))


@pytest.mark.parametrize("trainer", ["torchtitan", "torchtune"])
def test_load_full_state_dict_is_the_whole_folder_as_dcp_to_torch_save_gives_it(trainer,
                                                                                tmp_path):
    # Model, optimizer, scheduler, dataloader and training state: what torchtitan's docs
    # consolidate a step-N/ folder with (issue 34; it gave the model alone before).
    state = fsdpckpt.load_full_state_dict(TRAINERS[trainer][0])
    whole = torch.load(_whole_reference(trainer, tmp_path), weights_only=False)  # a fixture
    assert same_value(state, whole)
    assert TRAINERS[trainer][1] in state and len(state) > 1


@trainers
def test_diff_against_the_frameworks_whole_consolidation_is_equal(trainer, tmp_path):
    """The folder whole (Lightning's with meta.pt) against a file holding its whole state."""
    folder = TRAINERS[trainer][0]
    for optimizer in (False, True):
        result = fsdpckpt.diff(folder, _whole_reference(trainer, tmp_path), optimizer=optimizer)
        assert result.equal and not result.missing and not result.unexpected
        assert all(t.identical for t in result.tensors)
        assert any(t.name.startswith(TRAINERS[trainer][1] + ".") for t in result.tensors)


@trainers
def test_diff_against_the_frameworks_own_is_equal(trainer):
    folder = TRAINERS[trainer][0]
    result = fsdpckpt.diff(folder, _reference_file(trainer))
    assert result.equal and len(result.tensors) == len(_reference(trainer))


def test_lightning_meta_is_decoded_and_listed():
    report = inspect_checkpoint(TRAINERS["lightning"][0])
    assert [(f.name, f.kind) for f in report.side_files] == [("meta.pt", "trainer_meta")]
    from fsdpckpt.dcp._sidefiles import read_state_file

    meta = read_state_file(TRAINERS["lightning"][0] / "meta.pt", "Lightning trainer state")
    assert meta["global_step"] == 3 and meta["lr_schedulers"][0]["last_epoch"] == 3


def test_lightning_meta_naming_a_callable_is_refused_and_nothing_runs(tmp_path):
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    shutil.copytree(TRAINERS["lightning"][0], ckpt)
    # A real torch.save archive whose pickle names a global outside the allowlist.
    torch.save({"epoch": 0, "hook": print}, ckpt / "meta.pt")
    report = inspect_checkpoint(ckpt)
    assert [p.path for p in report.problems] == [str(ckpt / "meta.pt")]
    assert "print" in report.problems[0].message


@trainers
def test_the_folder_above_names_the_checkpoint_to_pass(trainer):
    folder = TRAINERS[trainer][0]
    with pytest.raises(NotACheckpointError, match=f"holds one checkpoint .*{folder.name}"):
        find_layout(folder.parent)


def test_a_plain_dcp_folder_is_still_one_part():
    layout = find_layout(FIXTURES / "dtensor")
    assert layout.style == "dcp" and [p.kind for p in layout.parts] == ["dcp"]


@trainers
def test_verify_checks_the_folder_once_not_once_per_part(trainer, monkeypatch):
    import fsdpckpt.inspection.verify as verify

    checked, real = [], verify._check_chunks
    monkeypatch.setattr(verify, "_check_chunks",
                        lambda folder, *a, **k: checked.append(folder) or real(folder, *a, **k))
    assert verify.verify_checkpoint(TRAINERS[trainer][0]).ok
    assert len(checked) == 1


@trainers
def test_inspect_counts_the_folders_bytes_once(trainer):
    folder = TRAINERS[trainer][0]
    on_disk = sum(p.stat().st_size for p in folder.iterdir())
    assert inspect_checkpoint(folder).bytes == on_disk
