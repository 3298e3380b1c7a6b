"""Contained (issue 42): nothing outside a checkpoint's own folder is read or copied through a
link. A link is judged once, by where it leads: one that stays inside works as before; one
that leads out is refused in one line naming it (inspect, verify, merge, load_state,
load_full_state_dict, export-hf), or listed as refused and never walked (``list``).

Hostile folders are built from the committed fixtures by moving a part out and linking to
it, so the bytes behind every refused link are a valid part: only the link is wrong.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import fsdpckpt
from fsdpckpt import NotACheckpointError

from conftest import FIXTURES, assert_one_line_error, run_cli, save_small_checkpoint

ACCELERATE = FIXTURES / "fsdp2_accelerate"
TINY = FIXTURES / "tiny_llama"


def _linked_out(ckpt: Path, name: str, outside: Path) -> Path:
    """``ckpt/name`` moved to ``outside`` and replaced by a link to it."""
    shutil.move(ckpt / name, outside)
    (ckpt / name).symlink_to(outside)
    return outside


def _small_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)  # not save_small_checkpoint's seed: a load would change the weights
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters())


# --- list: a walk judges links, never follows one out ----------------------------------

def test_list_refuses_a_checkpoint_linking_to_the_root_of_the_file_system(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ACCELERATE, run / "checkpoint_1")
    (run / "checkpoint_2").symlink_to("/")
    start = time.monotonic()
    result = run_cli("list", run, "--json")
    assert time.monotonic() - start < 5  # the walk of / took minutes
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    refused = doc["checkpoints"][1]
    assert (refused["name"], refused["state"], refused["bytes"], refused["files"]) == \
        ("checkpoint_2", "unreadable", 0, 0)
    assert "a symlink to /, outside the run folder" in refused["why"]
    assert doc["latest"] == str(run / "checkpoint_1")


def test_list_of_a_root_given_as_a_link_judges_its_links_where_it_resolves(tmp_path):
    run = tmp_path / "elsewhere" / "run"
    shutil.copytree(ACCELERATE, run / "checkpoint_1")
    (run / "latest").symlink_to("checkpoint_1")  # inside: listed as what it leads to
    (run / "checkpoint_9").symlink_to("/usr")  # out: refused, never walked
    (run / "data").symlink_to("/usr")  # out, no checkpoint's name: left out
    (tmp_path / "run").symlink_to(run)
    found = fsdpckpt.list_checkpoints(tmp_path / "run")
    states = {c.name: (c.state, c.bytes) for c in found.checkpoints}
    assert states["checkpoint_1"] == states["latest"] and states["latest"][0] == "complete"
    assert states["checkpoint_9"] == ("unreadable", 0) and "data" not in states
    result = run_cli("list", tmp_path / "run")
    assert "checkpoint_9: " in result.stdout and "a symlink to /usr" in result.stdout


def test_list_of_a_root_that_is_a_link_to_the_file_system_root_finishes_at_once(tmp_path):
    (tmp_path / "run").symlink_to("/")
    start = time.monotonic()
    result = run_cli("list", tmp_path / "run")
    assert time.monotonic() - start < 5
    assert_one_line_error(result, "holds no checkpoint folder")


# --- a part folder linking out ----------------------------------------------------------

@pytest.mark.parametrize("verb", ["inspect", "verify", "merge"])
def test_a_part_folder_linking_out_is_refused_by_the_verbs(accelerate_ckpt, tmp_path, verb):
    outside = _linked_out(accelerate_ckpt, "pytorch_model_fsdp_0", tmp_path / "other_model")
    args = [verb, accelerate_ckpt] + ([tmp_path / "out"] if verb == "merge" else [])
    assert_one_line_error(run_cli(*args), f"{accelerate_ckpt / 'pytorch_model_fsdp_0'}: "
                          f"a symlink to {outside}, outside the checkpoint folder")
    assert not (tmp_path / "out").exists()


def test_a_part_folder_linking_out_is_named_by_diff(accelerate_ckpt, tmp_path):
    outside = _linked_out(accelerate_ckpt, "pytorch_model_fsdp_0", tmp_path / "other_model")
    assert_one_line_error(run_cli("diff", accelerate_ckpt, ACCELERATE),
                          f"{accelerate_ckpt / 'pytorch_model_fsdp_0'}: "
                          f"a symlink to {outside}, outside the checkpoint folder")


def test_a_part_folder_linking_out_is_refused_by_load_full_state_dict(accelerate_ckpt,
                                                                       tmp_path):
    _linked_out(accelerate_ckpt, "pytorch_model_fsdp_0", tmp_path / "other_model")
    with pytest.raises(NotACheckpointError, match=r"pytorch_model_fsdp_0: a symlink to"):
        fsdpckpt.load_full_state_dict(accelerate_ckpt)


def test_a_part_folder_linking_out_is_refused_by_load_state(tmp_path):
    ckpt = save_small_checkpoint(tmp_path / "ckpt")
    _linked_out(ckpt, "pytorch_model_fsdp_0", tmp_path / "other_model")
    model, optimizer = _small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NotACheckpointError, match=r"pytorch_model_fsdp_0: a symlink to .*"
                       r"outside the checkpoint folder"):
        fsdpckpt.load_state(ckpt, model, optimizer)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# --- side files linking out -------------------------------------------------------------

@pytest.mark.parametrize("name", ["random_states_0.pkl", "scheduler.bin"])
@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_a_side_file_linking_out_is_refused_by_inspect_and_verify(accelerate_ckpt, tmp_path,
                                                                  name, verb):
    outside = _linked_out(accelerate_ckpt, name, tmp_path / name)
    assert_one_line_error(run_cli(verb, accelerate_ckpt),
                          f"{accelerate_ckpt / name}: a symlink to {outside}")


@pytest.mark.parametrize("name", ["random_states_0.pkl", "scheduler.bin"])
def test_a_side_file_linking_out_is_refused_by_load_state(tmp_path, name):
    model, optimizer = _small_model()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ckpt = tmp_path / "ckpt"
    fsdpckpt.save_state(ckpt, model, optimizer, scheduler, step=3)
    _linked_out(ckpt, name, tmp_path / name)
    with pytest.raises(NotACheckpointError, match=rf"{name}: a symlink to"):
        fsdpckpt.load_state(ckpt, model, optimizer, scheduler)


# --- links that stay inside keep working ------------------------------------------------

def test_links_that_stay_inside_the_checkpoint_still_load(tmp_path):
    run = tmp_path / "run"
    ckpt = save_small_checkpoint(run / "checkpoint_3", step=3)
    (ckpt / "kept").mkdir()
    shutil.move(ckpt / "random_states_0.pkl", ckpt / "kept" / "random_states_0.pkl")
    (ckpt / "random_states_0.pkl").symlink_to(Path("kept") / "random_states_0.pkl")
    (run / "latest").symlink_to("checkpoint_3")
    assert run_cli("inspect", run / "latest").exit_code == 0
    model, optimizer = _small_model()
    assert fsdpckpt.load_state(run / "latest", model, optimizer).step == 3


# --- export-hf: no bytes from outside into an export made for upload --------------------

def _verl_run(tmp_path: Path) -> Path:
    """The tiny run with its config and tokenizer in ``checkpoint-3/huggingface/`` (VeRL's
    place) and none above it."""
    run = tmp_path / "run"
    shutil.copytree(TINY / "tied", run)
    hf = run / "checkpoint-3" / "huggingface"
    hf.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "chat_template.jinja"):
        (run / name).rename(hf / name)
    return run


@pytest.mark.parametrize("where", ["checkpoint-3/huggingface", "huggingface",
                                   "checkpoint-3/config.json"])
def test_export_hf_refuses_a_side_folder_or_config_linking_out(tmp_path, where):
    run = _verl_run(tmp_path)
    hf = run / "checkpoint-3" / "huggingface"
    if where == "huggingface":  # the run folder's huggingface/ above the checkpoint
        hf.rename(run / "huggingface")
    if where.endswith("config.json"):  # HF Trainer's place: the checkpoint folder itself
        for file in list(hf.iterdir()):
            file.rename(run / "checkpoint-3" / file.name)
        hf.rmdir()
    outside = _linked_out(run, where, tmp_path / "secret")
    result = run_cli("export-hf", run / "checkpoint-3", tmp_path / "out")
    assert_one_line_error(result, f"{run / where}: a symlink to {outside}, outside")
    assert not (tmp_path / "out").exists()


def test_export_hf_takes_a_huggingface_folder_linked_inside_the_checkpoint(tmp_path):
    run = _verl_run(tmp_path)
    hf = run / "checkpoint-3" / "huggingface"
    hf.rename(run / "checkpoint-3" / "hf_files")
    hf.symlink_to("hf_files")
    fsdpckpt.export_hf(run / "checkpoint-3", tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == \
        (TINY / "tied" / "tokenizer.json").read_bytes()
