"""export-hf of MoE (and LLaVA) checkpoints writes what transformers' own ``save_pretrained``
writes: the hub's per-expert names, cut from transformers 5's fused in-memory experts, and a
checkpoint already under the hub's names (a transformers 4 run) is accepted and written so.

Each test builds a tiny model with real transformers; ``save_pretrained`` of it is the
reference (names and bytes), ``from_pretrained`` of the export must load clean and compute
the same logits. The checkpoints are DCP folders whose tensors are cut into chunks across
experts and across the gate/up boundary (tests/chunked.py), so a piece is read from parts
of several chunks.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fsdpckpt  # noqa: E402
from fsdpckpt.export import hf as hf_module  # noqa: E402
from fsdpckpt.export._moe import _box  # noqa: E402

from chunked import split, write_dcp  # noqa: E402
from conftest import FIXTURES, run_cli  # noqa: E402

_IDS = torch.tensor([[1, 5, 9, 3, 7]])
_SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2)


def _config(arch: str):
    if arch == "mixtral":
        return transformers.MixtralConfig(num_local_experts=3, **_SMALL)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(num_experts=3, moe_intermediate_size=12,
                                           shared_expert_intermediate_size=20, **_SMALL)
    return transformers.Qwen3MoeConfig(num_experts=3, moe_intermediate_size=12, head_dim=8,
                                       **_SMALL)


def _model(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # every tensor random: a misplaced expert cannot go unseen
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    return model


def _reference(model, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny_llama" / "untied" / name, folder / name)
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _checkpoint(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    # FSDP-like dim-0 shards; the 3-d experts cut in three along dims 0 and 1 as well, so a
    # chunk holds parts of two experts and of both gate and up.
    layouts = {name: (t, split((0, 1), 3) if t.dim() == 3 else split((0,), 2))
               for name, t in tensors.items()}
    write_dcp(path / "pytorch_model_fsdp_0", layouts)
    return path


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def _loads_clean(folder: Path, model, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="transformers"):
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert "newly initialized" not in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(_IDS).logits, model(_IDS).logits,
                                   atol=0, rtol=0)


ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(params=ARCHS)
def moe(request, tmp_path):
    model = _model(_config(request.param))
    reference = _reference(model, tmp_path / "reference")
    return request.param, model, reference, tmp_path


def test_fused_experts_are_written_as_save_pretrained_writes_them(moe, caplog):
    arch, model, reference, tmp = moe
    memory = model.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in memory)  # transformers 5 fused
    ckpt = _checkpoint(memory, tmp / "ckpt")
    result = fsdpckpt.export_hf(ckpt, tmp / "out", base=tmp / "reference")
    assert result.names_as_stored is None and result.not_checked is None
    _same(_exported(tmp / "out"), reference)
    expert = "block_sparse_moe.experts.2.w3.weight" if arch == "mixtral" else \
        "mlp.experts.2.up_proj.weight"
    assert f"model.layers.1.{expert}" in reference
    _loads_clean(tmp / "out", model, caplog)


def test_per_expert_names_of_a_transformers_4_run_are_accepted_and_kept(moe, caplog):
    _arch, model, reference, tmp = moe
    ckpt = _checkpoint(reference, tmp / "ckpt")  # the hub's names, as transformers 4 held them
    fsdpckpt.export_hf(ckpt, tmp / "out", base=tmp / "reference")
    _same(_exported(tmp / "out"), reference)
    _loads_clean(tmp / "out", model, caplog)


def test_the_cut_is_cast_as_the_merge_casts(moe):
    _arch, model, reference, tmp = moe
    ckpt = _checkpoint(model.state_dict(), tmp / "ckpt")
    result = fsdpckpt.export_hf(ckpt, tmp / "out", base=tmp / "reference", dtype="bf16")
    assert result.dtype == "bfloat16"
    _same(_exported(tmp / "out"), {k: v.to(torch.bfloat16) for k, v in reference.items()})


def test_a_sharded_export_indexes_the_hub_names(moe, caplog):
    _arch, model, reference, tmp = moe
    ckpt = _checkpoint(model.state_dict(), tmp / "ckpt")
    result = fsdpckpt.export_hf(ckpt, tmp / "out", base=tmp / "reference",
                                max_shard_size=20_000)
    assert len(result.weights) > 2
    index = json.loads((tmp / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(reference)
    _same(_exported(tmp / "out"), reference)
    _loads_clean(tmp / "out", model, caplog)
    # Exported again as one file over it: the shards it replaces are gone.
    fsdpckpt.export_hf(ckpt, tmp / "out", base=tmp / "reference", overwrite=True)
    assert sorted(p.name for p in (tmp / "out").glob("model*")) == ["model.safetensors"]
    _same(_exported(tmp / "out"), reference)


def test_a_missing_expert_is_named_in_either_naming(tmp_path):
    model = _model(_config("mixtral"))
    reference = _reference(model, tmp_path / "reference")
    gone = "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    ckpt = _checkpoint({k: v for k, v in reference.items() if k != gone}, tmp_path / "hub")
    with pytest.raises(fsdpckpt.ExportMismatchError, match=rf"1 missing \({gone}\)"):
        fsdpckpt.export_hf(ckpt, tmp_path / "out", base=tmp_path / "reference")
    gone = "model.layers.1.mlp.experts.down_proj"
    memory = {k: v for k, v in model.state_dict().items() if k != gone}
    ckpt = _checkpoint(memory, tmp_path / "memory")
    with pytest.raises(fsdpckpt.ExportMismatchError, match=rf"1 missing \({gone}\)"):
        fsdpckpt.export_hf(ckpt, tmp_path / "out", base=tmp_path / "reference")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_without_the_model_class_the_names_are_written_as_stored_and_it_says_so(
        tmp_path, monkeypatch):
    model = _model(_config("qwen2_moe"))
    _reference(model, tmp_path / "reference")
    memory = model.state_dict()
    ckpt = _checkpoint(memory, tmp_path / "ckpt")
    monkeypatch.setattr(hf_module, "expect_model", lambda *_a, **_k: "no transformers")
    # Against the base's weights (the hub's names) the in-memory names cannot be checked.
    with pytest.raises(fsdpckpt.ExportMismatchError, match="missing.*unexpected.*no trans"):
        fsdpckpt.export_hf(ckpt, tmp_path / "out", base=tmp_path / "reference")
    for weights in (tmp_path / "reference").glob("*.safetensors"):
        weights.unlink()
    result = fsdpckpt.export_hf(ckpt, tmp_path / "out", base=tmp_path / "reference")
    assert result.names_as_stored is not None and "no transformers" in result.names_as_stored
    assert sorted(_exported(tmp_path / "out")) == sorted(memory)


def test_the_cli_json_says_how_names_were_written(tmp_path):
    model = _model(_config("qwen3_moe"))
    _reference(model, tmp_path / "reference")
    ckpt = _checkpoint(model.state_dict(), tmp_path / "ckpt")
    result = run_cli("export-hf", ckpt, tmp_path / "out", "--base", tmp_path / "reference",
                     "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["names_as_stored"] is None


def _llava():
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=32, patch_size=16, projection_dim=16)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision,
                                      image_token_index=3)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    return model


@pytest.mark.parametrize("naming", ["memory", "hub"])
def test_llava_is_written_under_the_hub_names_from_either_naming(tmp_path, naming):
    model = _llava()
    reference = _reference(model, tmp_path / "reference")
    assert any(k.startswith("language_model.model.") for k in reference)
    stored = model.state_dict() if naming == "memory" else reference
    ckpt = _checkpoint(stored, tmp_path / "ckpt")
    result = fsdpckpt.export_hf(ckpt, tmp_path / "out", base=tmp_path / "reference")
    assert result.names_as_stored is None
    _same(_exported(tmp_path / "out"), reference)
    loaded, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(_IDS).logits, model(_IDS).logits,
                                   atol=0, rtol=0)


def test_a_view_that_is_no_box_is_refused_and_boxes_are_found():
    # A [3, 8, 4] tensor: expert 1's second half along dim 1 is a box; a transpose is not.
    piece = _box("x", "k", (3, 8, 4), 1 * 32 + 4 * 4, (4, 4), (4, 1))
    assert piece is not None and (piece.offsets, piece.sizes) == ((1, 4, 0), (1, 4, 4))
    assert not piece.whole
    assert _box("x", "k", (3, 8, 4), 0, (4, 8), (1, 4)) is None
    whole = _box("x", "k", (3, 8, 4), 0, (3, 8, 4), (32, 4, 1))
    assert whole is not None and whole.whole


def test_memory_holds_one_expert_never_a_layer(tmp_path, monkeypatch):
    from fsdpckpt.export import _moe

    model = _model(_config("mixtral"))
    _reference(model, tmp_path / "reference")
    ckpt = _checkpoint(model.state_dict(), tmp_path / "ckpt")
    read: list[tuple[str, int]] = []
    real = _moe.read_box

    def recording(files, tensor, offsets, sizes, out):
        read.append((tensor.name, len(out)))
        return real(files, tensor, offsets, sizes, out)

    monkeypatch.setattr(_moe, "read_box", recording)
    fsdpckpt.export_hf(ckpt, tmp_path / "out", base=tmp_path / "reference")
    expert = 24 * 16 * 4  # one expert's w1: intermediate x hidden, fp32
    fused = [n for n, _ in read if n.endswith("gate_up_proj")]
    assert len(fused) == 2 * 3 * 2  # w1 and w3 of 3 experts, 2 layers: one box each
    assert max(size for n, size in read if "experts" in n) == expert


def test_lora_fuse_of_an_moe_model_writes_the_hub_names(tmp_path, caplog):
    peft = pytest.importorskip("peft")
    import torch.distributed.checkpoint as dcp

    model = peft.get_peft_model(_model(_config("qwen2_moe")), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    model.peft_config["default"].save_pretrained(str(ckpt))
    merged = model.merge_and_unload().eval()
    reference = _reference(merged, tmp_path / "reference")
    result = fsdpckpt.export_hf(ckpt, tmp_path / "out", base=tmp_path / "reference",
                                lora="fuse")
    assert result.names_as_stored is None
    got = _exported(tmp_path / "out")
    assert sorted(got) == sorted(reference)
    for name, tensor in reference.items():  # the experts as stored; q, v fused in fp32
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-6)
        if "experts" in name:
            assert torch.equal(got[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(_IDS).logits, merged(_IDS).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("naming", ["memory", "hub"])
def test_a_tied_moe_model_leaves_the_tied_head_out_as_save_pretrained_does(
        tmp_path, naming, caplog):
    config = _config("qwen3_moe")
    config.tie_word_embeddings = True
    model = _model(config)
    reference = _reference(model, tmp_path / "reference")
    assert "lm_head.weight" not in reference
    stored = dict(model.state_dict())
    if naming == "hub":
        stored = {**reference, "lm_head.weight": stored["lm_head.weight"]}
    ckpt = _checkpoint(stored, tmp_path / "ckpt")
    result = fsdpckpt.export_hf(ckpt, tmp_path / "out", base=tmp_path / "reference")
    assert result.tied == (("lm_head.weight", "model.embed_tokens.weight"),)
    _same(_exported(tmp_path / "out"), reference)
    _loads_clean(tmp_path / "out", model, caplog)


def _fsdp2_moe(rank: int, world_size: int, ckpt: str) -> None:
    # A real 2-rank FSDP2 run's checkpoint: each 3-expert tensor sharded 2 + 1 on dim 0.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model(_config("mixtral"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    dcp.save({"model": get_model_state_dict(model)},
             checkpoint_id=str(Path(ckpt) / "pytorch_model_fsdp_0"))


@pytest.mark.multirank
def test_a_two_rank_fsdp2_run_exports_as_save_pretrained_writes(tmp_path, caplog):
    from multirank import run_ranks

    model = _model(_config("mixtral"))
    reference = _reference(model, tmp_path / "reference")
    run_ranks(_fsdp2_moe, str(tmp_path / "ckpt"))
    fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "out", base=tmp_path / "reference")
    _same(_exported(tmp_path / "out"), reference)
    _loads_clean(tmp_path / "out", model, caplog)


@pytest.mark.s3
def test_a_remote_moe_checkpoint_exports_as_the_local_one(s3, tmp_path):
    from conftest import upload

    server, root = s3
    model = _model(_config("qwen2_moe"))
    reference = _reference(model, tmp_path / "run")
    _checkpoint(model.state_dict(), tmp_path / "run" / "ckpt")
    url = upload(server, tmp_path / "run", f"s3://{root}/run")
    fsdpckpt.export_hf(f"{url}/ckpt", tmp_path / "out", storage_options=server.options)
    _same(_exported(tmp_path / "out"), reference)
