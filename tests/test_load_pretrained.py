"""load_pretrained (issue 19): Hugging Face weights into FSDP2, FSDP1, tensor-parallel, DDP,
plain and PEFT models, each rank reading its own pieces, bit-exact against transformers'
``from_pretrained``; mismatches and damaged files refused before any parameter changes."""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import fsdpckpt
from fsdpckpt.errors import (
    ChecksumError,
    CorruptCheckpointError,
    OptionError,
    StateMismatchError,
)
from fsdpckpt.training._hf_names import hf_name

from deep_compare import assert_same_tensors
from multirank import run_ranks

transformers = pytest.importorskip("transformers")

multirank = pytest.mark.multirank

_SIZES = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}


def _config(tied: bool, **changes):
    return transformers.LlamaConfig(**{**_SIZES, **changes}, tie_word_embeddings=tied)


def _model(tied: bool, seed: int, **changes):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(tied, **changes))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """``sharded``: untied, several safetensors shards and the index; ``tied``: one
    model.safetensors without lm_head; ``bin``: tied, pytorch_model.bin (torch.save of the
    state dict: both names, one storage) beside its config."""
    root = tmp_path_factory.mktemp("pretrained")
    _model(False, 0).save_pretrained(root / "sharded", max_shard_size="40KB")
    tied = _model(True, 1)
    tied.save_pretrained(root / "tied")
    (root / "bin").mkdir()
    torch.save(tied.state_dict(), root / "bin" / "pytorch_model.bin")
    shutil.copy(root / "tied" / "config.json", root / "bin" / "config.json")
    return {name: root / name for name in ("sharded", "tied", "bin")}


