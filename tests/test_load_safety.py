"""The training load path on hostile or damaged checkpoints (issue 9, sections 1 and 4).

Nothing a checkpoint holds reaches plain pickle on the way into ``load_state`` or
``CheckpointManager.restore``; and a load that fails changes no training state.
"""

from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import pytest
import torch

import fsdpckpt

import workers
from conftest import hostile_pickle
from deep_compare import assert_same_rng, assert_same_state


def _torch_rejects(folder) -> None:
    """Rewrite ``folder``'s ``.metadata`` with a value fsdpckpt's allowlist reads harmlessly
    but torch's own reader fails on (``storage_meta`` an int), so that torch falls back to
    the rank-local ``__0.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    metadata.storage_meta = 7
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _plant(folder, sentinel) -> None:
    _torch_rejects(folder)
    (folder / "__0.metadata").write_bytes(hostile_pickle(sentinel))


def _saved(tmp_path, **kwargs):
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    fsdpckpt.save_state(tmp_path / "ckpt", model, optimizer, step=5, **kwargs)
    return tmp_path / "ckpt"


def _fresh():
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()  # so the optimizer has state of its own to keep
    return model, optimizer


# --- section 1: no plain pickle on the load path ---------------------------------------

@pytest.mark.parametrize("part", ["pytorch_model_fsdp_0", "optimizer_0"])
def test_load_state_refuses_a_rank_local_metadata_payload_and_never_runs_it(tmp_path, part):
    ckpt = _saved(tmp_path)
    sentinel = tmp_path / "pwned"
    _plant(ckpt / part, sentinel)
    model, optimizer = _fresh()
    with pytest.raises(fsdpckpt.NotACheckpointError,
                       match=rf"{part}/__0\.metadata.*Nothing was executed"):
        fsdpckpt.load_state(ckpt, model, optimizer)
    assert not sentinel.exists()


def test_restore_refuses_a_rank_local_metadata_payload_and_never_runs_it(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path / "run")
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    manager.save(3, model=model, optimizer=optimizer)
    sentinel = tmp_path / "pwned"
    _plant(manager.latest() / "pytorch_model_fsdp_0", sentinel)
    model, optimizer = _fresh()
    with pytest.raises(fsdpckpt.NotACheckpointError, match=r"__0\.metadata"):
        manager.restore(model=model, optimizer=optimizer)
    assert not sentinel.exists()


def test_a_stray_rank_local_metadata_file_alone_is_refused(tmp_path):
    ckpt = _saved(tmp_path)
    (ckpt / "pytorch_model_fsdp_0" / "__1.metadata").write_bytes(b"anything")
    model, optimizer = _fresh()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(fsdpckpt.NotACheckpointError, match=r"__1\.metadata.*Delete __1\.metadata"):
        fsdpckpt.load_state(ckpt, model, optimizer)
    assert_same_state(model.state_dict(), before)


def test_metadata_torch_itself_would_reject_is_refused_by_our_reader_not_handed_on(tmp_path):
    # Torch would fail on it and fall back to rank-local files; our schema names the field.
    ckpt = _saved(tmp_path)
    _torch_rejects(ckpt / "pytorch_model_fsdp_0")
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fsdpckpt.NotACheckpointError, match="storage_meta"):
        fsdpckpt.load_state(ckpt, model)
    assert_same_state(model.state_dict(), before)


def test_the_load_path_never_calls_plain_pickle(tmp_path, monkeypatch):
    ckpt = _saved(tmp_path)
    model, optimizer = _fresh()

    def refuse(*_args, **_kwargs):
        raise AssertionError("plain pickle was called on the load path")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    result = fsdpckpt.load_state(ckpt, model, optimizer)
    monkeypatch.undo()
    assert result.restored == ("model", "optimizer", "rng")
    assert_same_state(model.state_dict(), workers.make_model().state_dict())


def test_the_storage_reader_answers_every_rank_with_dot_metadata_only(tmp_path):
    from fsdpckpt.training._dcp_io import safe_storage_reader

    ckpt = _saved(tmp_path)
    folder = ckpt / "pytorch_model_fsdp_0"
    reader = safe_storage_reader(folder)
    plain = reader.read_metadata()
    assert reader.read_metadata(rank=0) is plain
    assert set(plain.state_dict_metadata) == {"model.0.weight", "model.0.bias",
                                              "model.2.weight", "model.2.bias"}


def test_verify_names_a_stray_rank_local_metadata_file(tmp_path):
    ckpt = _saved(tmp_path, manifest=False)  # no manifest: nothing else would call it stray
    (ckpt / "optimizer_0" / "__0.metadata").write_bytes(b"anything")
    report = fsdpckpt.verify_checkpoint(ckpt)
    assert not report["ok"]
    named = [p for p in report["problems"] if p["path"].endswith("optimizer_0/__0.metadata")]
    assert named and "rank-local" in named[0]["message"]


# --- section 4: all or nothing -------------------------------------------------------------

class _Counter:
    """A stateful object (for scaler= and extra=) whose state is a plain dict."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _rng_state():
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


