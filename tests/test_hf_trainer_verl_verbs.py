"""Every verb on HF Trainer and VeRL checkpoints, checked against each framework's own output
(issue 20, §5, §6 and its acceptance), bit for bit.

- HF Trainer: ``fixtures/hf_trainer_full/`` and ``fixtures/hf_trainer_lora/``, real 2-rank
  FSDP2 runs of ``transformers.Trainer`` (``fixtures/generate_hf_trainer.py``). The
  references are the model, optimizer and adapter the Trainer held at the checkpoint,
  gathered from the live model by torch, and peft's own ``merge_and_unload``.
- VeRL: real runs of VeRL's own checkpoint manager and merger are ``tests/test_verl_run.py``'s
  (``fixtures/verl_fsdp1/``, ``fixtures/verl_fsdp2/``). Here: the stand-in ``fixtures/verl/``
  (FSDP2 rank files with an optimizer merge can be checked against), and FSDP1 and FSDP2 saves
  of the HF Trainer run's tiny Llama written here on 2 ranks in VeRL's layout
  (``model_world_size_2_rank_{r}.pt``, ``fsdp_config.json``, ``huggingface/``); the FSDP1 one
  without a device mesh, so its rank files hold ShardedTensors, which VeRL's own runs (always
  on a mesh) never write. The reference is what VeRL's ``model_merger`` computes: each rank's
  local shard, concatenated in rank order along its placement (and cast to bf16, the
  merger's dtype).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_perrank import _torch_reference

import fsdpckpt

from conftest import FIXTURES, assert_one_line_error, run_cli
from deep_compare import assert_same_tensors
from multirank import run_ranks

FULL = FIXTURES / "hf_trainer_full"
LORA = FIXTURES / "hf_trainer_lora"
VERL = FIXTURES / "verl"


@dataclass(frozen=True)
class Run:
    """A checkpoint and the framework's own view of what it holds."""

    ckpt: Path
    model: Path       # the model (or adapter) the framework held, as safetensors
    optimizer: Path   # its optimizer state, named as merge --optimizer names it
    model_keys: int
    style: str
    label: str


RUNS = {
    "hf-trainer-full": Run(FULL / "run" / "checkpoint-3", FULL / "reference_model.safetensors",
                           FULL / "reference_optimizer.safetensors", 12, "hf-trainer",
                           "HF Trainer checkpoint"),
    "hf-trainer-lora": Run(LORA / "run" / "checkpoint-3", LORA / "trained_adapter.safetensors",
                           LORA / "reference_optimizer.safetensors", 4, "hf-trainer",
                           "HF Trainer checkpoint"),
}


# --- HF Trainer: inspect, verify, merge, diff, load_full_state_dict ----------------------

@pytest.mark.parametrize("which", sorted(RUNS))
def test_inspect_shows_the_trainers_parts_and_state(which):
    run = RUNS[which]
    result = run_cli("inspect", run.ckpt, "--summary")
    assert result.exit_code == 0, result.output
    assert run.label in result.stdout and "Not recognized" not in result.stdout
    report = fsdpckpt.inspect_checkpoint(run.ckpt)
    assert report.ok and report.style == run.style
    assert [p.kind for p in report.parts] == ["model", "optimizer"]
    assert len(report.parts[0].tensors) == run.model_keys
    kinds = sorted(f.kind for f in report.side_files)
    assert kinds == ["rng", "rng", "scheduler", "trainer_state"]


@pytest.mark.parametrize("which", sorted(RUNS))
def test_verify_reads_every_chunk(which):
    result = run_cli("verify", RUNS[which].ckpt)
    assert result.exit_code == 0, result.output
    assert ": OK" in result.stdout


@pytest.mark.parametrize("which", sorted(RUNS))
def test_merge_writes_the_model_and_optimizer_the_trainer_held(which, tmp_path):
    run = RUNS[which]
    result = run_cli("merge", "--optimizer", run.ckpt, tmp_path / "out")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(run.model))
    assert_same_tensors(load_file(out / "optimizer.safetensors"), load_file(run.optimizer))


