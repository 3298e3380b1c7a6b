"""LoRA / PEFT adapters in a checkpoint: exported as PEFT writes them, and fused as PEFT's
``merge_and_unload`` fuses them, checked against real ``peft`` on tiny real models."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from fsdpckpt.errors import (  # noqa: E402
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from fsdpckpt.export.lora import (  # noqa: E402
    export_adapter,
    find_lora,
    fuse_into,
    fuse_weight,
    fused_tensors,
    parse_lora_config,
)


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=32)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _trained(model, **lora):
    """A PEFT model whose adapters hold nonzero values, as after training."""
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return peft_model.eval()


def _save(peft_model, folder):
    """The model saved as a DCP folder under ``{"model": ...}`` (as save_state writes it),
    with the run's adapter_config.json beside it."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": peft_model.state_dict()}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
    peft_model.peft_config["default"].save_pretrained(str(folder))
    return folder


_CASES = {
    "lora": dict(model=_llama, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "embedding": dict(model=_llama, r=2, lora_alpha=4, target_modules=["embed_tokens", "k_proj"]),
    "modules-to-save": dict(model=_llama, r=2, lora_alpha=4, target_modules=["o_proj"],
                            modules_to_save=["lm_head"]),
    "rslora-patterns": dict(model=_llama, r=4, lora_alpha=8, use_rslora=True,
                            target_modules=["q_proj", "k_proj", "o_proj"],
                            rank_pattern={"k_proj": 2},
                            alpha_pattern={"layers.1.self_attn.o_proj": 3}),
    "dora": dict(model=_llama, r=4, lora_alpha=8, use_dora=True,
                 target_modules=["q_proj", "up_proj"]),
    "fan-in-fan-out": dict(model=_gpt2, r=4, lora_alpha=8, fan_in_fan_out=True,
                           target_modules=["c_attn", "c_fc"]),
    "dora-fan-in-fan-out": dict(model=_gpt2, r=4, lora_alpha=8, use_dora=True,
                                fan_in_fan_out=True, target_modules=["c_attn"]),
}


@pytest.fixture(params=sorted(_CASES))
def trained(request, tmp_path):
    case = dict(_CASES[request.param])
    build = case.pop("model")
    peft_model = _trained(build(), **case)
    return peft_model, _save(peft_model, tmp_path / "ckpt"), build


def test_fused_tensors_equal_peft_merge_and_unload(trained):
    peft_model, ckpt, _ = trained
    fused = dict(fused_tensors(ckpt))
    merged = peft_model.merge_and_unload().state_dict()
    assert sorted(fused) == sorted(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(fused[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


def test_fuse_into_writes_a_model_that_loads_into_the_plain_class(trained, tmp_path):
    peft_model, ckpt, build = trained
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9, 3]])
        want = peft_model(ids).logits
    result = fuse_into(ckpt, tmp_path / "fused")
    from safetensors.torch import load_file

    plain = build()
    missing, unexpected = plain.load_state_dict(load_file(tmp_path / "fused" / "model.safetensors"),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # GPT-2 ties lm_head
    assert result.modules > 0
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, want, atol=1e-5, rtol=1e-5)


def test_exported_adapter_loads_in_peft_with_the_same_logits(trained, tmp_path):
    peft_model, ckpt, build = trained
    export_adapter(ckpt, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(build(), str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, peft_model(ids).logits, atol=0, rtol=0)


def test_exported_adapter_has_the_keys_save_pretrained_writes(trained, tmp_path):
    peft_model, ckpt, _ = trained
    export_adapter(ckpt, tmp_path / "ours")
    peft_model.save_pretrained(str(tmp_path / "theirs"))
    from safetensors.torch import load_file

    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def test_fuse_weight_is_w_plus_scaled_b_a():
    w, a, b = torch.ones(3, 2), torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [2.0]])
    assert torch.equal(fuse_weight(w, a, b, 0.5), w + 0.5 * (b @ a))
    assert torch.equal(fuse_weight(w.T, a, b, 0.5, fan_in_fan_out=True), (w + 0.5 * (b @ a)).T)


def test_fuse_weight_with_dora_rescales_each_row_to_its_magnitude():
    w, a, b = torch.randn(3, 2), torch.randn(1, 2), torch.randn(3, 1)
    magnitude = torch.tensor([1.0, 2.0, 3.0])
    fused = fuse_weight(w, a, b, 1.0, magnitude=magnitude)
    torch.testing.assert_close(torch.linalg.norm(fused, dim=1), magnitude)