_PART_FILES = {"rng": "random_states_0.pkl", "scheduler": "scheduler.bin",
               "scaler": "scaler.pt", "extra": "custom_checkpoint_0.pkl"}


def _full_checkpoint(tmp_path):
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    fsdpckpt.save_state(tmp_path / "ckpt", model, optimizer, scheduler, step=5,
                        scaler=_Counter(4), extra={"counter": _Counter(9)})
    return tmp_path / "ckpt"


def _load_changes_nothing(ckpt, error=fsdpckpt.FsdpCkptError) -> None:
    model, optimizer = _fresh()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7)
    scaler, counter = _Counter(1), _Counter(2)
    params = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(optimizer.state_dict())
    sched_state = copy.deepcopy(scheduler.state_dict())
    rng = _rng_state()
    with pytest.raises(error):
        fsdpckpt.load_state(ckpt, model, optimizer, scheduler, scaler=scaler,
                            extra={"counter": counter})
    assert_same_state(model.state_dict(), params)
    assert_same_state(optimizer.state_dict(), opt_state)
    assert scheduler.state_dict() == sched_state
    assert (scaler.value, counter.value) == (1, 2)
    assert_same_rng(_rng_state(), rng)


@pytest.mark.parametrize("part", sorted(_PART_FILES))
def test_a_damaged_part_changes_no_training_state(tmp_path, part):
    ckpt = _full_checkpoint(tmp_path)
    (ckpt / _PART_FILES[part]).write_bytes(b"PK\x03\x04 not really an archive")
    _load_changes_nothing(ckpt)


@pytest.mark.parametrize("part", ["scheduler", "scaler"])
def test_a_part_that_is_not_a_state_dict_changes_no_training_state(tmp_path, part):
    ckpt = _full_checkpoint(tmp_path)
    torch.save([1, 2, 3], ckpt / _PART_FILES[part])
    _load_changes_nothing(ckpt, fsdpckpt.NotACheckpointError)


def test_rng_state_that_cannot_be_set_changes_no_training_state(tmp_path):
    ckpt = _full_checkpoint(tmp_path)
    torch.save({"step": 5, "random_state": (3, (1, 2), None),
                "torch_manual_seed": torch.zeros(3, dtype=torch.uint8)},
               ckpt / "random_states_0.pkl")
    _load_changes_nothing(ckpt)


def test_an_intact_checkpoint_still_restores_every_part(tmp_path):
    ckpt = _full_checkpoint(tmp_path)
    model, optimizer = _fresh()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7)
    scaler, counter = _Counter(1), _Counter(2)
    result = fsdpckpt.load_state(ckpt, model, optimizer, scheduler, scaler=scaler,
                                 extra={"counter": counter})
    assert result.restored == ("model", "optimizer", "scheduler", "scaler", "extra:counter",
                               "rng")
    assert (scaler.value, counter.value, scheduler.step_size, result.step) == (4, 9, 2, 5)
