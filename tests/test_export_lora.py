"""`export-hf --lora adapter|fuse`: a PEFT run's checkpoint to what PEFT and transformers load.

`tests/test_lora.py` specifies the adapter and fusion maths against real peft; this file
specifies the export around them: the fused base model comes out as a Hugging Face folder
that `from_pretrained` loads and that computes what `merge_and_unload` computes, and the
adapter comes out for `PeftModel.from_pretrained`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import fsdpckpt  # noqa: E402
from fsdpckpt.export.lora import AdapterExport  # noqa: E402

from conftest import FIXTURES, run_cli  # noqa: E402

_IDS = torch.tensor([[1, 5, 9, 3]])


def _llama(tied: bool):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def run(request, tmp_path):
    """A trained PEFT Llama saved as save_state lays it out, its adapter_config.json beside
    it, and the base model folder it started from (config, tokenizer)."""
    import torch.distributed.checkpoint as dcp

    tied = request.param
    base = tmp_path / "base"
    _llama(tied).save_pretrained(str(base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny_llama" / "untied" / name, base / name)
    model = peft.get_peft_model(_llama(tied), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.eval()
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    model.peft_config["default"].save_pretrained(str(ckpt))
    return model, ckpt, base, tied


def test_fuse_exports_a_folder_that_computes_what_merge_and_unload_computes(run, tmp_path):
    model, ckpt, base, tied = run
    with torch.no_grad():
        want = model(_IDS).logits
    result = fsdpckpt.export_hf(ckpt, tmp_path / "out", base=base, lora="fuse")
    assert [p.name for p in result.weights] == ["model.safetensors"]
    assert (result.tied != ()) == tied  # lm_head follows the config, not written when tied
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(_IDS).logits, want, atol=1e-5, rtol=1e-5)
    merged = model.merge_and_unload().state_dict()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=1e-6)


def test_fuse_casts_and_the_config_says_so(run, tmp_path):
    _model, ckpt, base, _tied = run
    result = fsdpckpt.export_hf(ckpt, tmp_path / "out", base=base, lora="fuse", dtype="bf16")
    assert result.dtype == "bfloat16"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "bfloat16" in (config.get("torch_dtype"), config.get("dtype"))


def test_the_adapter_export_loads_in_peft_with_the_same_logits(run, tmp_path):
    model, ckpt, base, tied = run
    result = run_cli("export-hf", ckpt, tmp_path / "adapter", "--base", base,
                     "--lora", "adapter", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["files"] == ["adapter_model.safetensors", "adapter_config.json"]
    loaded = peft.PeftModel.from_pretrained(_llama(tied), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(_IDS).logits, model(_IDS).logits, atol=0, rtol=0)


def test_the_api_returns_the_adapter_export(run, tmp_path):
    _model, ckpt, base, _tied = run
    result = fsdpckpt.export_hf(ckpt, tmp_path / "adapter", base=base, lora="adapter")
    assert isinstance(result, AdapterExport) and result.modules == 4  # q, v x 2 layers


def test_an_unknown_lora_mode_is_one_error(run, tmp_path):
    _model, ckpt, base, _tied = run
    with pytest.raises(fsdpckpt.MergePlanError, match="'adapter'.*'fuse'"):
        fsdpckpt.export_hf(ckpt, tmp_path / "out", base=base, lora="merge")
    result = run_cli("export-hf", ckpt, tmp_path / "out", "--lora", "x")
    assert result.exit_code == 2 and "'adapter', 'fuse'" in result.output  # click's usage error


def _shards_follow_the_merge_rule(folder, limit: int) -> dict[str, str]:
    # Filled in order; a tensor starts a new shard only when it would overflow the last one.
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {k: v for f in set(index["weight_map"].values())
               for k, v in load_file(folder / f).items()}
    sizes: dict[str, list[int]] = {}
    for key, shard in index["weight_map"].items():  # in the order written
        sizes.setdefault(shard, []).append(tensors[key].nbytes)
    assert list(sizes) == sorted(sizes)
    shards = list(sizes.values())
    for shard, following in zip(shards, shards[1:]):
        assert sum(shard) <= limit or len(shard) == 1
        assert sum(shard) + following[0] > limit
    assert index["metadata"]["total_size"] == sum(map(sum, shards))
    return index["weight_map"]


def test_fuse_honours_max_shard_size_as_a_plain_export_does(run, tmp_path):
    model, ckpt, base, tied = run
    with torch.no_grad():
        want = model(_IDS).logits
    result = fsdpckpt.export_hf(ckpt, tmp_path / "out", base=base, lora="fuse",
                                max_shard_size="10KB")
    names = [p.name for p in result.weights]
    assert len(names) > 3 and names[0] == f"model-00001-of-{len(names) - 1:05d}.safetensors"
    assert names[-1] == "model.safetensors.index.json"
    assert not (tmp_path / "out" / "model.safetensors").exists()
    weight_map = _shards_follow_the_merge_rule(tmp_path / "out", 10_000)
    assert ("lm_head.weight" in weight_map) != tied
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(_IDS).logits, want, atol=1e-5, rtol=1e-5)


def test_a_failing_sharded_fuse_leaves_no_shard_behind(run, tmp_path, monkeypatch):
    from fsdpckpt.export import _fuse_hf

    _model, ckpt, base, _tied = run

    def failing(*args, **kwargs):
        yield from []
        raise OSError("disk went away")

    monkeypatch.setattr(_fuse_hf, "fused_from", failing)
    with pytest.raises(OSError, match="disk went away"):
        fsdpckpt.export_hf(ckpt, tmp_path / "out", base=base, lora="fuse", max_shard_size="10KB")
    assert not tmp_path.joinpath("out").exists() or not list((tmp_path / "out").iterdir())
