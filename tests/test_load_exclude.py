"""load_state(exclude=...) and CheckpointManager.restore(exclude=...): partial loads (issue 19),
as torchtitan's exclude_from_loading: parts and model-key globs left out, nothing else changed."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

import fsdpckpt
from fsdpckpt.training.state import StateMismatchError

import workers
from deep_compare import assert_same_tensors
from multirank import run_ranks

multirank = pytest.mark.multirank


def _trained_and_saved(tmp_path):
    """A model, AdamW and StepLR after two steps, saved with step=5."""
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    fsdpckpt.save_state(tmp_path / "ckpt", model, optimizer, scheduler, step=5)
    return tmp_path / "ckpt", model


def _fresh():
    model = workers.make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # differs from the saved weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _clone(state):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def test_excluded_optimizer_keeps_its_state_while_the_model_loads_bit_exact(tmp_path):
    ckpt, saved = _trained_and_saved(tmp_path)
    model, optimizer, scheduler = _fresh()
    optimizer_before = optimizer.state_dict()
    scheduler_before = scheduler.state_dict()
    result = fsdpckpt.load_state(ckpt, model, optimizer, scheduler,
                                 exclude=["optimizer", "scheduler"])
    assert_same_tensors(model.state_dict(), saved.state_dict())  # bitwise
    assert optimizer.state_dict()["state"] == {} and optimizer_before["state"] == {}
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert scheduler.state_dict() == scheduler_before
    assert result.restored == ("model", "rng") and result.step == 5
    assert result.excluded == ("optimizer", "scheduler")
    assert result.to_json()["excluded"] == ["optimizer", "scheduler"]


def test_an_excluded_part_is_not_read(tmp_path):
    ckpt, saved = _trained_and_saved(tmp_path)
    (ckpt / "scheduler.bin").unlink()
    shutil.rmtree(ckpt / "optimizer_0")
    model, optimizer, scheduler = _fresh()
    fsdpckpt.load_state(ckpt, model, optimizer, scheduler, exclude=("optimizer", "scheduler"))
    assert_same_tensors(model.state_dict(), saved.state_dict())


def test_excluded_rng_is_left_as_it_is_and_the_step_still_comes_back(tmp_path):
    ckpt, _saved = _trained_and_saved(tmp_path)
    model = workers.make_model()  # it seeds torch: built first
    random.seed(12345)
    torch.manual_seed(12345)
    expected = (random.random(), torch.rand(3))
    random.seed(12345)
    torch.manual_seed(12345)
    result = fsdpckpt.load_state(ckpt, model, exclude="rng")
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])
    assert result.step == 5 and "rng" not in result.restored and result.excluded == ("rng",)


def test_excluded_extra_is_not_loaded(tmp_path):
    class Counter:
        def __init__(self, n):
            self.n = n

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    model = workers.make_model()
    fsdpckpt.save_state(tmp_path / "ckpt", model, extra={"c": Counter(7)}, step=1)
    fresh = Counter(0)
    result = fsdpckpt.load_state(tmp_path / "ckpt", model, extra={"c": fresh}, exclude="extra")
    assert fresh.n == 0 and result.restored == ("model", "rng")


def test_a_key_glob_skips_those_keys_and_a_new_head_loads_the_rest_strictly(tmp_path):
    ckpt, saved = _trained_and_saved(tmp_path)
    # A new head: layer 2 of another shape (17 -> 5 instead of 17 -> 3).
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 5))
    head = _clone({k: v for k, v in model.state_dict().items() if k.startswith("2.")})
    with pytest.raises(StateMismatchError):  # without exclude: refused
        fsdpckpt.load_state(ckpt, model)
    result = fsdpckpt.load_state(ckpt, model, exclude="2.*")
    state, want = model.state_dict(), saved.state_dict()
    assert_same_tensors({k: state[k] for k in ("0.weight", "0.bias")},
                        {k: want[k] for k in ("0.weight", "0.bias")})
    assert_same_tensors({k: state[k] for k in head}, head)  # the new head kept its init
    assert result.excluded == ("model:2.weight", "model:2.bias")
    assert result.restored == ("model", "rng")


def test_a_glob_does_not_hide_other_mismatches(tmp_path):
    ckpt, _saved = _trained_and_saved(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    before = _clone(model.state_dict())
    with pytest.raises(StateMismatchError, match="0.weight") as caught:
        fsdpckpt.load_state(ckpt, model, exclude="2.*")
    assert "2.weight" not in str(caught.value)
    assert_same_tensors(model.state_dict(), before)


@pytest.mark.parametrize("exclude, match", [
    ("optimzer", r"unknown part 'optimzer'.*optimizer, scheduler, scaler, rng, extra, "
                 "dataloader"),
    ("lm_head.*", r"exclude='lm_head\.\*' matches no key"),
    (["optimizer", "3.*"], r"exclude='3\.\*' matches no key"),
])
def test_an_unknown_part_or_a_glob_matching_nothing_changes_nothing(tmp_path, exclude, match):
    ckpt, _saved = _trained_and_saved(tmp_path)
    model, optimizer, scheduler = _fresh()
    before = _clone(model.state_dict())
    optimizer_before, scheduler_before = optimizer.state_dict(), scheduler.state_dict()
    with pytest.raises(fsdpckpt.OptionError, match=match):
        fsdpckpt.load_state(ckpt, model, optimizer, scheduler, exclude=exclude)
    assert_same_tensors(model.state_dict(), before)
    assert optimizer.state_dict()["state"] == {} == optimizer_before["state"]
    assert scheduler.state_dict() == scheduler_before


def test_a_glob_matching_only_the_checkpoint_is_accepted(tmp_path):
    ckpt, saved = _trained_and_saved(tmp_path)
    # The model lacks layer 2 (the checkpoint has it): excluding it loads the rest strictly.
    model = torch.nn.Sequential(torch.nn.Linear(8, 17))
    fsdpckpt.load_state(ckpt, model, exclude="2.*")
    assert torch.equal(model[0].weight, saved[0].weight)


def test_without_exclude_the_result_json_is_unchanged(tmp_path):
    ckpt, _saved = _trained_and_saved(tmp_path)
    result = fsdpckpt.load_state(ckpt, workers.make_model())
    assert result.excluded == () and set(result.to_json()) == {"step", "restored", "warnings"}


def test_restore_passes_exclude_through(tmp_path):
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    manager = fsdpckpt.CheckpointManager(tmp_path / "run")
    manager.save(3, model=model, optimizer=optimizer)
    fresh, fresh_optimizer, _ = _fresh()
    step = fsdpckpt.CheckpointManager(tmp_path / "run").restore(
        model=fresh, optimizer=fresh_optimizer, exclude=["optimizer"])
    assert step == 3
    assert_same_tensors(fresh.state_dict(), model.state_dict())
    assert fresh_optimizer.state_dict()["state"] == {}


def _two_rank_exclude(rank: int, world: int, ckpt: str) -> dict:
    model = workers.wrap(workers.make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # saved moments are not zero
    fsdpckpt.save_state(ckpt, model, optimizer, step=4)
    fresh = workers.wrap(torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(),
                                             torch.nn.Linear(17, 5)), "fsdp2")
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    result = fsdpckpt.load_state(ckpt, fresh, fresh_optimizer, exclude=["optimizer", "2.*"])
    params, optim = workers.full_state(fresh, fresh_optimizer)
    saved, _ = workers.full_state(model, optimizer)
    return {"params": params, "saved": saved, "optim": optim, "excluded": result.excluded,
            "step": result.step}


@multirank
def test_two_ranks_agree_on_a_partial_load(tmp_path):
    ranks = run_ranks(_two_rank_exclude, str(tmp_path / "ckpt"))
    for rank in ranks:
        assert rank["step"] == 4
        assert rank["excluded"] == ("optimizer", "model:2.weight", "model:2.bias")
        # Reading it back (get_optimizer_state_dict) initializes it: zeros, never loaded.
        for values in rank["optim"]["state"].values():
            assert not values["exp_avg"].any() and not values["exp_avg_sq"].any()
    params, saved = ranks[0]["params"], ranks[0]["saved"]  # full state dicts: rank 0 has them
    assert_same_tensors({k: params[k] for k in ("0.weight", "0.bias")},
                        {k: saved[k] for k in ("0.weight", "0.bias")})
    assert params["2.weight"].shape == (5, 17)
