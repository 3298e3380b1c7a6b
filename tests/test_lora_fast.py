"""The fused export's fast path keeps PEFT's bits.

A fused export copies every tensor it does not compute as a merge copies it (cast by the
merge's casts), reads only the base weights it fuses, and fuses them on one torch thread
with the product's memory reused (fsdpckpt/export/_fuse_hf.py, _lora_fuse.py). Each of
these is checked here against what it replaced: PEFT's ``merge_and_unload`` bit for bit
(fp32, and its cast to bf16 / fp16), the reference formula on special values, and torch's
default thread count.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from test_lora import _gpt2, _llama, _save, _trained  # noqa: E402

from fsdpckpt.export import _lora_read  # noqa: E402
from fsdpckpt.export._lora_fuse import one_thread  # noqa: E402
from fsdpckpt.export.lora import find_lora, fuse_into, fuse_weight  # noqa: E402


def _llama_with_biases():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False,
                                      attention_bias=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


_CASES = {
    "lora": dict(model=_llama, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "dropout-rslora": dict(model=_llama, r=3, lora_alpha=8, lora_dropout=0.1,
                           use_rslora=True, target_modules=["q_proj", "gate_proj"]),
    "lora-bias": dict(model=_llama_with_biases, r=4, lora_alpha=8, lora_bias=True,
                      target_modules=["q_proj", "v_proj"]),
    "modules-to-save": dict(model=_llama, r=2, lora_alpha=4, target_modules=["o_proj"],
                            modules_to_save=["lm_head"]),
    "embedding": dict(model=_llama, r=2, lora_alpha=4, target_modules=["embed_tokens"]),
    "fan-in-fan-out": dict(model=_gpt2, r=4, lora_alpha=8, fan_in_fan_out=True,
                           target_modules=["c_attn"]),
}


@pytest.fixture(params=sorted(_CASES))
def trained(request, tmp_path):
    case = dict(_CASES[request.param])
    build = case.pop("model")
    peft_model = _trained(build(), **case)
    return peft_model, _save(peft_model, tmp_path / "ckpt")


def _bits(tensor):
    return tensor.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_a_fused_export_is_peft_merge_and_unload_bit_for_bit(trained, tmp_path, monkeypatch,
                                                             dtype):
    peft_model, ckpt = trained
    read: list[str] = []
    original = _lora_read.ModelSource.read

    def recorded(self, want=None):
        for name, tensor in original(self, want):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(_lora_read.ModelSource, "read", recorded)
    fuse_into(ckpt, tmp_path / "out", dtype=dtype)
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = peft_model.merge_and_unload().state_dict()
    cast = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for name, tensor in got.items():
        expected = want[name].to(cast) if cast is not None else want[name]
        assert tensor.dtype == expected.dtype and torch.equal(_bits(tensor), _bits(expected)), \
            name
    # Only the adapters and the weights (and biases) they fuse into were read as tensors;
    # every other tensor (modules_to_save copies too) went from its stored chunks to the
    # file as a merge copies it.
    layout = find_lora(_lora_read.open_model_source(ckpt).names)
    adapters = {k for m in layout.modules for k in m.adapter_keys}
    fused = {n for m in layout.modules for n in (m.weight, m.bias if m.lora_b_bias else None)
             if n is not None}
    assert sorted(read) == sorted(adapters | fused)


def _special(shape, dtype, seed):
    # Random values with the awkward ones mixed in: NaNs with payloads, infinities, signed
    # zeros and subnormals, in the stored dtype.
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 0.1
    flat = values.view(-1)
    flat[::7] = 0.0
    flat[1::11] = -0.0
    flat[2::13] = float("inf")
    flat[3::17] = float("-inf")
    flat[4::19] = 1e-40  # subnormal in fp32
    values = values.to(dtype)
    bits = values.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)
    nan = {torch.float32: 0x7FC01234, torch.bfloat16: 0x7FC5, torch.float16: 0x7E05}[dtype]
    bits[5::23] = nan
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["linear", "fan-in-fan-out", "embedding"])
@pytest.mark.parametrize("scaling", [0.5, 2.0, 8 / 3 ** 0.5])
def test_fuse_weight_gives_the_reference_formula_bits(dtype, kind, scaling):
    out_features, rank, in_features = 48, 3, 40
    a = _special((rank, in_features), dtype, 1)
    b = _special((out_features, rank), dtype, 2)
    transposed = kind != "linear"
    weight = _special((in_features, out_features) if transposed else (out_features, in_features),
                      dtype, 3)
    # The formula as PEFT writes it (get_delta_weight, then W + delta), out of place.
    delta = b.float() @ a.float()
    reference = (weight.float() + (delta.T if transposed else delta) * scaling).to(dtype)
    got = fuse_weight(weight, a, b, scaling, fan_in_fan_out=kind == "fan-in-fan-out",
                      embedding=kind == "embedding").to(dtype)
    assert torch.equal(_bits(got), _bits(reference))
    assert torch.equal(_bits(weight), _bits(_special(weight.shape, dtype, 3)))  # not written


@pytest.mark.parametrize("shape", [(1024, 16, 1024), (2816, 16, 1024), (1024, 16, 2816),
                                   (300, 7, 500), (4096, 64, 512), (33, 1, 65)])
def test_one_thread_gives_the_bits_of_the_default_thread_count(shape):
    out_features, rank, in_features = shape
    torch.manual_seed(0)
    b, a = torch.randn(out_features, rank) * 0.01, torch.randn(rank, in_features)
    threads = torch.get_num_threads()
    expected = (b @ a).mul_(0.5)
    with one_thread():
        assert torch.get_num_threads() == 1
        got = (b @ a).mul_(0.5)
    assert torch.get_num_threads() == threads
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("damaged", ["mlp.down_proj.weight", "self_attn.q_proj.base_layer"])
def test_a_flipped_bit_in_a_copied_or_a_fused_tensor_raises_and_writes_nothing(damaged,
                                                                               tmp_path):
    from test_checked_reads import flip_tensor_bit

    from fsdpckpt import ChecksumError
    from fsdpckpt.dcp.reader import read_dcp_folder

    peft_model = _trained(_llama(), r=2, lora_alpha=4, target_modules=["q_proj"])
    ckpt = _save(peft_model, tmp_path / "ckpt")
    folder = ckpt / "pytorch_model_fsdp_0"
    name = next(t.name for t in read_dcp_folder(folder).metadata.tensors if damaged in t.name)
    _, path = flip_tensor_bit(folder, name)
    with pytest.raises(ChecksumError) as caught:
        fuse_into(ckpt, tmp_path / "out")
    assert str(path) in str(caught.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()
