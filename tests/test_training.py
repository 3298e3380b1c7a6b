"""save_state / load_state: exact resume, resharding, Accelerate interop, and errors."""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import pytest
import torch

import fsdpckpt
from fsdpckpt.training.state import StateMismatchError

import workers
from conftest import FIXTURES, single_process
from deep_compare import assert_same_state, assert_same_tensors
from multirank import run_ranks

multirank = pytest.mark.multirank


def _equal_params(a: dict, b: dict) -> None:
    assert_same_tensors(a, b, bitwise=False)  # by value: torch.equal


@pytest.fixture(scope="module", params=["fsdp2", "fsdp1", "fsdp1-grad-op", "ddp"])
def resumed(request, tmp_path_factory):
    """One uninterrupted 2-rank run, and one that saves at step 2, exits, and resumes."""
    kind, ckpt = request.param, str(tmp_path_factory.mktemp(request.param) / "ckpt")
    straight = run_ranks(workers.train, kind, ckpt + "-unused", 6, None, False)
    first = run_ranks(workers.train, kind, ckpt, 6, 2, False)
    second = run_ranks(workers.train, kind, ckpt, 6, None, True)
    return kind, ckpt, straight, first, second


@multirank
def test_resume_gives_bit_identical_losses_and_parameters(resumed):
    _kind, _ckpt, straight, first, second = resumed
    for rank in range(2):
        assert first[rank]["losses"] + second[rank]["losses"] == straight[rank]["losses"]
        assert len(second[rank]["losses"]) == 3
    _equal_params(second[0]["params"], straight[0]["params"])
    for rank in range(2):
        assert_same_state(second[rank]["optim"], straight[rank]["optim"])
    assert second[0]["lr"] == straight[0]["lr"]


@multirank
def test_resume_restores_every_part(resumed):
    second = resumed[4]
    assert second[0]["restored"] == ("model", "optimizer", "scheduler", "rng")
    assert second[0]["warnings"] == ()


@multirank
def test_layout_is_accelerates(resumed):
    ckpt = resumed[1]
    assert sorted(os.listdir(ckpt)) == ["fsdpckpt.json", "optimizer_0", "pytorch_model_fsdp_0",
                                        "random_states_0.pkl", "random_states_1.pkl",
                                        "scheduler.bin"]


@multirank
def test_two_rank_checkpoint_loads_into_one_plain_process(resumed):
    _kind, ckpt, _straight, first, _second = resumed
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    result = fsdpckpt.load_state(ckpt, model, optimizer, scheduler)
    params, optim = workers.full_state(model, optimizer)
    _equal_params(params, first[0]["params"])
    saved = fsdpckpt.load_full_state_dict(os.path.join(ckpt, "optimizer_0"))["optimizer"]
    assert_same_state(optim, saved)
    assert result.step == 2 and result.warnings  # 1 rank, RNG saved for 2: said, not silent


@multirank
def test_two_rank_checkpoint_loads_on_two_ranks_with_equal_state(resumed):
    kind, ckpt, _straight, first, _second = resumed
    loaded = run_ranks(workers.load_into, kind, ckpt)
    _equal_params(loaded[0]["params"], first[0]["params"])
    for rank in range(2):
        assert_same_state(loaded[rank]["optim"], first[rank]["optim"])


@multirank
def test_checkpoint_of_one_parallelism_loads_into_another(resumed):
    kind, ckpt, _straight, first, _second = resumed
    other = "ddp" if kind.startswith("fsdp") else "fsdp2"
    loaded = run_ranks(workers.load_into, other, ckpt)
    _equal_params(loaded[0]["params"], first[0]["params"])


def test_plain_single_process_resume_is_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = workers.train(0, 1, "plain", ckpt + "-unused", 6, None, False)
    first = workers.train(0, 1, "plain", ckpt, 6, 2, False)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # scramble: load must restore
    second = workers.train(0, 1, "plain", ckpt, 6, None, True)
    assert first["losses"] + second["losses"] == straight["losses"]
    _equal_params(second["params"], straight["params"])


