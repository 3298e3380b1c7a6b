"""LoRA exports of a checkpoint on object storage: the local exports, byte for byte.

`export-hf --lora adapter|fuse` (and `export_adapter`, `fuse_into`, `fused_tensors`) read
a PEFT run's checkpoint, its `adapter_config.json` (found beside it or given with
`--lora-config`) and `--base` from a real S3 server (SeaweedFS on loopback,
tests/s3server.py) as from local disk; a merged `.safetensors` is read by ranged reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import fsdpckpt  # noqa: E402
from fsdpckpt.export.lora import export_adapter, fuse_into, fused_tensors  # noqa: E402

from conftest import FIXTURES, run_cli, upload  # noqa: E402


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def run(tmp_path) -> tuple[Path, Path]:
    """A trained PEFT Llama's checkpoint as save_state lays it out, its adapter_config.json
    beside it, and the base model folder it started from (config, tokenizer)."""
    import torch.distributed.checkpoint as dcp

    base = tmp_path / "run" / "base"
    _llama().save_pretrained(str(base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny_llama" / "untied" / name, base / name)
    model = peft.get_peft_model(_llama(), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    ckpt = tmp_path / "run" / "checkpoint-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    model.peft_config["default"].save_pretrained(str(ckpt))
    return ckpt, base


@pytest.mark.s3
@pytest.mark.parametrize("options", [{}, {"dtype": "bf16"}], ids=["stored", "bf16"])
def test_adapter_export_of_a_remote_checkpoint_is_the_local_one(s3, run, tmp_path, options):
    server, root = s3
    ckpt, _ = run
    url = upload(server, ckpt.parent, f"s3://{root}/run")
    fsdpckpt.export_hf(f"{url}/checkpoint-1", tmp_path / "remote", lora="adapter",
                       storage_options=server.options, **options)
    fsdpckpt.export_hf(ckpt, tmp_path / "local", lora="adapter", **options)
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")
    assert sorted(_files(tmp_path / "local")) == ["adapter_config.json",
                                                  "adapter_model.safetensors"]


@pytest.mark.s3
@pytest.mark.parametrize("options", [{}, {"dtype": "bf16", "max_shard_size": "20KB"}],
                         ids=["plain", "bf16-sharded"])
def test_fused_export_of_a_remote_checkpoint_and_base_is_the_local_one(s3, run, tmp_path,
                                                                        options):
    server, root = s3
    ckpt, base = run
    url = upload(server, ckpt.parent, f"s3://{root}/run")
    fsdpckpt.export_hf(f"{url}/checkpoint-1", tmp_path / "remote", lora="fuse",
                       base=f"{url}/base", storage_options=server.options, **options)
    fsdpckpt.export_hf(ckpt, tmp_path / "local", lora="fuse", base=base, **options)
    local = _files(tmp_path / "local")
    assert _files(tmp_path / "remote") == local
    assert "config.json" in local and "tokenizer.json" in local


@pytest.mark.s3
def test_a_remote_lora_config_is_read_from_the_store(s3, run, tmp_path):
    server, root = s3
    ckpt, _ = run
    config = ckpt / "adapter_config.json"
    elsewhere = tmp_path / "configs"
    elsewhere.mkdir()
    config.rename(elsewhere / config.name)  # not beside the checkpoint: only --lora-config
    url = upload(server, ckpt, f"s3://{root}/ckpt")
    configs = upload(server, elsewhere, f"s3://{root}/configs")
    result = run_cli("export-hf", url, tmp_path / "remote", "--lora", "adapter",
                     "--lora-config", f"{configs}/adapter_config.json",
                     "--storage-options", json.dumps(server.options))
    assert result.exit_code == 0, result.output
    export_adapter(ckpt, tmp_path / "local", lora_config=elsewhere)
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")


@pytest.mark.s3
def test_a_remote_merged_file_fuses_as_the_local_one_by_ranged_reads(s3, run, tmp_path):
    server, root = s3
    ckpt, _ = run
    merged = tmp_path / "merged"
    fsdpckpt.merge(ckpt, merged, max_shard_size="20KB")
    url = upload(server, merged, f"s3://{root}/merged")
    configs = upload(server, ckpt, f"s3://{root}/ckpt")  # adapter_config.json
    index = f"{url}/model.safetensors.index.json"
    got = list(fused_tensors(index, lora_config=configs, storage_options=server.options))
    want = list(fused_tensors(merged / "model.safetensors.index.json", lora_config=ckpt))
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                  b.view(-1).view(torch.uint8)), name
    fuse_into(index, tmp_path / "remote", lora_config=configs, storage_options=server.options)
    fuse_into(merged / "model.safetensors.index.json", tmp_path / "local", lora_config=ckpt)
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")
