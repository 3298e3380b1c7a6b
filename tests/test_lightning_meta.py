"""Lightning's ``meta.pt`` kept as Lightning's own consolidation keeps it (issue 20 §1).

The reference is ``fixtures/lightning/consolidated.ckpt``, written by Lightning 2.6.6 itself
(``python -m lightning.fabric.utilities.consolidate_checkpoint`` of the fixture's
``epoch=0-step=3.ckpt/``, by ``fixtures/generate_lightning.py``): one ``torch.save`` of the
whole DCP folder (``model``, ``optimizer_0``) with ``meta.pt``'s entries (``epoch``,
``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``...) at its top level, which is
what Lightning's ``_load_distributed_checkpoint`` builds (``checkpoint.update(meta)``).
``load_full_state_dict`` of the folder gives that dict, and ``diff`` of the folder against
that file says equal, meta entries included; a merge writes the model (and, with
``--optimizer``, the optimizer) and no training state, as it does for every layout.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import fsdpckpt
from fsdpckpt.errors import FsdpCkptError, UnsafePickleError
from fsdpckpt.inspection._diff_sources import same_value
from fsdpckpt.inspection.inspect import inspect_checkpoint
from fsdpckpt.inspection.verify import verify_checkpoint

from conftest import FIXTURES, _RunsCommand, run_cli

FOLDER = FIXTURES / "lightning" / "epoch=0-step=3.ckpt"
CONSOLIDATED = FIXTURES / "lightning" / "consolidated.ckpt"


def _lightnings_own() -> dict:
    """Lightning's consolidation of the fixture, as Lightning wrote it."""
    return torch.load(CONSOLIDATED, weights_only=True)


def _meta() -> dict:
    return torch.load(FOLDER / "meta.pt", weights_only=True)


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the fixture's folder, to change its meta.pt."""
    folder = tmp_path / FOLDER.name
    shutil.copytree(FOLDER, folder)
    return folder


# ------------------------------------------------------------------ load_full_state_dict

def test_load_full_state_dict_is_lightnings_own_consolidation():
    state, want = fsdpckpt.load_full_state_dict(FOLDER), _lightnings_own()
    # The same keys in the same order (DCP's entries, then meta's), the same types, every
    # tensor byte for byte (same_value compares tensors' bits, dtypes and shapes).
    assert list(state) == list(want) == ["model", "optimizer_0", *_meta()]
    assert same_value(state, want)


def test_load_full_state_dict_keeps_a_tensor_in_meta_bit_for_bit(ckpt):
    # ModelCheckpoint keeps best_model_score as a tensor; NaN payloads and -0.0 survive.
    score = torch.tensor([-0.0, float("nan"), 1.5], dtype=torch.bfloat16)
    meta = _meta() | {"callbacks": {"ModelCheckpoint{}": {"best_model_score": score}}}
    torch.save(meta, ckpt / "meta.pt")
    got = fsdpckpt.load_full_state_dict(ckpt)["callbacks"]["ModelCheckpoint{}"]
    assert got["best_model_score"].view(torch.int16).equal(score.view(torch.int16))


def test_a_meta_entry_replaces_the_dcp_entry_of_its_name(ckpt):
    # checkpoint.update(meta): Lightning's own rule when both hold a key.
    torch.save(_meta() | {"optimizer_0": "from meta"}, ckpt / "meta.pt")
    assert fsdpckpt.load_full_state_dict(ckpt)["optimizer_0"] == "from meta"


# ------------------------------------------------------------------------------- diff

@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("optimizer", [False, True])
def test_diff_against_lightnings_consolidation_is_equal(flip, optimizer):
    a, b = (CONSOLIDATED, FOLDER) if flip else (FOLDER, CONSOLIDATED)
    report = fsdpckpt.diff(a, b, optimizer=optimizer)
    assert report.equal and not report.missing and not report.unexpected
    assert all(t.identical for t in report.tensors)  # bit for bit, not merely close
    compared = {t.name for t in report.tensors} | {o.name for o in report.objects}
    assert {"model.net.0.weight", "optimizer_0.state.net.0.weight.exp_avg",
            "optimizer_0.param_groups.0.lr", "epoch", "global_step",
            "pytorch-lightning_version", "lr_schedulers.0.last_epoch",
            "loops.fit_loop.epoch_progress.total.completed"} <= compared


def test_the_cli_says_equal():
    result = run_cli("diff", FOLDER, CONSOLIDATED)
    assert result.exit_code == 0, result.output
    assert "EQUAL: 16 tensors (16 bit-identical), 95 objects" in result.output


def test_a_changed_meta_value_is_a_difference(ckpt):
    meta = _meta()
    meta["lr_schedulers"][0]["_last_lr"] = [0.0050000001]
    torch.save(meta, ckpt / "meta.pt")
    report = fsdpckpt.diff(ckpt, CONSOLIDATED)
    assert not report.equal
    assert [o.name for o in report.objects if not o.equal] == ["lr_schedulers.0._last_lr"]
    assert all(t.equal for t in report.tensors)


def test_a_meta_entry_the_folder_lacks_is_reported_missing(ckpt):
    meta = _meta()
    del meta["global_step"]
    torch.save(meta, ckpt / "meta.pt")
    report = fsdpckpt.diff(ckpt, CONSOLIDATED)
    assert not report.equal and report.unexpected == ("global_step",)