@pytest.mark.parametrize("which", sorted(RUNS))
def test_diff_against_the_trainers_own_model_is_equal(which):
    run = RUNS[which]
    result = run_cli("diff", run.ckpt, run.model)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith(f"EQUAL: {run.model_keys} tensors")


@pytest.mark.parametrize("which", sorted(RUNS))
def test_load_full_state_dict_is_the_trainers_model(which):
    run = RUNS[which]
    state = fsdpckpt.load_full_state_dict(run.ckpt)
    assert sorted(state) == ["model"]  # as torch's dcp_to_torch_save of the model folder
    assert_same_tensors(state["model"], load_file(run.model))


@pytest.mark.parametrize("which", sorted(RUNS))
def test_merge_weights_and_convert_round_trip_the_trainers_model(which, tmp_path):
    run = RUNS[which]
    result = run_cli("merge-weights", run.ckpt / "pytorch_model_fsdp_0", tmp_path / "acc")
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(tmp_path / "acc" / "model.safetensors"), load_file(run.model))
    result = run_cli("convert", run.model, tmp_path / "seed" / "pytorch_model_fsdp_0")
    assert result.exit_code == 0, result.output
    assert run_cli("diff", tmp_path / "seed", run.ckpt).exit_code == 0


# --- HF Trainer: export-hf ----------------------------------------------------------------

def test_full_export_loads_in_transformers_as_the_trainers_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    result = run_cli("export-hf", RUNS["hf-trainer-full"].ckpt, out, "--base", FULL / "base")
    assert result.exit_code == 0, result.output
    want = load_file(FULL / "reference_model.safetensors")
    assert_same_tensors(load_file(out / "model.safetensors"), want)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=False, output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == "LlamaForCausalLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template  # the base's side files came along
    assert run_cli("diff", RUNS["hf-trainer-full"].ckpt, out).exit_code == 0


def test_lora_adapter_export_is_the_trained_adapter_and_diffs_equal(tmp_path):
    out = tmp_path / "adapter"
    ckpt = RUNS["hf-trainer-lora"].ckpt
    result = run_cli("export-hf", ckpt, out, "--lora", "adapter")
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(out / "adapter_model.safetensors"),
               load_file(LORA / "trained_adapter.safetensors"))
    assert json.loads((out / "adapter_config.json").read_text()) == \
        json.loads((LORA / "run" / "adapter_config.json").read_text())
    # An adapter folder is read by diff, inspect and load_full_state_dict as its tensors.
    result = run_cli("diff", ckpt, out)
    assert result.exit_code == 0, result.output
    assert "EQUAL: 4 tensors" in result.stdout
    assert run_cli("inspect", out, "--summary").exit_code == 0
    assert_same_tensors(fsdpckpt.load_full_state_dict(out),
                        load_file(LORA / "trained_adapter.safetensors"))


def test_lora_export_without_lora_names_both_flags(tmp_path):
    result = run_cli("export-hf", RUNS["hf-trainer-lora"].ckpt, tmp_path / "out",
                     "--base", LORA / "base")
    assert_one_line_error(result, "holds LoRA adapters", "--lora adapter", "--lora fuse")
    assert not (tmp_path / "out").exists()


def test_lora_fuse_export_is_pefts_merge_and_unload(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "fused"
    result = run_cli("export-hf", RUNS["hf-trainer-lora"].ckpt, out, "--lora", "fuse",
                     "--base", LORA / "base")
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(out / "model.safetensors"),
                        load_file(LORA / "reference_fused.safetensors"))
    assert run_cli("diff", out, LORA / "reference_fused.safetensors").exit_code == 0
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=False, output_loading_info=True)
    assert not any(info.values()), info


# --- VeRL: the committed FSDP2 rank files --------------------------------------------------

def test_verl_inspect_lists_every_file_it_holds():
    result = run_cli("inspect", VERL, "--summary")
    assert result.exit_code == 0, result.output
    assert "VeRL checkpoint" in result.stdout and "Not recognized" not in result.stdout
    kinds = {f.name: f.kind for f in fsdpckpt.find_layout(VERL).side_files}
    assert kinds["huggingface/"] == "hf_config"