def _reference(folder: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What transformers loads, cast as ``Tensor.to`` casts."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.to(dtype) for k, v in model.state_dict().items()}


def test_sources_are_what_the_tests_say(sources):
    assert (sources["sharded"] / "model.safetensors.index.json").is_file()
    assert len(list(sources["sharded"].glob("model-*.safetensors"))) > 1
    from safetensors import safe_open

    with safe_open(sources["tied"] / "model.safetensors", "pt") as file:
        assert "lm_head.weight" not in set(file.keys())


# --- on each rank ------------------------------------------------------------------------


def _build(kind: str, tied: bool, dtype: torch.dtype, **changes):
    """A Llama of ``kind``: FSDP2 built on meta and ``to_empty()``d, FSDP1 and DDP over a
    materialized model, ``tp``: tensor parallel (row- and column-wise) under FSDP2 on a
    (1, 2) mesh."""
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = _model(tied, 7, **changes).to(dtype)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model.to_empty(device="cpu")
    model = _model(tied, 7, **changes).to(dtype)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                        use_orig_params=True)
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    assert kind == "tp", kind
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh["tp"], {"up_proj": ColwiseParallel(),
                                                   "down_proj": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _full(model) -> dict[str, torch.Tensor]:
    """The model's whole state, as plain tensors, named as Hugging Face names them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    from fsdpckpt.merging._keys import clean_key

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {clean_key(n): p.detach().clone()
                    for n, p in model.named_parameters(remove_duplicate=False)}
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in get_model_state_dict(model).items()}


def _rank_loads(rank, world, kind, cases):
    """Each case ``(source, tied, dtype)`` loaded into a fresh model of ``kind``."""
    found = []
    for source, tied, dtype in cases:
        model = _build(kind, tied, getattr(torch, dtype))
        result = fsdpckpt.load_pretrained(model, source)
        found.append((result.to_json(), _full(model)))
    return found


def _local_copy(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) else v).clone()
            for k, v in get_model_state_dict(model).items()}


def _rank_refusals(rank, world, cases):
    """Each case ``(source, changes)`` loaded into a fresh FSDP2 model: the error, and
    whether the model's shards are as before."""
    found = []
    for source, changes in cases:
        model = _build("fsdp2", False, torch.float32, **changes)
        before = _local_copy(model)
        try:
            fsdpckpt.load_pretrained(model, source)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = (type(exc).__name__, str(exc))
        else:
            error = None
        after = _local_copy(model)
        same = before.keys() == after.keys() and all(
            torch.equal(before[k].view(-1).view(torch.uint8), after[k].view(-1).view(torch.uint8))
            for k in before)
        found.append((error, same))
    return found


def _check_loaded(loaded: dict, reference: dict) -> None:
    assert_same_tensors(loaded, {k: reference[k] for k in loaded})
    assert set(reference) <= set(loaded), set(reference) - set(loaded)


# --- multi-rank ----------------------------------------------------------------------------


@multirank
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_a_sharded_model_loads_bit_exact_against_from_pretrained(sources, kind):
    cases = [(str(sources["sharded"]), False, "float32"),
             (str(sources["tied"] / "model.safetensors"), True, "bfloat16"),
             (str(sources["bin"]), True, "float32")]
    ranks = run_ranks(_rank_loads, kind, cases)
    for (source, _, dtype), *per_rank in zip(cases, *ranks):
        reference = _reference(Path(source).parent if source.endswith(".safetensors")
                               else Path(source), getattr(torch, dtype))
        for result, loaded in per_rank:
            assert result == {"step": None, "restored": ["model"], "warnings": []}
            _check_loaded(loaded, reference)


@multirank
def test_tensor_parallel_and_ddp_models_load_bit_exact(sources):
    reference = _reference(sources["sharded"], torch.bfloat16)
    for kind in ("tp", "ddp"):
        for (_, loaded), in run_ranks(_rank_loads, kind, [(str(sources["sharded"]), False,
                                                          "bfloat16")]):
            _check_loaded(loaded, reference)


@multirank
def test_every_rank_refuses_a_damaged_or_mismatched_source_and_changes_nothing(
        sources, tmp_path):
    truncated = _copy(sources["tied"], tmp_path / "truncated")
    with open(truncated / "model.safetensors", "r+b") as file:
        file.truncate(file.seek(0, 2) - 100)
    flipped = _flip_a_data_byte(_copy(sources["bin"], tmp_path / "flipped"))
    cases = [(str(truncated), {}), (str(flipped), {}), (str(sources["sharded"]),
                                                         {"vocab_size": 80})]
    for rank in run_ranks(_rank_refusals, cases):
        (truncated_error, same_1), (crc_error, same_2), (mismatch, same_3) = rank
        assert same_1 and same_2 and same_3
        assert truncated_error[0] == "CorruptCheckpointError"
        assert "model.safetensors" in truncated_error[1]
        assert crc_error[0] == "ChecksumError" and "pytorch_model.bin" in crc_error[1]
        assert mismatch[0] == "StateMismatchError"
        assert "model.embed_tokens.weight (checkpoint [96, 32], model [80, 32])" in mismatch[1]


def _copy(folder: Path, into: Path) -> Path:
    shutil.copytree(folder, into)
    return into


def _flip_a_data_byte(folder: Path) -> Path:
    """Flip one byte inside the largest storage entry of the folder's pytorch_model.bin."""
    path = folder / "pytorch_model.bin"
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as file:
        file.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", file.read(4))
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        file.seek(at)
        byte = file.read(1)[0]
        file.seek(at)
        file.write(bytes([byte ^ 0x10]))
    return folder


# --- one process ---------------------------------------------------------------------------


def _plain_on_meta(tied: bool, dtype: torch.dtype = torch.float32, **changes):
    with torch.device("meta"):
        model = _model(tied, 7, **changes).to(dtype)
    return model.to_empty(device="cpu")


@pytest.mark.parametrize("source, tied, dtype", [
    ("sharded", False, torch.float32), ("sharded", False, torch.bfloat16),
    ("tied", True, torch.bfloat16), ("bin", True, torch.float16)])
def test_a_plain_module_built_on_meta_loads_bit_exact(sources, source, tied, dtype):
    # to_empty() unties the plain module: the config's tie fills lm_head all the same.
    model = _plain_on_meta(tied, dtype)
    result = fsdpckpt.load_pretrained(model, sources[source])
    assert result.restored == ("model",) and not result.missing and not result.unexpected
    _check_loaded(dict(model.state_dict()), _reference(sources[source], dtype))


def test_a_sharded_bin_with_its_index_loads_bit_exact(sources, tmp_path):
    import json

    weights = _reference(sources["sharded"])
    names = sorted(weights)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2],
              "pytorch_model-00002-of-00002.bin": names[1::2]}
    (tmp_path / "bins").mkdir()
    for file, part in halves.items():
        torch.save({n: weights[n] for n in part}, tmp_path / "bins" / file)
    (tmp_path / "bins" / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in halves.items() for n in part}}))
    model = _plain_on_meta(False, torch.bfloat16)
    fsdpckpt.load_pretrained(model, tmp_path / "bins")
    _check_loaded(dict(model.state_dict()), {k: v.to(torch.bfloat16) for k, v in weights.items()})