def test_a_changed_tensor_in_meta_is_a_difference(ckpt, tmp_path):
    score = torch.tensor(0.25)
    torch.save(_meta() | {"best": score}, ckpt / "meta.pt")
    torch.save(_lightnings_own() | {"best": score}, tmp_path / "same.ckpt")
    assert fsdpckpt.diff(ckpt, tmp_path / "same.ckpt").equal
    torch.save(_lightnings_own() | {"best": torch.tensor(0.5)}, tmp_path / "other.ckpt")
    report = fsdpckpt.diff(ckpt, tmp_path / "other.ckpt")
    assert [t.name for t in report.tensors if not t.equal] == ["best"]


def test_against_the_model_alone_the_folder_is_its_model():
    # A file holding no optimizer_0.*: the folder is compared as merge writes its model.
    report = fsdpckpt.diff(FOLDER, FIXTURES / "lightning" / "reference_model.safetensors")
    assert report.equal and [t.name for t in report.tensors] == [
        "net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


# ------------------------------------------------------------------------------ merge

def test_merge_optimizer_is_lightnings_own_optimizer(tmp_path):
    fsdpckpt.merge(FOLDER, tmp_path / "out", optimizer=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model.safetensors", "optimizer.safetensors"]
    want = _lightnings_own()
    # state by parameter name and param_groups (lr, betas... as non-tensor entries), nested
    # again from the key paths the merge kept
    optimizer = fsdpckpt.load_full_state_dict(tmp_path / "out" / "optimizer.safetensors")
    assert same_value(optimizer, want["optimizer_0"])
    assert same_value(fsdpckpt.load_full_state_dict(tmp_path / "out" / "model.safetensors"),
                      want["model"])


def test_the_optimizer_part_is_lightnings_optimizer_tensors():
    # reference_optimizer.safetensors: the consolidated file's optimizer_0 tensors, flattened
    report = fsdpckpt.diff(FOLDER, FIXTURES / "lightning" / "reference_optimizer.safetensors",
                           optimizer=True, names=["state.*"])
    assert report.equal and len(report.tensors) == 12
    assert all(t.identical for t in report.tensors)


def test_a_model_merge_writes_the_model_alone_in_bin_too(tmp_path):
    # The model file is what a model loader reads: meta.pt's entries are training state,
    # kept by load_full_state_dict and compared by diff, not written into it.
    fsdpckpt.merge(FOLDER, tmp_path / "out", format="bin")
    merged = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert same_value(merged, _lightnings_own()["model"])


# ------------------------------------------------------------------ hostile meta.pt

def _reads(folder):
    """Every verb that decodes meta.pt, each failing on its own."""
    return {
        "load": lambda: fsdpckpt.load_full_state_dict(folder),
        "diff": lambda: fsdpckpt.diff(folder, CONSOLIDATED),
    }


def test_a_meta_naming_a_callable_is_refused_and_nothing_runs(ckpt, tmp_path):
    sentinel = tmp_path / "pwned"
    torch.save(_meta() | {"hook": _RunsCommand(f"touch {sentinel}")}, ckpt / "meta.pt")
    for verb, read in _reads(ckpt).items():
        with pytest.raises(UnsafePickleError, match="meta.pt"):
            read()
        assert not sentinel.exists(), verb
    assert [p.path for p in inspect_checkpoint(ckpt).problems] == [str(ckpt / "meta.pt")]
    assert [p.path for p in verify_checkpoint(ckpt).problems] == [str(ckpt / "meta.pt")]
    assert not sentinel.exists()


def test_a_meta_declaring_a_huge_tensor_is_refused_unallocated(ckpt):
    from test_objects import _Blob

    (ckpt / "meta.pt").write_bytes(_Blob(10**15).archive(bytes(12)))
    for read in _reads(ckpt).values():
        with pytest.raises(FsdpCkptError, match=r"meta\.pt.*storage holds 12 bytes"):
            read()


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


#: A meta value no honest state holds, and what the one line says about it.
ENDLESS = {
    # 34 levels of {"a": d, "b": d}: 1.5 KB of pickle, 2**34 paths
    "shared": (lambda: _shared(34), "reference each other"),
    "deep": (lambda: _nested(50), "nested more than 40 levels"),
}


def _shared(levels: int) -> dict:
    node: dict = {}
    for _ in range(levels):
        node = {"a": node, "b": node}
    return node


@pytest.mark.parametrize("graph", sorted(ENDLESS))
def test_a_meta_nested_without_end_is_refused_in_one_line(ckpt, graph):
    make, says = ENDLESS[graph]
    torch.save(_meta() | {"loops": make()}, ckpt / "meta.pt")
    for read in _reads(ckpt).values():
        with pytest.raises(FsdpCkptError, match=says) as caught:
            read()
        assert "meta.pt" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.s3
def test_a_remote_lightning_folder_is_read_as_the_local_one(s3):
    from conftest import upload

    server, root = s3
    url = upload(server, FOLDER, f"s3://{root}/{FOLDER.name}")
    state = fsdpckpt.load_full_state_dict(url, storage_options=server.options)
    assert same_value(state, _lightnings_own())
    report = fsdpckpt.diff(url, CONSOLIDATED, storage_options=server.options)
    assert report.equal and len(report.objects) == 95
