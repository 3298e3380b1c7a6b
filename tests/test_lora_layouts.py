"""LoRA checkpoints as trainers leave them (issue 20, section 5), each read as PEFT would.

- HF Trainer with PEFT under FSDP (`fixtures/hf_trainer_lora/`, a real 2-rank FSDP2 run
  saved with Accelerate's `save_fsdp_model(adapter_only=True)`, what the Trainer calls):
  adapter tensors only, adapter name dropped, no `adapter_config.json` in the checkpoint.
- QLoRA: the frozen base packed to 4 bits (bf16 `[N, 1]`), the adapters in fp32.
- A LoRA checkpoint exported without `--lora`, and `inspect` of one.

Fused weights are compared with peft's own `merge_and_unload`, bit for bit.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import fsdpckpt  # noqa: E402
from fsdpckpt.export.lora import fuse_into  # noqa: E402

from conftest import FIXTURES, assert_one_line_error, run_cli  # noqa: E402

RUN = FIXTURES / "hf_trainer_lora"
CKPT = RUN / "run" / "checkpoint-3"
BASE = RUN / "base"


def _merged(adapter_config, adapter_tensors) -> dict[str, torch.Tensor]:
    # What peft computes: the base model, the adapter loaded into it, merge_and_unload.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(BASE), trust_remote_code=False)
    model = peft.get_peft_model(model, peft.LoraConfig.from_pretrained(str(adapter_config)))
    loaded = peft.set_peft_model_state_dict(model, adapter_tensors)
    assert not loaded.unexpected_keys
    return model.merge_and_unload().state_dict()


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name


def test_hf_trainer_adapter_export_needs_no_base_weights(tmp_path):
    result = run_cli("export-hf", CKPT, tmp_path / "adapter", "--lora", "adapter", "--json")
    assert result.exit_code == 0, result.output
    got = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    _assert_bit_exact(got, load_file(RUN / "trained_adapter.safetensors"))  # the live model's
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config == json.loads((RUN / "run" / "adapter_config.json").read_text())


def test_hf_trainer_exported_adapter_loads_in_peft(tmp_path):
    fsdpckpt.export_hf(CKPT, tmp_path / "adapter", lora="adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(BASE))
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    state = model.state_dict()
    for name, tensor in load_file(RUN / "trained_adapter.safetensors").items():
        stored = name.replace(".weight", ".default.weight")
        assert torch.equal(state[stored], tensor), name


def test_hf_trainer_fuse_takes_base_weights_from_base(tmp_path):
    result = fsdpckpt.export_hf(CKPT, tmp_path / "fused", base=BASE, lora="fuse")
    assert result.model_class == "LlamaForCausalLM"
    want = _merged(RUN / "run", load_file(RUN / "trained_adapter.safetensors"))
    _assert_bit_exact(load_file(tmp_path / "fused" / "model.safetensors"), want)


def test_hf_trainer_fuse_without_base_says_to_pass_it(tmp_path):
    with pytest.raises(fsdpckpt.NotACheckpointError, match=r"without base weights.*base=\.\.\."):
        fuse_into(CKPT, tmp_path / "fused")
    assert not (tmp_path / "fused").exists()


def test_hf_trainer_adapter_config_elsewhere_is_given_with_lora_config(tmp_path):
    moved = tmp_path / "checkpoint-3"  # the run's output folder, with its config, left behind
    shutil.copytree(CKPT, moved)
    with pytest.raises(fsdpckpt.CheckpointNotFoundError, match="lora_config="):
        fsdpckpt.export_hf(moved, tmp_path / "adapter", lora="adapter")
    result = run_cli("export-hf", moved, tmp_path / "adapter", "--lora", "adapter",
                     "--lora-config", RUN / "run" / "adapter_config.json")
    assert result.exit_code == 0, result.output


def _peft_llama():
    config = transformers.LlamaConfig.from_pretrained(str(BASE))
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(load_file(BASE / "model.safetensors"))
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4,
                                                       target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _save(state: dict, ckpt, model) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": state}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    model.peft_config["default"].save_pretrained(str(ckpt))


def test_plain_export_of_a_lora_checkpoint_names_the_lora_flags(tmp_path):
    model = _peft_llama()
    _save(model.state_dict(), tmp_path / "ckpt", model)
    with pytest.raises(fsdpckpt.NotACheckpointError, match="lora='adapter'.*lora='fuse'"):
        fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "out", base=BASE)
    result = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "out", "--base", BASE)
    assert_one_line_error(result, "holds LoRA adapters", "--lora adapter", "--lora fuse")
    assert "missing" not in result.stderr


def test_inspect_shows_the_adapter_config(tmp_path):
    model = _peft_llama()
    _save(model.state_dict(), tmp_path / "ckpt", model)
    out = run_cli("inspect", tmp_path / "ckpt", "--summary").stdout
    assert "LoRA adapter (adapter_config.json): r=2, lora_alpha=4, targets" in out
    assert "Not recognized" not in out
    doc = json.loads(run_cli("inspect", tmp_path / "ckpt", "--json").stdout)
    assert doc["other_files"] == [] and doc["ok"]
    assert doc["adapter"]["r"] == 2 and doc["adapter"]["lora_alpha"] == 4
    assert sorted(doc["adapter"]["target_modules"]) == ["q_proj", "v_proj"]


def test_inspect_finds_the_adapter_config_where_hf_trainer_leaves_it():
    # HF Trainer's adapter-only save: adapter_config.json in the run's output folder, above
    # checkpoint-N/, where export-hf --lora looks for it too.
    report = fsdpckpt.inspect_checkpoint(RUN / "run" / "checkpoint-3")
    assert report.ok and report.adapter is not None
    assert report.adapter.file == "../adapter_config.json" and report.adapter.r == 4


def test_inspect_of_a_checkpoint_without_adapters_ignores_a_parents_adapter_config(tmp_path):
    ckpt = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(FIXTURES / "fsdp2_accelerate", ckpt)
    shutil.copy(RUN / "run" / "adapter_config.json", tmp_path / "run")
    assert fsdpckpt.inspect_checkpoint(ckpt).adapter is None


def test_inspect_reports_a_wrong_adapter_config_as_a_problem(tmp_path):
    model = _peft_llama()
    _save(model.state_dict(), tmp_path / "ckpt", model)
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    (tmp_path / "ckpt" / "adapter_config.json").write_text(json.dumps({**config, "r": "two"}))
    report = fsdpckpt.inspect_checkpoint(tmp_path / "ckpt")
    assert not report.ok and "field 'r'" in report.problems[0].message


def _packed(weight: torch.Tensor) -> torch.Tensor:
    # bitsandbytes' Params4bit as a QLoRA FSDP checkpoint holds it: half a byte per weight,
    # stored as bf16 [N, 1] (quant_storage=bfloat16), without the quantization state.
    nbytes = weight.numel() // 2
    data = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    return data.view(torch.bfloat16).view(-1, 1)


def test_qlora_fuse_uses_the_full_precision_base_and_only_the_trained_tensors(tmp_path):
    model = _peft_llama()
    state = model.state_dict()
    # Every Linear of the layers is packed (QLoRA quantizes them all), adapted or not.
    qlora = {k: _packed(v) if ".layers." in k and k.endswith("weight") and v.dim() == 2
             and "lora_" not in k else v for k, v in state.items()}
    _save(qlora, tmp_path / "ckpt", model)
    with pytest.raises(fsdpckpt.NotACheckpointError, match="packed to 4 bits.*base=\\.\\.\\."):
        fuse_into(tmp_path / "ckpt", tmp_path / "nobase")
    fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "fused", base=BASE, lora="fuse")
    adapter = {k.replace(".default", ""): v for k, v in state.items() if "lora_" in k}
    want = _merged(tmp_path / "ckpt", adapter)
    _assert_bit_exact(load_file(tmp_path / "fused" / "model.safetensors"), want)


def test_names_that_only_look_like_adapters_are_left_to_the_plain_export():
    from fsdpckpt.export._lora_keys import refuse_unasked

    # A model of its own with lora_A/lora_B parameters, not wrapped by PEFT: exported as is.
    refuse_unasked(["model.q.lora_A.weight", "model.q.lora_B.weight", "model.q.weight"], "x")
    with pytest.raises(fsdpckpt.NotACheckpointError, match="holds LoRA adapters"):
        refuse_unasked(["base_model.model.q.lora_A.weight", "base_model.model.q.lora_B.weight"],
                       "x")