def test_activation_checkpointing_and_torch_compile_wrappers_are_seen_through(sources):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    model = _plain_on_meta(True, torch.bfloat16)
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, transformers.models.llama.modeling_llama
                                              .LlamaDecoderLayer))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    compiled = torch.compile(model)
    result = fsdpckpt.load_pretrained(compiled, sources["tied"])
    assert not result.missing and not result.unexpected
    state = {hf_name(k): v for k, v in model.state_dict().items()}
    _check_loaded(state, _reference(sources["tied"], torch.bfloat16))


def test_weights_of_the_base_model_load_into_one_with_a_head_and_back(sources, tmp_path):
    torch.manual_seed(4)
    transformers.LlamaModel(_config(True)).save_pretrained(tmp_path / "base")
    model = _model(True, 5)
    assert not fsdpckpt.load_pretrained(model, tmp_path / "base").missing
    reference = _reference(sources["tied"])  # only for the names: the values are base's
    assert set(model.state_dict()) == set(reference)
    base = transformers.LlamaModel.from_pretrained(tmp_path / "base").state_dict()
    _check_loaded({k.removeprefix("model."): v for k, v in model.state_dict().items()
                   if k != "lm_head.weight"}, base)
    assert torch.equal(model.lm_head.weight, base["embed_tokens.weight"])

    headless = transformers.LlamaModel(_config(False))
    result = fsdpckpt.load_pretrained(headless, sources["sharded"], strict=False)
    assert result.unexpected == ("lm_head.weight",) and not result.missing
    _check_loaded(dict(headless.state_dict()),
                  {k.removeprefix("model."): v for k, v in
                   _reference(sources["sharded"]).items() if k != "lm_head.weight"})


def test_the_names_a_class_ignores_when_unexpected_are_ignored(tmp_path):
    from safetensors.torch import load_file, save_file

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(6)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    weights = load_file(tmp_path / "gpt2" / "model.safetensors")
    weights["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8)  # as old GPT-2 files hold
    save_file(weights, tmp_path / "gpt2" / "model.safetensors", metadata={"format": "pt"})
    model = transformers.GPT2LMHeadModel(config)
    result = fsdpckpt.load_pretrained(model, tmp_path / "gpt2")
    assert not result.unexpected
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").state_dict()
    _check_loaded(dict(model.state_dict()), reference)


def test_non_persistent_buffers_are_left_alone_with_keep(sources):
    model = _model(False, 5)
    model.model.rotary_emb.inv_freq.fill_(3.0)  # not in the state dict, so not the file's
    fsdpckpt.load_pretrained(model, sources["sharded"], buffers="keep")
    assert bool((model.model.rotary_emb.inv_freq == 3.0).all())
    _check_loaded(dict(model.state_dict()), _reference(sources["sharded"]))


def test_non_persistent_buffers_are_set_as_the_models_initialization_gives_them(sources):
    model = _model(False, 5)
    model.model.rotary_emb.inv_freq.fill_(3.0)  # what to_empty() may leave
    fsdpckpt.load_pretrained(model, sources["sharded"])
    want = transformers.LlamaForCausalLM.from_pretrained(sources["sharded"])
    assert_same_tensors(dict(model.named_buffers()), dict(want.named_buffers()))


def test_an_unknown_buffers_value_is_refused_before_anything_loads(sources):
    model = _model(False, 5)
    model.model.register_buffer("cache", torch.full((4,), 7.0), persistent=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"'model\.cache' \(LlamaModel\).*"
                       r"buffers='keep'"):
        fsdpckpt.load_pretrained(model, sources["sharded"])
    assert_same_tensors(dict(model.state_dict()), before)
    fsdpckpt.load_pretrained(model, sources["sharded"], buffers="keep")
    assert bool((model.model.cache == 7.0).all())


def test_a_plain_module_with_its_own_buffer_needs_keep(tmp_path):
    from safetensors.torch import save_file

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    save_file({"proj.weight": torch.ones(4, 4), "proj.bias": torch.zeros(4)},
              tmp_path / "model.safetensors")
    model = Scaled()
    with pytest.raises(StateMismatchError, match="'scale' \\(Scaled\\)"):
        fsdpckpt.load_pretrained(model, tmp_path)
    assert not bool((model.proj.weight == 1).all())
    fsdpckpt.load_pretrained(model, tmp_path, buffers="keep")
    assert bool((model.proj.weight == 1).all()) and float(model.scale) == 2.0


def test_an_unknown_buffers_mode_is_refused(sources):
    with pytest.raises(OptionError, match="buffers='fresh'"):
        fsdpckpt.load_pretrained(_model(False, 5), sources["sharded"], buffers="fresh")


def test_a_strided_parameter_is_filled_through_a_scratch_buffer(tmp_path):
    from safetensors.torch import save_file

    weights = {"weight": torch.randn(3, 5), "bias": torch.randn(3)}
    save_file(weights, tmp_path / "model.safetensors")
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    model.weight = torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16).t())
    assert not model.weight.is_contiguous()
    fsdpckpt.load_pretrained(model, tmp_path / "model.safetensors")
    assert_same_tensors({"weight": model.weight.detach().contiguous(), "bias": model.bias},
                        {k: v.to(torch.bfloat16) for k, v in weights.items()})