def test_verl_verify_merge_diff_and_load_agree_with_its_mergers_concatenation(tmp_path):
    model = _torch_reference(VERL, "model_world_size_2_rank_{}.pt")
    optimizer = _torch_reference(VERL, "optim_world_size_2_rank_{}.pt")
    assert run_cli("verify", VERL).exit_code == 0
    result = run_cli("merge", "--optimizer", VERL, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(tmp_path / "out" / "model.safetensors"), model)
    assert_same_tensors(load_file(tmp_path / "out" / "optimizer.safetensors"), optimizer)
    assert run_cli("diff", VERL, tmp_path / "out").exit_code == 0
    assert run_cli("diff", "--optimizer", VERL, tmp_path / "out").exit_code == 0
    assert_same_tensors(fsdpckpt.load_full_state_dict(VERL)["model"], model)  # as merge reads it


# --- VeRL: FSDP1 and FSDP2 saves of a Hugging Face model, exported -------------------------

def _save_like_verl(rank: int, world: int, root: str, version: int) -> None:
    """The tiny Llama of the HF Trainer run, saved as VeRL 0.9's ``FSDPCheckpointManager``
    saves it: ``model.state_dict()`` per rank (FSDP2: DTensors; FSDP1 under
    SHARDED_STATE_DICT: ShardedTensors), ``fsdp_config.json`` and, from rank 0, the config
    and tokenizer in ``huggingface/``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(FULL / "base")
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(load_file(FULL / "reference_model.safetensors"))
    path = Path(root) / f"model_world_size_{world}_rank_{rank}.pt"
    if version == 2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        torch.save(model.state_dict(), path)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                                  ShardedStateDictConfig(offload_to_cpu=True)):
            torch.save(model.state_dict(), path)
    if rank == 0:
        hf = Path(root) / "huggingface"
        config.save_pretrained(hf)
        transformers.AutoTokenizer.from_pretrained(FULL / "base").save_pretrained(hf)
        (Path(root) / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": version, "world_size": world}))


@pytest.fixture(scope="module", params=[1, 2], ids=["verl-fsdp1", "verl-fsdp2"])
def verl_llama(request, tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp(f"verl-fsdp{request.param}") / "global_step_3" / "actor"
    root.mkdir(parents=True)
    run_ranks(_save_like_verl, str(root), request.param)
    return root


@pytest.mark.multirank
def test_verl_export_is_the_mergers_model_and_loads_clean(verl_llama, tmp_path):
    transformers = pytest.importorskip("transformers")
    want = load_file(FULL / "reference_model.safetensors")  # the model VeRL held
    layout = fsdpckpt.find_layout(verl_llama)
    assert layout.style == "verl" and layout.other_files == ()
    assert run_cli("verify", verl_llama).exit_code == 0
    assert_same_tensors(fsdpckpt.load_full_state_dict(verl_llama)["model"], want)
    out = tmp_path / "hf"
    result = run_cli("export-hf", verl_llama, out)  # config and tokenizer from huggingface/
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(out / "model.safetensors"), want)
    assert run_cli("diff", verl_llama, out).exit_code == 0
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=False, output_loading_info=True)
    assert not any(info.values()), info
    # VeRL's merger writes bfloat16 (its shards cast with .bfloat16(), then concatenated).
    result = run_cli("export-hf", verl_llama, tmp_path / "bf16", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert_same_tensors(load_file(tmp_path / "bf16" / "model.safetensors"),
               {k: v.bfloat16() for k, v in want.items()})


def test_a_verl_run_copied_without_its_huggingface_folder_says_to_pass_base(tmp_path):
    ckpt = shutil.copytree(VERL, tmp_path / "actor", ignore=shutil.ignore_patterns("huggingface"))
    result = run_cli("export-hf", ckpt, tmp_path / "out")
    assert result.exit_code == 1 and "--base" in result.stderr
