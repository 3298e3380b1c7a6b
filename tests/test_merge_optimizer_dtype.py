"""`merge --optimizer --dtype`: the model is cast, the optimizer keeps its dtypes unless
`--optimizer-dtype` names one, and counters and scalars are never cast (issue 43, point 1);
`--optimizer` on a model folder is refused rather than ignored (point 4).

The checkpoints are real: a small model trained by torch's own optimizers for more than 256
steps (bf16 holds integers exactly only up to 256), saved with ``dcp.save`` in one process
as Accelerate lays them out and keys them (``{"model": ...}``, ``{"optimizer": ...}``).
"""

from __future__ import annotations

import json

import pytest

import fsdpckpt

from conftest import FIXTURES, assert_one_line_error, single_process
from conftest import run_cli as run

STEPS = 257  # past 256: bf16 would store 256


def _trained_checkpoint(folder, optimizer_class, **options):
    """``folder`` as Accelerate saves a model and its optimizer after ``STEPS`` real steps."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    optimizer = optimizer_class(model.parameters(), **options)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
    # Accelerate's keys: the parameters' fqns (state.0.weight.step), under one top-level key.
    dcp.save({"model": get_model_state_dict(model)},
             checkpoint_id=folder / "pytorch_model_fsdp_0", **single_process())
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=folder / "optimizer_0", **single_process())
    return folder


@pytest.fixture(scope="module")
def adamw_ckpt(tmp_path_factory):
    import torch

    return _trained_checkpoint(tmp_path_factory.mktemp("adamw") / "ckpt", torch.optim.AdamW)


@pytest.fixture(scope="module")
def asgd_ckpt(tmp_path_factory):
    import torch

    return _trained_checkpoint(tmp_path_factory.mktemp("asgd") / "ckpt", torch.optim.ASGD)


def _stored(ckpt):
    """The optimizer's tensors as DCP's own loader reads them, by merged name."""
    state = fsdpckpt.load_full_state_dict(ckpt / "optimizer_0")["optimizer"]
    return {f"state.{fqn}.{key}": value for fqn, entries in state["state"].items()
            for key, value in entries.items()}


def _merged(out, stem):
    from safetensors.torch import load_file

    return load_file(out / f"{stem}.safetensors")


def _merge(ckpt, out, *options):
    result = run("merge", ckpt, out, "--optimizer", "--quiet", *options)
    assert result.exit_code == 0, result.output
    return result


# --- --dtype casts the model only -------------------------------------------------------------

def test_dtype_keeps_a_real_adamw_step_past_256_exact(adamw_ckpt, tmp_path):
    import torch

    _merge(adamw_ckpt, tmp_path / "out", "--dtype", "bf16")
    optimizer = _merged(tmp_path / "out", "optimizer")
    steps = {name: t for name, t in optimizer.items() if name.endswith(".step")}
    assert len(steps) == 4
    for step in steps.values():
        assert step.dtype == torch.float32 and step.item() == float(STEPS)


def test_dtype_casts_the_model_and_leaves_the_optimizer_moments_as_stored(adamw_ckpt, tmp_path):
    import torch

    _merge(adamw_ckpt, tmp_path / "out", "--dtype", "bf16")
    assert {t.dtype for t in _merged(tmp_path / "out", "model").values()} == {torch.bfloat16}
    optimizer = _merged(tmp_path / "out", "optimizer")
    for name, stored in _stored(adamw_ckpt).items():
        assert optimizer[name].dtype == torch.float32
        assert torch.equal(optimizer[name], stored), name


def test_optimizer_dtype_casts_the_moments_but_never_the_step(adamw_ckpt, tmp_path):
    import torch

    _merge(adamw_ckpt, tmp_path / "out", "--optimizer-dtype", "bf16")
    optimizer = _merged(tmp_path / "out", "optimizer")
    for name, stored in _stored(adamw_ckpt).items():
        if name.endswith(".step"):
            assert optimizer[name].dtype == torch.float32 and optimizer[name].item() == STEPS
        else:
            assert torch.equal(optimizer[name], stored.to(torch.bfloat16)), name
    # Without --dtype the model keeps its dtype.
    assert {t.dtype for t in _merged(tmp_path / "out", "model").values()} == {torch.float32}


def test_optimizer_dtype_leaves_zero_dimensional_scalars_as_stored(asgd_ckpt, tmp_path):
    import torch

    _merge(asgd_ckpt, tmp_path / "out", "--optimizer-dtype", "bf16")
    optimizer = _merged(tmp_path / "out", "optimizer")
    stored = _stored(asgd_ckpt)
    scalars = {name for name, t in stored.items() if t.dim() == 0}
    assert {name.rsplit(".", 1)[1] for name in scalars} == {"step", "eta", "mu"}
    for name in scalars:  # ASGD's eta and mu are rates: a rounded one changes the resume
        assert torch.equal(optimizer[name], stored[name]), name
    assert optimizer["state.0.weight.ax"].dtype == torch.bfloat16


# --- the report says what kept its dtype ------------------------------------------------------

def test_the_report_says_which_optimizer_tensors_kept_their_dtype_and_why(adamw_ckpt, tmp_path):
    result = _merge(adamw_ckpt, tmp_path / "out", "--dtype", "bf16")
    assert ("kept 12 optimizer tensors in float32 (--dtype casts the model; --optimizer-dtype "
            "the optimizer's moments; 4 step counters and scalars are never cast)"
            in result.stdout)


def test_the_report_counts_only_the_counters_under_optimizer_dtype(adamw_ckpt, tmp_path):
    result = _merge(adamw_ckpt, tmp_path / "out", "--optimizer-dtype", "bf16")
    assert "kept 4 optimizer tensors in float32" in result.stdout


def test_the_json_report_names_what_kept_its_dtype(adamw_ckpt, tmp_path):
    result = _merge(adamw_ckpt, tmp_path / "out", "--dtype", "bf16", "--json")
    model, optimizer = json.loads(result.stdout)["outputs"]
    assert "kept_dtype" not in model  # only where a cast left something as stored
    kept = optimizer["kept_dtype"]
    assert sorted(kept["names"]) == sorted(_stored(adamw_ckpt))
    assert kept["dtypes"] == ["float32"] and kept["counters"] == 4
    assert "--optimizer-dtype" in kept["why"]


# --- the library ------------------------------------------------------------------------------

def test_merge_takes_optimizer_dtype(adamw_ckpt, tmp_path):
    import torch

    model, optimizer = fsdpckpt.merge(adamw_ckpt, tmp_path / "out", optimizer=True,
                                      dtype="bf16", optimizer_dtype="fp16")
    merged = _merged(tmp_path / "out", "optimizer")
    assert merged["state.0.weight.exp_avg_sq"].dtype == torch.float16
    assert merged["state.0.weight.step"].item() == STEPS
    assert optimizer.kept_dtype is not None and optimizer.kept_dtype.counters == 4
    assert model.kept_dtype is None


# --- asked for an optimizer that is not there -------------------------------------------------

def test_optimizer_dtype_without_an_optimizer_merge_is_refused(adamw_ckpt, tmp_path):
    result = run("merge", adamw_ckpt, tmp_path / "out", "--optimizer-dtype", "bf16")
    assert_one_line_error(result, "--optimizer-dtype", "--optimizer")
    assert not (tmp_path / "out").exists()


def test_optimizer_on_a_model_folder_is_refused_naming_the_checkpoint_folder(tmp_path):
    ckpt = FIXTURES / "fsdp2_accelerate"
    result = run("merge", ckpt / "pytorch_model_fsdp_0", tmp_path / "out", "--optimizer")
    assert_one_line_error(result, f"{ckpt / 'pytorch_model_fsdp_0'}", "model folder",
                          f"pass {ckpt} (the checkpoint folder) to merge its optimizer_0/ too")
    assert not (tmp_path / "out").exists()


def test_optimizer_on_a_lone_model_folder_is_refused(tmp_path, adamw_ckpt):
    import shutil

    lone = shutil.copytree(adamw_ckpt / "pytorch_model_fsdp_0", tmp_path / "weights")
    result = run("merge", lone, tmp_path / "out", "--optimizer")
    assert_one_line_error(result, str(lone), "model folder", "no optimizer")
    assert "checkpoint folder" not in result.stderr
    assert not (tmp_path / "out").exists()