def test_a_peft_model_loads_its_base_weights_and_keeps_its_adapters(sources):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model(False, 3), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapters = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    assert adapters
    result = fsdpckpt.load_pretrained(model, sources["sharded"])
    assert not result.missing and not result.unexpected
    state = model.state_dict()
    assert_same_tensors({k: state[k] for k in adapters}, adapters)
    base = {hf_name(k): v for k, v in state.items() if k not in adapters}
    _check_loaded(base, _reference(sources["sharded"]))


def test_strict_reports_missing_unexpected_and_mismatched_keys_at_once(sources, tmp_path):
    from safetensors.torch import save_file

    weights = _reference(sources["sharded"])
    del weights["model.norm.weight"]
    weights["extra.weight"] = torch.zeros(2)
    (tmp_path / "odd").mkdir()
    save_file(weights, tmp_path / "odd" / "model.safetensors", metadata={"format": "pt"})
    model = _model(False, 5, intermediate_size=48)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError) as caught:
        fsdpckpt.load_pretrained(model, tmp_path / "odd")
    message = str(caught.value)
    assert "1 missing from the checkpoint: model.norm.weight" in message
    assert "1 not in the model: extra.weight" in message
    assert "6 shape differs" in message and "Nothing was loaded" in message
    assert_same_tensors(dict(model.state_dict()), before)

    result = fsdpckpt.load_pretrained(model, tmp_path / "odd", strict=False)
    assert result.missing == ("model.norm.weight",)
    assert result.unexpected == ("extra.weight",)
    assert len(result.mismatched) == 6
    assert result.to_json()["unexpected"] == ["extra.weight"]
    state = model.state_dict()
    assert_same_tensors({"model.norm.weight": state["model.norm.weight"]},
                        {"model.norm.weight": before["model.norm.weight"]})
    assert torch.equal(state["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])


def test_a_file_longer_than_its_tensors_is_refused(sources, tmp_path):
    folder = _copy(sources["tied"], tmp_path / "appended")
    with open(folder / "model.safetensors", "ab") as file:
        file.write(b"\0" * 16)
    model = _plain_on_meta(True)
    with pytest.raises(CorruptCheckpointError, match="16 bytes after its last tensor"):
        fsdpckpt.load_pretrained(model, folder)


def _drop_a_shard(folder: Path) -> None:
    sorted(folder.glob("model-*.safetensors"))[-1].unlink()


def _index_a_name_no_shard_holds(folder: Path) -> None:
    import json

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = sorted(set(index["weight_map"].values()))[0]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _empty(folder: Path) -> None:
    for file in folder.iterdir():
        file.unlink()


@pytest.mark.parametrize("damage, error, match", [
    (_drop_a_shard, fsdpckpt.CheckpointNotFoundError, "listed in model.safetensors.index.json"),
    (_index_a_name_no_shard_holds, CorruptCheckpointError, "lists 'model.extra.weight'"),
    (_empty, fsdpckpt.NotACheckpointError, "holds no model.safetensors.index.json"),
])
def test_a_broken_folder_is_refused_in_one_line(sources, tmp_path, damage, error, match):
    folder = _copy(sources["sharded"], tmp_path / "broken")
    damage(folder)
    with pytest.raises(error, match=match) as caught:
        fsdpckpt.load_pretrained(_model(False, 5), folder)
    assert "\n" not in str(caught.value)


def test_a_bin_whose_bytes_fail_their_crc_is_refused(sources, tmp_path):
    folder = _flip_a_data_byte(_copy(sources["bin"], tmp_path / "flipped"))
    model = _model(True, 5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ChecksumError, match="pytorch_model.bin"):
        fsdpckpt.load_pretrained(model, folder)
    assert_same_tensors(dict(model.state_dict()), before)


def test_a_tied_pair_stored_with_different_values_is_refused(sources, tmp_path):
    from safetensors.torch import save_file

    weights = _reference(sources["tied"])
    weights["lm_head.weight"] = weights["lm_head.weight"] + 1
    (tmp_path / "untied").mkdir()
    save_file(weights, tmp_path / "untied" / "model.safetensors", metadata={"format": "pt"})
    model = _model(True, 5)
    with pytest.raises(StateMismatchError, match="tie_word_embeddings=False"):
        fsdpckpt.load_pretrained(model, tmp_path / "untied")


def test_a_model_left_on_meta_is_refused(sources):
    with torch.device("meta"):
        model = _model(False, 0)
    with pytest.raises(OptionError, match="to_empty"):
        fsdpckpt.load_pretrained(model, sources["sharded"])


@pytest.mark.s3
@pytest.mark.parametrize("source, tied", [("sharded", False), ("bin", True)])
def test_a_source_on_s3_loads(sources, s3, source, tied):
    from conftest import upload

    server, root = s3
    url = upload(server, sources[source], f"s3://{root}/llama")
    model = _plain_on_meta(tied, torch.bfloat16)
    fsdpckpt.load_pretrained(model, url, storage_options=server.options)
    _check_loaded(dict(model.state_dict()), _reference(sources[source], torch.bfloat16))


@pytest.mark.parametrize("key, name", [
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight",
     "model.layers.0.mlp.up_proj.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
     "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight",
     None),
    ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("base_model.model.lm_head.original_module.weight", "lm_head.weight"),
])
def test_hf_name(key, name):
    assert hf_name(key) == name


@pytest.mark.parametrize("stored, wanted, renamed", [
    (["layers.0.w"], ["model.layers.0.w"], {"model.layers.0.w": "layers.0.w"}),
    (["model.layers.0.w", "lm_head.w"], ["layers.0.w"],
     {"layers.0.w": "model.layers.0.w", "lm_head.w": "lm_head.w"}),
    (["model.layers.0.w"], ["model.layers.0.w", "model.x"],
     {"model.layers.0.w": "model.layers.0.w"}),
    (["a.w"], ["b.w"], {"a.w": "a.w"}),
])
def test_align_prefix(stored, wanted, renamed):
    from fsdpckpt.training._hf_names import align_prefix

    assert align_prefix(stored, wanted, "model") == renamed


# --- memory --------------------------------------------------------------------------------

#: What a load may add to a rank's peak memory beyond its own shards (the issue's bound).
GROWTH_LIMIT_MIB = 128


@pytest.fixture(scope="module")
def large_sources(tmp_path_factory):
    """Four 4096 x 4096 fp32 weights (256 MiB), as model.safetensors and pytorch_model.bin."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("large")
    weights = {f"{i}.weight": torch.full((4096, 4096), float(i + 1)) for i in range(4)}
    (root / "st").mkdir()
    save_file(weights, root / "st" / "model.safetensors")
    (root / "bin").mkdir()
    torch.save(weights, root / "bin" / "pytorch_model.bin")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["st", "bin"])
def test_a_load_adds_a_bounded_amount_of_memory_whatever_the_model_size(large_sources, kind):
    from conftest import peak_rss_mib

    code = f"""
import re, torch, fsdpckpt
def rss(field):
    with open('/proc/self/status') as status:
        return int(re.search(field + r':\\s+(\\d+) kB', status.read()).group(1)) / 1024
with torch.device('meta'):
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(4)])
model = model.to_empty(device='cpu').to(torch.bfloat16)
fsdpckpt.load_pretrained(model, {str(large_sources / kind)!r})  # warm: imports, first use
with open('/proc/self/clear_refs', 'w') as refs:
    refs.write('5')  # the peak starts again from here
before = rss('VmRSS')
fsdpckpt.load_pretrained(model, {str(large_sources / kind)!r})
growth = rss('VmHWM') - before
assert growth < {GROWTH_LIMIT_MIB}, f'the load added {{growth:.0f}} MiB'
assert bool((model[3].weight == 4).all())
"""
    peak_rss_mib(code)