@multirank
def test_accelerate_load_state_reads_our_checkpoint(tmp_path):
    ranks = run_ranks(workers.accelerate_loads_ours, str(tmp_path / "ckpt"))
    saved = ranks[0]["saved"]
    _equal_params(ranks[0]["params"], saved["params"])
    assert_same_state(ranks[0]["optim"], saved["optim"])
    assert ranks[0]["sched"]["last_epoch"] == 2


@multirank
def test_we_read_accelerates_checkpoint(tmp_path):
    ranks = run_ranks(workers.we_load_accelerates, str(tmp_path / "ckpt"))
    saved_params, saved_optim, saved_sched = ranks[0]["saved"]
    _equal_params(ranks[0]["params"], saved_params)
    assert_same_state(ranks[0]["optim"], saved_optim)
    assert ranks[0]["sched"] == saved_sched
    assert ranks[0]["restored"] == ("model", "optimizer", "scheduler", "rng")


def test_accelerate_fixture_loads_into_a_plain_model():
    # The committed fixture was written by accelerator.save_state on 2 FSDP2 ranks.
    import sys

    sys.path.insert(0, str(FIXTURES))
    from generate import _model

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    result = fsdpckpt.load_state(FIXTURES / "fsdp2_accelerate", model, optimizer, scheduler)
    expected = fsdpckpt.load_full_state_dict(FIXTURES / "fsdp2_accelerate" /
                                             "pytorch_model_fsdp_0")["model"]
    _equal_params(model.state_dict(), expected)
    saved = torch.load(FIXTURES / "fsdp2_accelerate" / "scheduler.bin", weights_only=True)
    # Every saved entry restored; a torch may add entries of its own (2.6's 'verbose').
    assert {k: v for k, v in scheduler.state_dict().items() if k in saved} == saved
    assert result.restored == ("model", "optimizer", "scheduler", "rng")


# --- errors --------------------------------------------------------------------

def _saved_plain(tmp_path):
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    fsdpckpt.save_state(tmp_path / "ckpt", model, optimizer, step=5)
    return tmp_path / "ckpt"


def test_mismatched_model_is_refused_before_anything_changes(tmp_path):
    ckpt = _saved_plain(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3),
                                torch.nn.Linear(3, 3))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StateMismatchError) as caught:
        fsdpckpt.load_state(ckpt, other)
    message = str(caught.value)
    assert "1 missing from the checkpoint: 3.weight" in message.replace(", 3.bias", "") or \
        "missing from the checkpoint" in message
    assert "shape differs: 0.weight (checkpoint [17, 8], model [16, 8])" in message
    assert "strict=False" in message
    _equal_params(other.state_dict(), before)


def test_an_optimizer_option_an_older_torch_did_not_save_is_torchs_default(tmp_path):
    # torch 2.6's AdamW has no decoupled_weight_decay (2.7 added it): its checkpoints lack
    # it, and torch's own load_state_dict of such a state dict sets AdamW's default.
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    for group in optimizer.param_groups:
        group.pop("decoupled_weight_decay", None)
    saved = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    fsdpckpt.save_state(tmp_path / "ckpt", model, optimizer, step=1)
    target = workers.make_model()
    fresh = torch.optim.AdamW(target.parameters(), lr=0.5, betas=(0.1, 0.2))
    fsdpckpt.load_state(tmp_path / "ckpt", target, fresh)
    group = fresh.param_groups[0]
    assert {k: group[k] for k in saved} == saved
    assert group.get("decoupled_weight_decay", True) is True
    for param, before in zip(group["params"], optimizer.param_groups[0]["params"]):
        assert torch.equal(fresh.state[param]["exp_avg"], optimizer.state[before]["exp_avg"])