def test_find_lora_names_modules_adapters_and_base_keys():
    names = ["base_model.model.a.q.base_layer.weight", "base_model.model.a.q.lora_A.default.weight",
             "base_model.model.a.q.lora_B.default.weight", "base_model.model.a.k.weight"]
    layout = find_lora(names)
    (module,) = layout.modules
    assert (module.name, module.adapter, module.weight) == ("a.q", "default", names[0])
    assert layout.base_keys == (names[0], names[3])
    assert layout.plain_name(names[0], "default") == "a.q.weight"
    assert layout.adapter_file_name(names[1], "default") == "base_model.model.a.q.lora_A.weight"


def test_find_lora_refuses_half_an_adapter():
    with pytest.raises(NotACheckpointError, match="no lora_B"):
        find_lora(["base_model.model.q.base_layer.weight",
                   "base_model.model.q.lora_A.default.weight"])


@pytest.mark.parametrize(("field", "value"), [("r", 0), ("r", "8"), ("lora_alpha", None),
                                              ("use_rslora", "yes"), ("rank_pattern", {"q": -1}),
                                              ("alpha_pattern", {"(": 2}), ("peft_type", "IA3")])
def test_a_wrong_config_field_is_one_error_naming_it(field, value):
    doc = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, field: value}
    with pytest.raises(NotACheckpointError, match=f"field '{field}"):
        parse_lora_config(doc)


def test_scaling_honours_rslora_and_the_patterns():
    config = parse_lora_config({"r": 4, "lora_alpha": 8, "use_rslora": True,
                                "rank_pattern": {"k_proj": 16}, "alpha_pattern": {"layers.1.q": 2}})
    assert config.scaling_of("model.layers.0.k_proj") == 8 / 4
    assert config.scaling_of("model.layers.0.q") == 8 / 2
    assert config.scaling_of("model.layers.1.q") == 2 / 2


