"""A real QLoRA FSDP run (issue 20, section 5), exported as its users would.

`fixtures/qlora/` (written by `fixtures/generate_qlora.py` with bitsandbytes 0.50, which runs
NF4 on the CPU): a tiny bf16 Llama loaded in 4 bits by the "FSDP + QLoRA" recipe, PEFT LoRA on
every projection, 3 steps of Accelerate's FSDP2 on 2 ranks, `accelerator.save_state` with
`SHARDED_STATE_DICT`. Two runs: `all_linear/` (the recipe) and `head_and_embeddings/` (LoRA
on the unquantized lm_head too, and the embeddings trained in full: `modules_to_save`). The
references are PEFT's own: the adapter its `save_pretrained` wrote from the run, and
`merge_and_unload` of that adapter into the full-precision base. bitsandbytes is not needed
here: NF4's 16 levels are below.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import fsdpckpt  # noqa: E402
import fsdpckpt.export._lora_base as lora_base  # noqa: E402
from fsdpckpt.export.lora import fuse_into  # noqa: E402

from conftest import FIXTURES, assert_one_line_error, run_cli  # noqa: E402

QLORA = FIXTURES / "qlora"
BASE = QLORA / "base"
RUNS = ["all_linear", "head_and_embeddings"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# bitsandbytes' NF4 code book (bitsandbytes.functional.get_4bit_type("nf4")).
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def _checkpoint(run: str):
    return QLORA / run / "run" / "checkpoint-3"


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name


def test_the_checkpoint_holds_the_base_packed_to_4_bits_without_its_quantization_state():
    state = fsdpckpt.load_full_state_dict(_checkpoint("all_linear") / "pytorch_model_fsdp_0")
    model = state["model"]
    base = load_file(BASE / "model.safetensors")
    packed = {k: v for k, v in model.items() if k.endswith(".base_layer.weight")}
    assert sorted(k.split(".")[-3] for k in packed) == sorted(PROJECTIONS)
    for name, tensor in packed.items():
        weight = base[name.removeprefix("base_model.model.").replace(".base_layer", "")]
        assert tensor.dtype == torch.bfloat16 and list(tensor.shape) == [weight.numel() // 4, 1]
        # The bytes are NF4 codes, two to a byte (high nibble first) of 64-weight blocks, each
        # the level nearest the base weight over its block's absmax: the run's quantization
        # of --base, which the checkpoint cannot be dequantized without (no absmax saved).
        data = tensor.view(torch.uint8).flatten()
        codes = torch.stack([data >> 4, data & 15], 1).flatten().long()
        blocks = weight.float().view(-1, 64)
        scaled = blocks / blocks.abs().amax(1, keepdim=True)
        assert torch.equal(codes, (scaled.unsqueeze(-1) - NF4).abs().argmin(-1).flatten()), name
    assert not [k for k in model if "absmax" in k or "quant_" in k or "nested" in k]
    assert all(v.dtype == torch.float32 for k, v in model.items() if ".lora_" in k)
    rest = {k: v for k, v in model.items() if ".lora_" not in k and k not in packed}
    for name, tensor in rest.items():  # embeddings, norms, head: the base's, untouched
        assert torch.equal(tensor, base[name.removeprefix("base_model.model.")]), name


@pytest.mark.parametrize("run", RUNS)
def test_adapter_export_is_the_adapter_peft_saved(tmp_path, run):
    result = run_cli("export-hf", _checkpoint(run), tmp_path / "adapter", "--lora", "adapter")
    assert result.exit_code == 0, result.output
    got = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    _assert_bit_exact(got, load_file(QLORA / run / "run" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config == json.loads((QLORA / run / "run" / "adapter_config.json").read_text())
    base = transformers.AutoModelForCausalLM.from_pretrained(str(BASE), trust_remote_code=False)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    state = model.state_dict()
    for name, tensor in got.items():
        module, _, param = name.rpartition(".")
        if ".lora_" in name:
            stored = f"{module}.default.{param}"
        elif ".base_layer." in name:  # an adapted lm_head's weight: PEFT saves "embedding
            stored = name             # layers" it adapts (save_embedding_layers="auto")
        else:  # a module trained in full
            stored = f"{module}.modules_to_save.default.{param}"
        assert torch.equal(state[stored], tensor), name


@pytest.mark.parametrize("run", RUNS)
def test_fuse_onto_the_full_precision_base_is_peft_s_merge(tmp_path, run):
    out = tmp_path / "fused"
    result = run_cli("export-hf", _checkpoint(run), out, "--lora", "fuse", "--base", BASE)
    assert result.exit_code == 0, result.output
    want = QLORA / run / "fused" / "model.safetensors"  # merge_and_unload().save_pretrained
    _assert_bit_exact(load_file(out / "model.safetensors"), load_file(want))
    assert (out / "model.safetensors").read_bytes() == want.read_bytes()
    result = run_cli("diff", out, want.parent)
    assert result.exit_code == 0 and "EQUAL: 12 tensors (12 bit-identical)" in result.stdout
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True, trust_remote_code=False)
    assert not any(info.values()), info
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16
    stored = load_file(QLORA / run / "logits.safetensors")
    # PEFT's fused folder computed here, in this process, is the exact reference: float sums
    # are exact only on one machine's kernels (and torch release), so the run's stored
    # logits are matched within bfloat16's rounding.
    peft_fused = transformers.AutoModelForCausalLM.from_pretrained(str(want.parent),
                                                                   trust_remote_code=False)
    with torch.no_grad():
        logits = model(input_ids=stored["tokens"]).logits
        assert torch.equal(logits, peft_fused(input_ids=stored["tokens"]).logits)
    torch.testing.assert_close(logits, stored["logits"], atol=2e-2, rtol=1.6e-2)


def test_fuse_without_base_says_to_pass_it(tmp_path):
    result = run_cli("export-hf", _checkpoint("all_linear"), tmp_path / "out", "--lora", "fuse")
    assert_one_line_error(result, "--base")
    # A run folder holding the config and tokenizer: the refusal is about the packed weights.
    run = tmp_path / "run"
    shutil.copytree(QLORA / "all_linear" / "run", run)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BASE / name, run / name)
    result = run_cli("export-hf", run / "checkpoint-3", tmp_path / "out", "--lora", "fuse")
    assert_one_line_error(result, "packed to 4 bits", "[64, 1]", "--base", "--lora adapter")
    with pytest.raises(fsdpckpt.NotACheckpointError, match=r"packed to 4 bits.*base=\.\.\."):
        fuse_into(_checkpoint("all_linear"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_base_that_is_not_the_run_s_model_is_refused_by_name(tmp_path):
    # Another tiny Llama (hidden size 64, not 16): every name is there, no size is.
    import transformers

    config = transformers.AutoConfig.from_pretrained(BASE)
    config.hidden_size, config.head_dim = 64, 16
    wider = tmp_path / "wider"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(wider)
    shutil.copy(BASE / "tokenizer.json", wider)
    result = run_cli("export-hf", _checkpoint("all_linear"), tmp_path / "out", "--lora", "fuse",
                     "--base", wider)
    assert_one_line_error(result, "model.embed_tokens.weight is [103, 16] but [103, 64]",
                          "--base")
    # The run's model with one projection of another shape: refused by its packed size (the
    # checkpoint's codes are for 8 x 16 weights), or, as many weights, by its adapter's shapes.
    other = tmp_path / "base"
    shutil.copytree(BASE, other)
    weights = load_file(BASE / "model.safetensors")
    for shape, message in (((4, 16), r"k_proj.base_layer.weight is \[32, 1\] but \[4, 16\]"),
                           ((2, 64), r"k_proj.weight is \[2, 64\], but .* 8 x 16 weights")):
        weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(shape,
                                                                         dtype=torch.bfloat16)
        save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(fsdpckpt.ExportMismatchError, match=message):
            fsdpckpt.export_hf(_checkpoint("all_linear"), tmp_path / "out", base=other,
                               lora="fuse")
    assert not (tmp_path / "out").exists()


def test_two_tensors_named_alike_are_refused_not_written_twice(tmp_path, monkeypatch):
    # Before the base's modules_to_save modules were named as PEFT's original_module, the
    # base's embeddings and the trained copy both became model.embed_tokens.weight, and the
    # export wrote a file naming it twice (which safetensors refuses to read).
    monkeypatch.setattr(lora_base, "_copied_modules", lambda layout: ())
    with pytest.raises(fsdpckpt.ExportMismatchError, match="would both be written as"):
        fsdpckpt.export_hf(_checkpoint("head_and_embeddings"), tmp_path / "out", base=BASE,
                           lora="fuse")
    assert not (tmp_path / "out").exists()


def test_inspect_shows_the_adapter_and_the_packed_base(tmp_path):
    # This run wrote adapter_config.json one folder up, with the adapter: inspect finds it
    # where the export does.
    ckpt = _checkpoint("all_linear")
    out = run_cli("inspect", ckpt, "--summary").stdout
    assert "LoRA adapter (../adapter_config.json): r=4, lora_alpha=8, targets" in out
    assert "Not recognized" not in out
    doc = json.loads(run_cli("inspect", ckpt, "--json").stdout)
    assert doc["ok"] and doc["adapter"]["r"] == 4 and doc["adapter"]["lora_alpha"] == 8
    # PEFT saves "all-linear" resolved, as the adapted modules' paths.
    targets = doc["adapter"]["target_modules"]
    assert sorted(t.rpartition(".")[2] for t in targets) == sorted(PROJECTIONS)
    tensors = {t["name"]: t for part in doc["parts"] for t in part["tensors"]}
    q_proj = tensors["model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert q_proj["shape"] == [64, 1] and q_proj["dtype"] == "bfloat16"
