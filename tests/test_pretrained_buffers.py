"""load_pretrained into a model built on the meta device gives the model from_pretrained gives
(issue 33): its non-persistent buffers (rotary ``inv_freq`` of several kinds, Gemma's
``embed_scale``), in no weight file, are set as the model's initialization sets them, on
one process, FSDP2 and FSDP1; a buffer nothing recomputes is refused, not left as
``to_empty()`` left it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fsdpckpt

from deep_compare import assert_same_tensors
from multirank import run_ranks

transformers = pytest.importorskip("transformers")

multirank = pytest.mark.multirank

_SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}

#: Architectures whose non-persistent buffers differ: default rotary, llama3-scaled rotary,
#: Gemma's embed_scale beside its rotary, Gemma 3's sliding and global rotaries, Phi's
#: partial rotary.
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "gemma": ("GemmaConfig", {}),
    "gemma3": ("Gemma3TextConfig", {}),
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.5}),
}


def _config(arch: str):
    name, changes = ARCHITECTURES[arch]
    sizes = dict(_SIZES)
    if name == "PhiConfig":
        sizes.pop("head_dim")
    return getattr(transformers, name)(**sizes, **changes)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("buffers")
    for arch in ARCHITECTURES:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(_config(arch)).save_pretrained(root / arch)
    return {arch: root / arch for arch in ARCHITECTURES}


def _on_meta(arch: str):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_config(arch))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(12).reshape(2, 6) % 60).logits


def _non_persistent(model) -> dict[str, torch.Tensor]:
    return {f"{name}.{b}" if name else b: module._buffers[b].detach().clone()
            for name, module in model.named_modules()
            for b in module._non_persistent_buffers_set if module._buffers.get(b) is not None}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_model_built_on_meta_loads_with_from_pretraineds_buffers_and_logits(saved, arch):
    model = _on_meta(arch).to_empty(device="cpu")
    for buffer in _non_persistent(model):  # whatever to_empty left, made plainly wrong
        model.get_buffer(buffer).fill_(7.0)
    fsdpckpt.load_pretrained(model, saved[arch])
    want = transformers.AutoModelForCausalLM.from_pretrained(saved[arch])
    assert _non_persistent(model).keys() == _non_persistent(want).keys() != set()
    assert_same_tensors(dict(model.named_buffers()), dict(want.named_buffers()))
    assert torch.equal(_logits(model), _logits(want))


def test_without_the_fix_the_model_is_silently_different(saved):
    # What issue 33 saw: buffers as to_empty left them give other logits.
    model = _on_meta("llama").to_empty(device="cpu")
    model.model.rotary_emb.inv_freq.fill_(7.0)
    fsdpckpt.load_pretrained(model, saved["llama"], buffers="keep")
    want = transformers.AutoModelForCausalLM.from_pretrained(saved["llama"])
    assert not torch.equal(_logits(model), _logits(want))


# --- multi-rank ----------------------------------------------------------------------------


def _rank_loads(rank, world, kind, arch, folder):
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = _on_meta(arch)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model = model.to_empty(device="cpu")
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        torch.manual_seed(5)
        model = transformers.AutoModelForCausalLM.from_config(_config(arch))
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                         use_orig_params=True)
    for buffer in _non_persistent(model):
        model.get_buffer(buffer).fill_(7.0)
    fsdpckpt.load_pretrained(model, folder)
    from fsdpckpt.merging._keys import clean_key

    return ({clean_key(k): v for k, v in _non_persistent(model).items()}, _logits(model))


@multirank
@pytest.mark.parametrize("kind, arch", [("fsdp2", "llama3-rope"), ("fsdp2", "gemma"),
                                        ("fsdp1", "gemma3")])
def test_sharded_models_load_with_from_pretraineds_buffers_and_logits(saved, kind, arch):
    want = transformers.AutoModelForCausalLM.from_pretrained(saved[arch])
    for buffers, logits in run_ranks(_rank_loads, kind, arch, str(saved[arch])):
        assert_same_tensors(buffers, _non_persistent(want))
        assert torch.equal(logits, _logits(want))