def test_non_strict_load_takes_the_keys_that_match(tmp_path):
    ckpt = _saved_plain(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3),
                                torch.nn.Linear(3, 3))
    fsdpckpt.load_state(ckpt, other, strict=False)
    saved = fsdpckpt.load_full_state_dict(ckpt / "pytorch_model_fsdp_0")["model"]
    assert torch.equal(other[0].weight, saved["0.weight"])


def test_missing_part_is_named(tmp_path):
    model = workers.make_model()
    fsdpckpt.save_state(tmp_path / "ckpt", model)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(fsdpckpt.FsdpCkptError, match="optimizer_0/"):
        fsdpckpt.load_state(tmp_path / "ckpt", model, optimizer)


def test_hostile_rng_file_is_refused_and_never_runs(tmp_path):
    ckpt = _saved_plain(tmp_path)
    sentinel = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    torch.save(Evil(), ckpt / "random_states_0.pkl")
    with pytest.raises(fsdpckpt.UnsafePickleError, match="random_states_0.pkl.*posix.system"):
        fsdpckpt.load_state(ckpt, workers.make_model())
    assert not sentinel.exists()


def test_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(fsdpckpt.NotACheckpointError, match="not a checkpoint"):
        fsdpckpt.load_state(tmp_path, workers.make_model())


def test_missing_folder(tmp_path):
    with pytest.raises(fsdpckpt.CheckpointNotFoundError):
        fsdpckpt.load_state(tmp_path / "nope", workers.make_model())


def test_step_comes_back(tmp_path):
    ckpt = _saved_plain(tmp_path)
    assert fsdpckpt.load_state(ckpt, workers.make_model()).step == 5


def test_rng_file_is_accelerates_format(tmp_path):
    ckpt = _saved_plain(tmp_path)
    state = fsdpckpt.training._rng.load_rng_file(ckpt / "random_states_0.pkl")
    assert {"step", "random_state", "numpy_random_seed", "torch_manual_seed"} <= set(state)


def test_async_save_completes_on_wait(tmp_path):
    model = workers.make_model()
    handle = fsdpckpt.save_state(tmp_path / "ckpt", model, async_save=True)
    handle.wait()
    assert handle.done()
    fresh = workers.make_model()
    with torch.no_grad():
        fresh[0].weight.zero_()
    fsdpckpt.load_state(tmp_path / "ckpt", fresh)
    _equal_params(fresh.state_dict(), model.state_dict())


def _training_example():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("training_example",
                                                  ROOT / "docs" / "training_example.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_documented_training_loop_resumes_exactly(tmp_path):
    example = _training_example()
    straight = example.main(str(tmp_path / "a"), total_steps=6)
    example.main(str(tmp_path / "b"), total_steps=4)        # stops after step 3 (saved)
    torch.manual_seed(123)                                   # the resume must restore RNG
    resumed = example.main(str(tmp_path / "b"), total_steps=6)
    assert resumed == straight[4:]


def test_the_documented_training_loop_never_resumes_from_a_save_that_crashed(tmp_path,
                                                                             monkeypatch):
    import torch.distributed.checkpoint as dcp

    example = _training_example()
    straight = example.main(str(tmp_path / "a"), total_steps=6)
    real_save, calls = dcp.save, []

    def die_in_the_third_save(*args, **kwargs):  # model, then optimizer, per checkpoint
        calls.append(1)
        if len(calls) == 6:  # step 5's model is written, its optimizer is not
            raise KeyboardInterrupt("killed mid-save")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", die_in_the_third_save)
    with pytest.raises(KeyboardInterrupt):
        example.main(str(tmp_path / "b"), total_steps=6)
    monkeypatch.setattr(dcp, "save", real_save)
    torch.manual_seed(123)
    resumed = example.main(str(tmp_path / "b"), total_steps=6)  # from step 3, the last whole one
    assert resumed == straight[4:]


def test_saving_into_an_old_checkpoint_leaves_no_stale_parts(tmp_path):
    model = workers.make_model()
    fsdpckpt.save_state(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()), step=1)
    fsdpckpt.save_state(tmp_path / "ckpt", model, step=2, overwrite=True)
    assert not (tmp_path / "ckpt" / "optimizer_0").exists()
    with pytest.raises(fsdpckpt.FsdpCkptError, match="optimizer_0/"):
        fsdpckpt.load_state(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()))