def test_a_missing_adapter_config_says_where_it_looked(tmp_path):
    peft_model = _trained(_llama(), r=2, lora_alpha=4, target_modules=["q_proj"])
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": peft_model.state_dict()}, checkpoint_id=str(tmp_path / "c" / "m"))
    with pytest.raises(CheckpointNotFoundError, match="looked in"):
        export_adapter(tmp_path / "c" / "m", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_rank_that_disagrees_with_the_config_is_refused(trained, tmp_path):
    _, ckpt, _ = trained
    doc = json.loads((ckpt / "adapter_config.json").read_text())
    doc["r"], doc["rank_pattern"] = 7, {}
    with pytest.raises(NotACheckpointError, match="rank"):
        dict(fused_tensors(ckpt, lora_config=doc))


# --- a real 2-rank FSDP2 run -------------------------------------------------------------

def train_and_save(rank, world_size, folder, lora):
    """On each rank: a PEFT Llama sharded with FSDP2, two AdamW steps, ``save_state``;
    rank 0 also returns the trained model's full state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import fsdpckpt

    model = _trained(_llama(), **lora).train()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(2)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    fsdpckpt.save_state(folder, model, optimizer, step=2)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank == 0:
        model.peft_config["default"].save_pretrained(folder)
        return {k: v.clone() for k, v in full.items()}
    return None


_RUNS = {"lora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
         "dora-rslora-patterns": dict(r=4, lora_alpha=8, use_dora=True, use_rslora=True,
                                      target_modules=["q_proj", "k_proj", "gate_proj"],
                                      rank_pattern={"k_proj": 2},
                                      alpha_pattern={"gate_proj": 5})}


@pytest.fixture(scope="module", params=sorted(_RUNS))
def fsdp2_run(request, tmp_path_factory):
    from multirank import run_ranks

    folder = tmp_path_factory.mktemp("fsdp2") / "checkpoint_2"
    lora = _RUNS[request.param]
    full = run_ranks(train_and_save, str(folder), lora)[0]
    return full, lora, folder


def _trained_copy(full, lora):
    """A fresh PEFT model holding the run's trained weights (merge_and_unload changes its
    model in place, so every test gets its own)."""
    model = peft.get_peft_model(_llama(), peft.LoraConfig(**lora))
    model.load_state_dict(full)
    return model.eval()


@pytest.mark.multirank
def test_fsdp2_run_fuses_as_merge_and_unload(fsdp2_run, tmp_path):
    full, lora, folder = fsdp2_run
    trained = _trained_copy(full, lora)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = trained(ids).logits
    fuse_into(folder, tmp_path / "fused")
    from safetensors.torch import load_file

    fused = load_file(tmp_path / "fused" / "model.safetensors")
    merged = trained.merge_and_unload().state_dict()
    assert sorted(fused) == sorted(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(fused[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    plain = _llama()
    plain.load_state_dict(fused)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.multirank
def test_fsdp2_run_adapter_loads_in_peft_with_the_trained_logits(fsdp2_run, tmp_path):
    full, lora, folder = fsdp2_run
    trained = _trained_copy(full, lora)
    export_adapter(folder, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(_llama(), str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, atol=0, rtol=0)


@pytest.fixture
def small(tmp_path):
    peft_model = _trained(_llama(), r=2, lora_alpha=4, target_modules=["q_proj"])
    return peft_model, _save(peft_model, tmp_path / "ckpt")


def test_fuse_casts_after_fusing_in_fp32(small, tmp_path):
    _, ckpt = small
    fp32 = dict(fused_tensors(ckpt))
    for name, tensor in fused_tensors(ckpt, dtype="bf16"):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name
    fuse_into(ckpt, tmp_path / "bf16", dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_the_checkpoint_may_be_the_accelerate_folder_its_dcp_folder_or_a_merged_file(small):
    _, ckpt = small
    from fsdpckpt.merging.merger import merge

    merge(ckpt / "pytorch_model_fsdp_0", ckpt / "merged")
    want = dict(fused_tensors(ckpt))
    for source in (ckpt / "pytorch_model_fsdp_0", ckpt / "merged" / "model.safetensors"):
        got = dict(fused_tensors(source, lora_config=ckpt))
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_fuse_into_from_a_merged_file_casts_as_from_the_shards(small, tmp_path):
    _, ckpt = small
    from safetensors.torch import load_file

    from fsdpckpt.merging.merger import merge

    merge(ckpt / "pytorch_model_fsdp_0", ckpt / "merged")
    fuse_into(ckpt, tmp_path / "a", dtype="fp16")
    fuse_into(ckpt / "merged" / "model.safetensors", tmp_path / "b", dtype="fp16",
              lora_config=ckpt)
    a, b = (load_file(tmp_path / x / "model.safetensors") for x in "ab")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert a["lm_head.weight"].dtype == torch.float16


def test_an_existing_output_is_kept_without_overwrite(small, tmp_path):
    _, ckpt = small
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_adapter(ckpt, out)
    assert (out / "adapter_model.safetensors").read_bytes() == b"mine"
    export_adapter(ckpt, out, overwrite=True)
    assert (out / "adapter_model.safetensors").read_bytes() != b"mine"


def test_a_checkpoint_without_lora_is_one_error(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": _llama().state_dict()}, checkpoint_id=str(tmp_path / "plain"))
    with pytest.raises(NotACheckpointError, match="no LoRA adapter"):
        export_adapter(tmp_path / "plain", tmp_path / "out", lora_config={"r": 2, "lora_alpha": 4})


def test_several_adapters_need_one_named(tmp_path):
    peft_model = _trained(_llama(), r=2, lora_alpha=4, target_modules=["q_proj"])
    peft_model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    ckpt = _save(peft_model, tmp_path / "ckpt")
    with pytest.raises(NotACheckpointError, match="default, other"):
        export_adapter(ckpt, tmp_path / "out")
    result = export_adapter(ckpt, tmp_path / "out", adapter="other")
    assert result.adapter == "other" and result.modules == 2


def test_an_adapter_config_that_is_not_json_names_the_file(small, tmp_path):
    _, ckpt = small
    (ckpt / "adapter_config.json").write_text("{r: 8")
    with pytest.raises(CorruptCheckpointError, match="adapter_config.json"):
        export_adapter(ckpt, tmp_path / "out")


@pytest.mark.parametrize("export", [export_adapter, fuse_into])
def test_an_unknown_dtype_is_refused_before_anything_is_written(small, tmp_path, export):
    _, ckpt = small
    with pytest.raises(ValueError, match="bf16, fp16, fp32"):
        export(ckpt, tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()
