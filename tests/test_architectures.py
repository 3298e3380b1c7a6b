"""export-hf across 13 architectures: what ``save_pretrained`` writes, loaded clean, same outputs.

Qwen2, Qwen3, Gemma 2, Gemma 3, Mistral, GPT-2, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, BERT for
sequence classification, T5 (the original and v1.1 / Flan-T5) and LLaVA (an image through its
vision tower too).

For each architecture a tiny model is built with real transformers (every parameter random,
so a misplaced or mis-tied tensor cannot go unseen); ``save_pretrained`` of it is the
reference: the export must write exactly its keys (the hub's names: per-expert MoE tensors,
LLaVA's ``language_model.model.*``; tied targets left out as it leaves them out), every
tensor byte for byte, and ``from_pretrained`` of the export must load with nothing missing,
unexpected or newly initialized and compute the original model's outputs exactly (logits;
BERT's classification logits; T5's encoder-decoder logits).

The checkpoint is the model's state as an FSDP run writes it: Accelerate's layout (a DCP
folder ``pytorch_model_fsdp_0`` with the state under ``model``), each tensor in dim-0 shards
(tests/chunked.py), tied tensors as separate copies as FSDP gathers them. ``base`` holds the
config (as ``save_pretrained`` wrote it) and a tokenizer, no weights: the keys are checked
against the config's model class. A few architectures are also saved by a real 2-rank FSDP2
run (tests/multirank.py). docs/architectures.md describes what each export does.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fsdpckpt  # noqa: E402

from chunked import split, write_dcp  # noqa: E402
from conftest import FIXTURES  # noqa: E402

_IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])
_LM = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1)
_MOE = dict(_LM, num_experts_per_tok=2)


def _llava_config() -> Any:
    text = transformers.LlamaConfig(**dict(_LM, num_hidden_layers=1))
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=32, patch_size=16, projection_dim=16)
    return transformers.LlavaConfig(text_config=text, vision_config=vision,
                                    image_token_index=3)


def _t5_v1_1_config() -> Any:
    # T5 v1.1 / Flan-T5: gated feed-forward, decoder outputs not scaled. Their hub configs say
    # tie_word_embeddings: false, which transformers 5 reads as "do not scale" and ties the
    # head to shared.weight all the same (T5Config.__init__).
    return transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=2,
                                 num_decoder_layers=2, num_heads=2, decoder_start_token_id=0,
                                 feed_forward_proj="gated-gelu", tie_word_embeddings=False)


#: architecture -> (model class, its config). Tied and untied heads both appear: each
#: family's default (Gemma, GPT-2, T5 tie; Qwen2, Mistral, Phi-3 do not), Qwen3 tied.
ARCHITECTURES: dict[str, tuple[str, Callable[[], Any]]] = {
    "qwen2": ("Qwen2ForCausalLM", lambda: transformers.Qwen2Config(**_LM)),
    "qwen3": ("Qwen3ForCausalLM", lambda: transformers.Qwen3Config(
        head_dim=8, tie_word_embeddings=True, **_LM)),
    "gemma2": ("Gemma2ForCausalLM", lambda: transformers.Gemma2Config(head_dim=8, **_LM)),
    "gemma3": ("Gemma3ForCausalLM", lambda: transformers.Gemma3TextConfig(
        head_dim=8, **_LM)),
    "mistral": ("MistralForCausalLM", lambda: transformers.MistralConfig(**_LM)),
    "gpt2": ("GPT2LMHeadModel", lambda: transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)),
    "phi3": ("Phi3ForCausalLM", lambda: transformers.Phi3Config(pad_token_id=0, **_LM)),
    "mixtral": ("MixtralForCausalLM", lambda: transformers.MixtralConfig(
        num_local_experts=3, **_MOE)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", lambda: transformers.Qwen2MoeConfig(
        num_experts=3, moe_intermediate_size=12, shared_expert_intermediate_size=20, **_MOE)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: transformers.Qwen3MoeConfig(
        num_experts=3, moe_intermediate_size=12, head_dim=8, **_MOE)),
    "bert": ("BertForSequenceClassification", lambda: transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32, num_labels=3)),
    "t5": ("T5ForConditionalGeneration", lambda: transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_decoder_layers=2,
        num_heads=2, decoder_start_token_id=0)),
    "t5_v1_1": ("T5ForConditionalGeneration", _t5_v1_1_config),
    "llava": ("LlavaForConditionalGeneration", _llava_config),
}


#: What each model ties (target -> the key it is tied to): the targets are not written.
TIED = {
    "qwen3": {"lm_head.weight": "model.embed_tokens.weight"},
    "gemma2": {"lm_head.weight": "model.embed_tokens.weight"},
    "gemma3": {"lm_head.weight": "model.embed_tokens.weight"},
    "gpt2": {"lm_head.weight": "transformer.wte.weight"},
    "t5": {"lm_head.weight": "shared.weight", "encoder.embed_tokens.weight": "shared.weight",
           "decoder.embed_tokens.weight": "shared.weight"},
}
TIED["t5_v1_1"] = TIED["t5"]


def _model(arch: str) -> Any:
    name, config = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = getattr(transformers, name)._from_config(config(), attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    return model.eval()


def _outputs(model: Any) -> torch.Tensor:
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=_IDS, decoder_input_ids=_IDS[:, :4]).logits
        if getattr(model.config, "vision_config", None) is not None:
            # An image through the vision tower and projector: its 4 patches (32 / 16,
            # squared) fill the 4 image tokens (3).
            torch.manual_seed(1)
            pixels = torch.randn(1, 3, 32, 32)
            ids = torch.tensor([[1, 3, 3, 3, 3, 5, 9]])
            return model(input_ids=ids, pixel_values=pixels).logits
        return model(input_ids=_IDS).logits


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _checkpoint(model: Any, path: Path) -> Path:
    # FSDP-like dim-0 shards of every tensor; each name its own copy, as FSDP gathers them.
    state = {name: (tensor.detach().clone(), split((0,), 2))
             for name, tensor in model.state_dict().items()}
    write_dcp(path / "pytorch_model_fsdp_0", state)
    return path


def _base(reference: Path, base: Path) -> Path:
    # The run's model folder without weights: its config and a tokenizer.
    base.mkdir()
    shutil.copy(reference / "config.json", base / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny_llama" / "untied" / name, base / name)
    return base


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def exported(request, tmp_path_factory: pytest.TempPathFactory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    model = _model(arch)
    model.save_pretrained(str(root / "reference"))
    ckpt = _checkpoint(model, root / "ckpt")
    result = fsdpckpt.export_hf(ckpt, root / "out", base=_base(root / "reference", root / "base"))
    return arch, model, root, result


def test_the_export_writes_what_save_pretrained_writes_byte_for_byte(exported):
    arch, model, root, result = exported
    assert result.not_checked is None and result.names_as_stored is None
    assert result.model_class == ARCHITECTURES[arch][0]
    got, want = _tensors(root / "out"), _tensors(root / "reference")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    # The tied targets the model class ties are left out, as save_pretrained leaves them out.
    assert dict(result.tied) == TIED.get(arch, {})
    assert not set(dict(result.tied)) & set(want)


def test_the_export_loads_clean_and_computes_the_same_outputs(exported, caplog):
    arch, model, root, _result = exported
    cls = getattr(transformers, ARCHITECTURES[arch][0])
    with caplog.at_level(logging.WARNING, logger="transformers"):
        loaded, info = cls.from_pretrained(str(root / "out"), output_loading_info=True,
                                           attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), \
        info
    assert "newly initialized" not in caplog.text, caplog.text
    assert torch.equal(_outputs(loaded.eval()), _outputs(model))


def _fsdp2_save(rank: int, world_size: int, arch: str, ckpt: str) -> None:
    # A real 2-rank FSDP2 run's checkpoint: each block of every layer list its own unit
    # (nested lists first: T5's blocks hold lists), the rest (embeddings, tied heads, norms)
    # the root's; the state as Accelerate saves it.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model(arch)
    for layers in reversed([m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]):
        for layer in layers:
            fully_shard(layer)
    fully_shard(model)
    dcp.save({"model": get_model_state_dict(model)},
             checkpoint_id=str(Path(ckpt) / "pytorch_model_fsdp_0"))


@pytest.mark.multirank
@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_a_two_rank_fsdp2_run_exports_as_save_pretrained_writes(tmp_path, arch, caplog):
    from multirank import run_ranks

    model = _model(arch)
    model.save_pretrained(str(tmp_path / "reference"))
    run_ranks(_fsdp2_save, arch, str(tmp_path / "ckpt"))
    result = fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "out",
                                base=_base(tmp_path / "reference", tmp_path / "base"))
    assert dict(result.tied) == TIED[arch]
    got, want = _tensors(tmp_path / "out"), _tensors(tmp_path / "reference")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    loaded = getattr(transformers, ARCHITECTURES[arch][0]).from_pretrained(
        str(tmp_path / "out"), attn_implementation="eager")
    assert torch.equal(_outputs(loaded.eval()), _outputs(model))


def test_a_head_the_class_ties_whatever_the_config_says_is_refused_even_with_untie(tmp_path):
    # A T5 v1.1 run under transformers 4 trained its head apart from shared.weight; transformers
    # 5's T5 ties them always, so --untie cannot keep both: the refusal says so, not --untie.
    model = _model("t5_v1_1")
    model.save_pretrained(str(tmp_path / "reference"))
    state = {name: (tensor.detach().clone(), split((0,), 2))
             for name, tensor in model.state_dict().items()}
    state["lm_head.weight"] = (torch.randn_like(state["lm_head.weight"][0]), split((0,), 2))
    write_dcp(tmp_path / "ckpt" / "pytorch_model_fsdp_0", state)
    base = _base(tmp_path / "reference", tmp_path / "base")
    with pytest.raises(fsdpckpt.ExportMismatchError, match="lm_head.weight and shared.*--untie"):
        fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "out", base=base)
    with pytest.raises(fsdpckpt.ExportMismatchError,
                       match="ties them even with tie_word_embeddings: false") as refused:
        fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "out", base=base, untie=True)
    assert "--untie" not in str(refused.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()