def test_saving_into_a_checkpoint_without_overwrite_is_refused_and_changes_nothing(tmp_path):
    model = workers.make_model()
    fsdpckpt.save_state(tmp_path / "ckpt", model, step=1)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(fsdpckpt.OutputExistsError, match=r"holds a checkpoint already "
                       r"\(fsdpckpt.json, pytorch_model_fsdp_0, random_states_0.pkl\); "
                       r"nothing was written.*overwrite=True"):
        fsdpckpt.save_state(tmp_path / "ckpt", model, step=2)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_saving_into_a_folder_of_other_files_is_not_an_overwrite(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    fsdpckpt.save_state(tmp_path / "ckpt", workers.make_model(), step=1)
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine"


def test_a_different_optimizer_is_refused_before_anything_changes(tmp_path):
    ckpt = _saved_plain(tmp_path)  # AdamW
    model = workers.make_model()
    with torch.no_grad():
        model[0].weight.zero_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(StateMismatchError, match="the optimizer does not match"):
        fsdpckpt.load_state(ckpt, model, sgd)
    _equal_params(model.state_dict(), before)


@multirank
def test_async_save_on_two_ranks_while_training_goes_on(tmp_path):
    ranks = run_ranks(workers.async_save_while_training, str(tmp_path / "ckpt"))
    assert all(r["done"] for r in ranks)
    model = workers.make_model()
    result = fsdpckpt.load_state(tmp_path / "ckpt", model)
    _equal_params(model.state_dict(), ranks[0]["saved"])
    assert result.step == 1


def test_hostile_object_inside_the_optimizer_folder_never_runs(tmp_path):
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    ckpt = _saved_plain(tmp_path)
    sentinel = tmp_path / "pwned"
    folder = ckpt / "optimizer_0"
    md = FileSystemReader(str(folder)).read_metadata()
    info = md.storage_data[MetadataIndex("optimizer.param_groups.0.lr")]
    blob = _torch_save_of_hostile(sentinel)
    data = (folder / info.relative_path).read_bytes()
    # Put the hostile blob at the end of the rank file and point the entry at it.
    (folder / info.relative_path).write_bytes(data + blob)
    info.offset, info.length = len(data), len(blob)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    model = workers.make_model()
    with pytest.raises(fsdpckpt.UnsafePickleError, match="param_groups.0.lr"):
        fsdpckpt.load_state(ckpt, model, torch.optim.AdamW(model.parameters(), lr=0.05))
    assert not sentinel.exists()


def _torch_save_of_hostile(sentinel) -> bytes:
    """What DCP stores for a non-tensor entry (a torch.save blob), but one that runs a command."""
    import io

    from conftest import _RunsCommand

    buffer = io.BytesIO()
    torch.save(_RunsCommand(f"touch {sentinel}"), buffer)
    return buffer.getvalue()


def test_hf_trainer_rng_files_are_restored(tmp_path):
    ckpt = _saved_plain(tmp_path)
    (ckpt / "random_states_0.pkl").unlink()
    torch.manual_seed(42)
    random.seed(42)
    np.random.seed(42)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                "cpu": torch.get_rng_state()}, ckpt / "rng_state_0.pth")
    expected = (torch.rand(1).item(), random.random(), float(np.random.rand()))
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    result = fsdpckpt.load_state(ckpt, workers.make_model())
    assert (torch.rand(1).item(), random.random(), float(np.random.rand())) == expected
    assert "rng" in result.restored


