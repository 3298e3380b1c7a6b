"""save_pretrained (issue 19): a sharded model, from training code, to a folder from_pretrained
loads, every rank writing only its own shards' bytes, and the same bytes as export-hf of a
save_state of the same model.

The model is a tiny real Llama (fixtures/tiny_llama/'s config, tied and untied), trained a
step on 2 ranks (gloo, CPU); ``base`` is the fixture's run folder (config, tokenizer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fsdpckpt
from fsdpckpt import OutputExistsError

from conftest import FIXTURES
from multirank import run_ranks

multirank = pytest.mark.multirank
transformers = pytest.importorskip("transformers")

TINY = FIXTURES / "tiny_llama"
IDS = torch.tensor([[1, 5, 9, 23, 42, 7, 3, 11]])


def _llama(variant: str):
    config = transformers.LlamaConfig.from_pretrained(TINY / variant)
    torch.manual_seed(0)  # the same initial weights on every rank
    return transformers.LlamaForCausalLM(config)


def _wrap(model, kind: str):
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    if kind == "hsdp":  # a 2-D mesh: replicated over one dim, sharded over the other
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if kind == "tp":  # tensor parallel: column-wise Shard(0), row-wise Shard(1) weights
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2,))
        plan = {}
        for i in range(len(model.model.layers)):
            plan.update({f"model.layers.{i}.mlp.gate_proj": ColwiseParallel(),
                         f"model.layers.{i}.mlp.up_proj": ColwiseParallel(),
                         f"model.layers.{i}.mlp.down_proj": RowwiseParallel()})
        return parallelize_module(model, mesh, plan)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return model


def _train(model) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdpckpt.merging._keys import clean_key

    if isinstance(model, FSDP):  # torch 2.13 fails a full FSDP1 state dict on CPU: summon
        with FSDP.summon_full_params(model, writeback=False):
            return {clean_key(n): p.detach().clone() for n, p in model.state_dict().items()}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    return {clean_key(k): v.clone() for k, v in state.items()}


def _save_both(rank: int, world: int, variant: str, kind: str, root: str, options: dict) -> dict:
    """Train a step, then save_state (for export-hf) and save_pretrained of the same model."""
    model = _wrap(_llama(variant), kind)
    _train(model)
    fsdpckpt.save_state(Path(root) / "ckpt", model)
    result = fsdpckpt.save_pretrained(model, Path(root) / "saved", base=TINY / variant,
                                      **options)
    # Without base: the model's own config, whatever wraps it.
    fsdpckpt.save_pretrained(model, Path(root) / "own", **options)
    full = _full_state(model)  # collective: on every rank
    report = {k: v for k, v in result.to_json().items() if k != "seconds"}
    return {"result": report, "full": full if rank == 0 else None}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.name.endswith((".safetensors", ".index.json"))}


def _load(folder: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                    output_loading_info=True)
    return model, info


def _logits(state: dict, variant: str) -> torch.Tensor:
    model = _llama(variant)
    model.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model(input_ids=IDS).logits


def _check_like_export(root: Path, variant: str, options: dict, full: dict) -> None:
    exported = root / "exported"
    fsdpckpt.export_hf(root / "ckpt", exported, base=TINY / variant, **options)
    saved = root / "saved"
    assert _files(saved) == _files(exported)  # byte for byte: weights and index
    assert json.loads((saved / "config.json").read_bytes()) == \
        json.loads((exported / "config.json").read_bytes())
    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in exported.iterdir())
    own = json.loads((root / "own" / "config.json").read_bytes())
    assert own["architectures"] == ["LlamaForCausalLM"]
    assert _files(root / "own") == _files(saved)
    model, info = _load(saved)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if options.get("dtype") is None:
        torch.testing.assert_close(model(input_ids=IDS).logits, _logits(full, variant),
                                   rtol=0, atol=0)


@multirank
@pytest.mark.parametrize("variant, options", [
    ("untied", {}),
    ("tied", {"max_shard_size": "30KB"}),
])
def test_two_rank_fsdp2_saves_what_export_hf_writes_and_from_pretrained_loads(
        tmp_path, variant, options):
    ranks = run_ranks(_save_both, variant, "fsdp2", str(tmp_path), options)
    assert ranks[0]["result"] == ranks[1]["result"]
    full = ranks[0]["full"]
    _check_like_export(tmp_path, variant, options, full)
    sharded = "max_shard_size" in options
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file() == sharded
    if variant == "tied":
        assert ranks[0]["result"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert not [p for p in tmp_path.joinpath("saved").iterdir() if p.name.startswith(".")]


@multirank
def test_a_bf16_save_is_the_exact_cast(tmp_path):
    from safetensors.torch import load_file

    ranks = run_ranks(_save_both, "untied", "fsdp2", str(tmp_path), {"dtype": "bfloat16"})
    _check_like_export(tmp_path, "untied", {"dtype": "bfloat16"}, ranks[0]["full"])
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    for name, tensor in ranks[0]["full"].items():
        assert torch.equal(saved[name].view(torch.int16),
                           tensor.to(torch.bfloat16).view(torch.int16)), name
    config = json.loads((tmp_path / "saved" / "config.json").read_bytes())
    assert config["dtype" if "dtype" in config else "torch_dtype"] == "bfloat16"


@multirank
def test_fsdp1_saves_what_export_hf_writes(tmp_path):
    ranks = run_ranks(_save_both, "tied", "fsdp1", str(tmp_path), {"max_shard_size": "50KB"})
    _check_like_export(tmp_path, "tied", {"max_shard_size": "50KB"}, ranks[0]["full"])


@multirank
def test_tensor_parallel_row_and_column_shards_save_what_export_hf_writes(tmp_path):
    ranks = run_ranks(_save_both, "untied", "tp", str(tmp_path), {"dtype": "bf16"})
    _check_like_export(tmp_path, "untied", {"dtype": "bf16"}, ranks[0]["full"])


@multirank
def test_hsdp_replicas_are_written_once(tmp_path):
    ranks = run_ranks(_save_both, "tied", "hsdp", str(tmp_path), {"max_shard_size": "50KB"})
    _check_like_export(tmp_path, "tied", {"max_shard_size": "50KB"}, ranks[0]["full"])


def test_the_elements_of_a_non_contiguous_tensor_come_in_row_major_order():
    from fsdpckpt.training._save_write import elements_of

    tensor = torch.arange(5 * 6 * 7, dtype=torch.float32).reshape(5, 6, 7).transpose(0, 2)
    flat = tensor.reshape(-1)
    for start, stop in [(0, 210), (3, 4), (5, 41), (29, 31), (41, 200), (209, 210)]:
        assert torch.equal(elements_of(tensor, start, stop), flat[start:stop])


@multirank
def test_ddp_on_two_ranks_writes_each_tensor_once_in_export_hfs_order(tmp_path):
    # DCP gives each replicated tensor to one rank, balancing bytes, and lists them rank by
    # rank: export-hf keeps that order, and so does save_pretrained.
    ranks = run_ranks(_save_both, "tied", "ddp", str(tmp_path), {"max_shard_size": "50KB"})
    _check_like_export(tmp_path, "tied", {"max_shard_size": "50KB"}, ranks[0]["full"])


def test_a_plain_model_in_one_process_saves_what_export_hf_writes(tmp_path):
    result = _save_both(0, 1, "untied", "plain", str(tmp_path), {})
    _check_like_export(tmp_path, "untied", {}, result["full"])


def test_without_base_the_models_own_config_is_written(tmp_path):
    model = _llama("tied")
    result = fsdpckpt.save_pretrained(model, tmp_path / "out")
    assert result.tied == (("lm_head.weight", "model.embed_tokens.weight"),)
    config = json.loads((tmp_path / "out" / "config.json").read_bytes())
    assert config["architectures"] == ["LlamaForCausalLM"]
    loaded, info = _load(tmp_path / "out")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits,
                               rtol=0, atol=0)


def test_overwrite_is_refused_then_allowed_and_an_earlier_layout_goes(tmp_path):
    model = _llama("untied")
    fsdpckpt.save_pretrained(model, tmp_path / "out", base=TINY / "untied")
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        fsdpckpt.save_pretrained(model, tmp_path / "out", base=TINY / "untied")
    (tmp_path / "out" / "README.md").write_text("mine")
    fsdpckpt.save_pretrained(model, tmp_path / "out", base=TINY / "untied",
                             max_shard_size="100KB", overwrite=True)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "model.safetensors" not in names  # the single file of before would be loaded first
    assert "model.safetensors.index.json" in names and "README.md" in names
    _, info = _load(tmp_path / "out")
    assert not info["missing_keys"] and not info["unexpected_keys"]


def _fails_on_one_rank(rank: int, world: int, root: str, failing: int) -> dict:
    from fsdpckpt._io import spread_local

    model = _wrap(_llama("untied"), "fsdp2")
    if rank == failing:
        calls = []

        def write(self, offset, data):
            calls.append(offset)
            if len(calls) == 3:
                raise OSError(5, "simulated write failure")
            original(self, offset, data)

        original = spread_local._File.write
        spread_local._File.write = write
    try:
        fsdpckpt.save_pretrained(model, Path(root) / "saved", base=TINY / "untied",
                                 max_shard_size="40KB")
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@multirank
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failure_on_one_rank_leaves_nothing_and_raises_on_every_rank(tmp_path, failing):
    ranks = run_ranks(_fails_on_one_rank, str(tmp_path), failing)
    assert ranks[failing]["error"] == "OSError"
    for rank in ranks:
        assert "simulated write failure" in rank["message"]
    assert ranks[1 - failing]["message"].startswith(f"rank {failing} failed")
    assert not (tmp_path / "saved").exists()  # no output folder, no stage inside it
    assert os.listdir(tmp_path) == []


def test_ctrl_c_mid_write_leaves_nothing(tmp_path, monkeypatch):
    from fsdpckpt.training import _save_write

    original = _save_write._write_tensor
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        original(*args)

    monkeypatch.setattr(_save_write, "_write_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fsdpckpt.save_pretrained(_llama("untied"), tmp_path / "out", base=TINY / "untied")
    assert not (tmp_path / "out").exists()


def _exists_everywhere(rank: int, world: int, root: str) -> list:
    model = _wrap(_llama("untied"), "fsdp2")
    found = []
    for overwrite in (False, False, True):
        try:
            fsdpckpt.save_pretrained(model, Path(root) / "saved", overwrite=overwrite)
            found.append(None)
        except OutputExistsError as exc:
            found.append(str(exc))
    return found


@multirank
def test_an_existing_output_is_refused_on_every_rank(tmp_path):
    ranks = run_ranks(_exists_everywhere, str(tmp_path))
    for found in ranks:
        assert found[0] is None and found[2] is None
        assert "already holds files" in found[1]
    assert ranks[0][1] == ranks[1][1]


# --- PEFT LoRA models: lora="adapter" and lora="fuse", as export-hf --lora ----------------

def _peft_llama(variant: str):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(variant), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(1)  # the same adapters on every rank, not B = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _save_peft(rank: int, world: int, variant: str, kind: str, root: str, lora: str,
               options: dict) -> dict:
    model = _peft_llama(variant)
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        model = fully_shard(model)
    fsdpckpt.save_state(Path(root) / "ckpt", model)
    if rank == 0:
        model.peft_config["default"].save_pretrained(str(Path(root) / "ckpt"))
    result = fsdpckpt.save_pretrained(model, Path(root) / "saved", base=TINY / variant,
                                      lora=lora, **options)
    return {"result": result.to_json(), "logits": want}


@multirank
@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_two_rank_lora_adapter_is_what_export_hf_writes_and_peft_loads(tmp_path, variant):
    peft = pytest.importorskip("peft")
    ranks = run_ranks(_save_peft, variant, "fsdp2", str(tmp_path), "adapter", {})
    assert ranks[0]["result"]["files"] == ["adapter_model.safetensors", "adapter_config.json"]
    fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "exported", base=TINY / variant,
                       lora="adapter")
    saved = tmp_path / "saved"
    assert _files(saved) == _files(tmp_path / "exported")
    assert json.loads((saved / "adapter_config.json").read_bytes())["r"] == 2
    loaded = peft.PeftModel.from_pretrained(_llama(variant), str(saved)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, ranks[0]["logits"],
                                   atol=0, rtol=0)


@multirank
@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_two_rank_lora_fuse_is_what_export_hf_writes_and_transformers_loads(tmp_path, variant):
    options = {"max_shard_size": "60KB"}
    ranks = run_ranks(_save_peft, variant, "fsdp2", str(tmp_path), "fuse", options)
    fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "exported", base=TINY / variant,
                       lora="fuse", **options)
    saved = tmp_path / "saved"
    assert _files(saved) == _files(tmp_path / "exported")
    model, info = _load(saved)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, ranks[0]["logits"],
                                   atol=1e-5, rtol=1e-5)


def test_a_peft_model_needs_lora_and_a_plain_one_refuses_it(tmp_path):
    with pytest.raises(fsdpckpt.NotACheckpointError, match="lora='adapter'.*lora='fuse'"):
        fsdpckpt.save_pretrained(_peft_llama("untied"), tmp_path / "a")
    with pytest.raises(fsdpckpt.NotACheckpointError, match="holds no LoRA adapter"):
        fsdpckpt.save_pretrained(_llama("untied"), tmp_path / "b", lora="fuse")
    with pytest.raises(fsdpckpt.MergePlanError, match="'adapter'.*'fuse'"):
        fsdpckpt.save_pretrained(_llama("untied"), tmp_path / "c", lora="merge")
    assert not any(tmp_path.iterdir())


def test_another_ranks_error_is_raised_as_the_same_class_message_and_errno():
    import errno

    from fsdpckpt._io.spread_rounds import same_error

    full = same_error("DiskFullError", "/out: no space left", 1, errno.ENOSPC)
    assert isinstance(full, fsdpckpt.DiskFullError) and full.errno == errno.ENOSPC
    assert str(full) == "/out: no space left"
    exists = same_error("OutputExistsError", "/out: already holds files", 0)
    assert isinstance(exists, OutputExistsError) and str(exists) == "/out: already holds files"
    other = same_error("RuntimeError", "boom", 1)
    assert type(other) is fsdpckpt.FsdpCkptError and str(other).startswith("rank 1 failed")
