"""A run trained from a config exports without a hand-made ``--base`` (issue 33): save_state
writes a Hugging Face model's ``config.json`` and generation config beside its checkpoint,
as HF Trainer's checkpoints hold them, in the manifest like every other file."""

from __future__ import annotations

import json

import pytest
import torch

import fsdpckpt

import workers

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))


def test_a_hugging_face_models_config_is_saved_beside_its_checkpoint(tmp_path):
    model = _llama()
    fsdpckpt.save_state(tmp_path / "ckpt", model, step=1)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 32
    assert (tmp_path / "ckpt" / "generation_config.json").is_file()
    manifest = json.loads((tmp_path / "ckpt" / "fsdpckpt.json").read_text())
    assert "config.json" in json.dumps(manifest)
    assert fsdpckpt.verify_checkpoint(tmp_path / "ckpt").ok


def test_a_plain_module_saves_no_config(tmp_path):
    fsdpckpt.save_state(tmp_path / "ckpt", workers.make_model(), step=1)
    assert not (tmp_path / "ckpt" / "config.json").exists()


def test_a_managed_run_trained_from_a_config_exports_and_loads_bit_exact(tmp_path):
    model = _llama()
    fsdpckpt.CheckpointManager(tmp_path / "run").save(5, model=model)
    result = fsdpckpt.export_hf(tmp_path / "run" / "checkpoint_5", tmp_path / "out")
    assert result.config_from == tmp_path / "run" / "checkpoint_5" / "config.json"
    assert result.no_tokenizer is not None
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