def test_manifest_can_be_left_out(tmp_path):
    model = workers.make_model()
    fsdpckpt.save_state(tmp_path / "ckpt", model, manifest=False)
    assert not (tmp_path / "ckpt" / "fsdpckpt.json").exists()
    assert fsdpckpt.verify_checkpoint(tmp_path / "ckpt")["ok"]


# --- torch's "torch.distributed is disabled" notice -------------------------------------

def _save_and_load_in_one_process(ckpt) -> None:
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    fsdpckpt.save_state(ckpt, model, optimizer, step=1)
    fsdpckpt.load_state(ckpt, model, optimizer)


def test_single_process_save_and_load_issue_no_warnings(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _save_and_load_in_one_process(tmp_path / "ckpt")
    assert [str(w.message) for w in caught] == []


def test_other_warnings_during_a_single_process_save_still_show(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def save_with_a_warning(*args, **kwargs):
        warnings.warn("a warning of another kind", UserWarning, stacklevel=2)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save_with_a_warning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _save_and_load_in_one_process(tmp_path / "ckpt")
    assert [str(w.message) for w in caught] == ["a warning of another kind"] * 2  # model, optim


def test_the_single_process_notice_is_silenced_only_inside_our_calls(tmp_path):
    import torch.distributed.checkpoint as dcp

    _save_and_load_in_one_process(tmp_path / "ckpt")
    with pytest.warns(UserWarning, match="assuming the intent is to save in a single process"):
        dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(tmp_path / "own"), **single_process())


class _Odd(torch.nn.Module):
    """A module whose parameter names hold " (", as a message's "key (checkpoint ...)" does."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_parameter("w (x", torch.nn.Parameter(torch.ones(size)))
        self.register_parameter("b", torch.nn.Parameter(torch.full((2,), 7.0)))


def test_non_strict_load_skips_a_mismatched_key_whatever_its_name_holds(tmp_path):
    fsdpckpt.save_state(tmp_path / "ckpt", _Odd(2))
    other = _Odd(3)
    with torch.no_grad():
        other.b.zero_()
    fsdpckpt.load_state(tmp_path / "ckpt", other, strict=False)
    assert torch.equal(other.b, torch.full((2,), 7.0))
    assert torch.equal(getattr(other, "w (x"), torch.ones(3))


def test_compare_reports_each_difference_as_data(tmp_path):
    from fsdpckpt.training._statecheck import ShapeMismatch, compare

    fsdpckpt.save_state(tmp_path / "ckpt", _Odd(2))
    state = {"w (x": torch.ones(3), "c": torch.ones(1)}
    result = compare(tmp_path / "ckpt" / "pytorch_model_fsdp_0", state, "model")
    assert result.missing == ["c"]
    assert result.unexpected == ["b"]
    assert result.mismatched == [ShapeMismatch("w (x", (2,), (3,))]
    assert result.unloadable == ["c", "w (x"]


def test_a_load_parses_each_dot_metadata_once(tmp_path):
    # The checks, the storage reader DCP loads through and the manifest's chunk checks all
    # read the model and optimizer folders: one parse each, shared.
    from fsdpckpt.dcp import reader

    ckpt = _saved_plain(tmp_path)
    model = workers.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    before = reader.parse_count
    fsdpckpt.load_state(ckpt, model, optimizer)
    assert reader.parse_count - before == 2
    fsdpckpt.load_state(ckpt, model, optimizer)  # nothing held between loads
    assert reader.parse_count - before == 4


def test_a_dot_metadata_replaced_on_disk_is_parsed_anew(tmp_path):
    from fsdpckpt.dcp import reader

    ckpt = _saved_plain(tmp_path)
    folder = ckpt / "pytorch_model_fsdp_0"
    first = reader.read_dcp_folder(folder)  # held: a second read shares it
    assert reader.read_dcp_folder(folder).metadata is first.metadata
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata.new").write_bytes(data)
    (folder / ".metadata.new").rename(folder / ".metadata")  # as a save publishes it
    assert reader.read_dcp_folder(folder).metadata is not first.metadata
