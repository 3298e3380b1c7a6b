"""Rank-local state is never merged as if it were replicated (issue 17 §4).

VeRL's FSDP1 ``FSDPCheckpointManager`` saves ``optimizer.state_dict()`` per rank: the state
of each rank's own shard of the flat parameters, under the same key and (padded) shape on
every rank, with different bytes. A tensor several ranks store whole is one tensor only
when every rank's copy holds the same bytes (compared by the CRC-32 each zip records).

The optimizer files here are built in the test with ``torch.save`` as VeRL writes them
(``torch.save(optimizer.state_dict(), f"optim_world_size_2_rank_{rank}.pt")``) beside the
real 2-rank VeRL model files of ``fixtures/verl``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fsdpckpt import inspect_checkpoint, merge, verify_checkpoint
from fsdpckpt.errors import NotACheckpointError

from conftest import FIXTURES, assert_one_line_error, run_cli

VERL = FIXTURES / "verl"


def _optimizer_state(rank: int, *, same: bool = False, use_orig_params: bool = False) -> dict:
    """``optimizer.state_dict()`` of an FSDP1 rank: Adam's state for the rank's own shard."""
    generator = torch.Generator().manual_seed(0 if same else rank + 1)
    size = (10 if rank == 0 else 7) if use_orig_params else 8  # the shard, padded alike
    return {
        "state": {
            0: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.randn(size, generator=generator),
                "exp_avg_sq": torch.rand(size, generator=generator),
            }
        },
        "param_groups": [
            {
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "amsgrad": False,
                "params": [0],
            }
        ],
    }


def _verl_with_optimizer(tmp_path: Path, **kwargs) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(VERL, ckpt)
    for rank in range(2):
        torch.save(_optimizer_state(rank, **kwargs), ckpt / f"optim_world_size_2_rank_{rank}.pt")
    return ckpt


def test_merge_refuses_rank_local_optimizer_state_naming_key_kind_and_fix(tmp_path):
    ckpt = _verl_with_optimizer(tmp_path)
    with pytest.raises(
        NotACheckpointError,
        match=(
            r"optim_world_size_2_rank_1\.pt: 'optimizer\.state\.0\.exp_avg' is stored whole "
            r"by every rank but holds other bytes.*rank-local optimizer state.*model weights "
            r"only"
        ),
    ):
        merge(ckpt, tmp_path / "out", optimizer=True)
    assert not (tmp_path / "out").exists()


def test_the_cli_refusal_is_one_line(tmp_path):
    ckpt = _verl_with_optimizer(tmp_path)
    assert_one_line_error(
        run_cli("merge", ckpt, tmp_path / "out", "--optimizer"),
        "'optimizer.state.0.exp_avg'",
        "rank-local optimizer state",
    )


def test_inspect_does_not_call_rank_local_state_replicated(tmp_path):
    # Shown as rank-local (issue 20: a real VeRL FSDP1 run is a valid checkpoint whose
    # model inspect must still show), naming the key and why it cannot be merged.
    report = inspect_checkpoint(_verl_with_optimizer(tmp_path))
    optimizer = next(p for p in report.parts if p.kind == "optimizer")
    assert "'optimizer.state.0.exp_avg'" in optimizer.rank_local
    assert "rank-local optimizer state" in optimizer.rank_local
    assert "not a replicated tensor" in optimizer.rank_local
    assert optimizer.num_tensors == 0 and len(optimizer.files) == 2
    assert next(p for p in report.parts if p.kind == "model").num_tensors == 4
    text = run_cli("inspect", "--summary", tmp_path / "ckpt").stdout
    assert "rank-local state (not mergeable)" in text and "replicated" not in text.split(
        "Other state")[0]


def test_verify_reads_rank_local_state_as_intact_files(tmp_path):
    # Every rank file's entries match their CRC-32: not damage. merge --optimizer is what
    # refuses it (above); inspect says why.
    report = verify_checkpoint(_verl_with_optimizer(tmp_path))
    assert report.ok, report.problems


def test_the_model_weights_still_merge_beside_rank_local_optimizer_state(tmp_path):
    merge(_verl_with_optimizer(tmp_path), tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as merged:
        assert "0.weight" in set(merged.keys())


def test_shapes_that_differ_per_rank_are_named_rank_local_not_other_runs(tmp_path):
    # use_orig_params=True: each rank's state covers its own share of the parameters.
    ckpt = _verl_with_optimizer(tmp_path, use_orig_params=True)
    with pytest.raises(
        NotACheckpointError,
        match=(
            r"'optimizer\.state\.0\.exp_avg' is stored whole by every rank, as float32 "
            r"\[7\] here but float32 \[10\] on rank 0: it is rank-local optimizer state"
        ),
    ) as err:
        merge(ckpt, tmp_path / "out", optimizer=True)
    assert "different runs" not in str(err.value)


def test_state_that_some_ranks_lack_is_named_rank_local_not_taken_as_whole(tmp_path):
    # use_orig_params=True: a rank keeps no state for a parameter it holds no elements of.
    ckpt = _verl_with_optimizer(tmp_path, same=True)
    state = _optimizer_state(1, same=True)
    state["state"][1] = state["state"].pop(0)
    torch.save(state, ckpt / "optim_world_size_2_rank_1.pt")
    with pytest.raises(
        NotACheckpointError,
        match=(
            r"optim_world_size_2_rank_1\.pt: 'optimizer\.state\.0\.\w+' is stored whole "
            r"by rank 0 but missing here: it is rank-local optimizer state"
        ),
    ):
        merge(ckpt, tmp_path / "out", optimizer=True)


def test_replicated_tensors_with_equal_bytes_still_merge(tmp_path):
    ckpt = _verl_with_optimizer(tmp_path, same=True)
    merge(ckpt, tmp_path / "out", optimizer=True)
    want = _optimizer_state(0, same=True)["state"][0]
    with safe_open(str(tmp_path / "out" / "optimizer.safetensors"), framework="pt") as merged:
        for name, tensor in want.items():
            assert torch.equal(merged.get_tensor(f"state.0.{name}"), tensor), name


def test_flat_parameters_that_differ_per_rank_are_named_flat_parameters(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for rank in range(2):
        torch.save(
            {"model._fsdp_wrapped_module.layer._flat_param_buffer": torch.full((4,), float(rank))},
            ckpt / f"model_world_size_2_rank_{rank}.pt",
        )
    with pytest.raises(NotACheckpointError, match="FSDP1 flat parameters.*SHARDED_STATE_DICT"):
        merge(ckpt, tmp_path / "out")


@pytest.mark.multirank
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig-params"])
def test_a_real_fsdp1_runs_optimizer_files_are_refused_and_its_model_merges(
    use_orig_params, tmp_path
):
    import workers
    from multirank import run_ranks

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_ranks(workers.save_like_verl_fsdp1, str(ckpt), use_orig_params)
    with pytest.raises(NotACheckpointError, match="rank-local optimizer state") as err:
        merge(ckpt, tmp_path / "out", optimizer=True)
    assert "different runs" not in str(err.value)
    merge(ckpt, tmp_path / "model")
    assert (tmp_path / "model" / "model.safetensors").exists()
