"""``save_pretrained`` of MoE (and LLaVA) models writes the hub's names, as export-hf does and
as transformers' own ``save_pretrained`` does: fused experts (``mlp.experts.gate_up_proj``)
split per expert, each rank writing the part of each expert tensor its shards hold.

The reference is threefold: ``export_hf`` of a ``save_state`` of the same model (byte for
byte: weights and index), transformers' ``save_pretrained`` (names, dtypes, bytes of every
tensor), and ``from_pretrained`` of the output (loads clean, the same logits).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_export_moe import _IDS, _config, _exported, _llava, _model, _reference, _same  # noqa: E402

import fsdpckpt  # noqa: E402
from fsdpckpt.export import hf as hf_module  # noqa: E402
from fsdpckpt.training import _save_moe, _save_write  # noqa: E402

from multirank import run_ranks  # noqa: E402

multirank = pytest.mark.multirank


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.name.endswith((".safetensors", ".index.json"))}


def _train(model) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    model(input_ids=_IDS, labels=_IDS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


def _report(result) -> dict:
    return {k: v for k, v in result.to_json().items() if k != "seconds"}


def _fsdp2_save(rank: int, world: int, arch: str, root: str, options: dict,
                window: int | None) -> dict:
    """FSDP2 over every layer: the 3 experts of each layer sharded 2 + 1 on dim 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    if window is not None:  # windows smaller than one expert: a piece written in parts
        _save_write.WINDOW = window
    model = _model(_config(arch))  # seeded: the same weights on every rank
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    _train(model)
    experts = next(v for k, v in model.state_dict().items() if k.endswith("gate_up_proj"))
    held = experts.to_local().shape[0]
    fsdpckpt.save_state(Path(root) / "ckpt", model)
    result = fsdpckpt.save_pretrained(model, Path(root) / "saved", **options)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return {"result": _report(result), "held": held,
            "full": {k: v.clone() for k, v in full.items()} if rank == 0 else None}


def _loads_clean(folder: Path, model, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="transformers"):
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert "newly initialized" not in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(_IDS).logits, model(_IDS).logits,
                                   atol=0, rtol=0)


@multirank
@pytest.mark.parametrize("arch, options, window", [
    ("mixtral", {"max_shard_size": "20KB"}, 100),
    ("qwen2_moe", {}, None),
])
def test_two_rank_fsdp2_moe_saves_what_export_hf_writes(tmp_path, caplog, arch, options,
                                                         window):
    ranks = run_ranks(_fsdp2_save, arch, str(tmp_path), options, window)
    assert [r["held"] for r in ranks] == [2, 1]  # experts sharded unevenly
    assert ranks[0]["result"] == ranks[1]["result"]
    assert ranks[0]["result"]["names_as_stored"] is None
    model = _model(_config(arch))
    model.load_state_dict(ranks[0]["full"])  # the trained weights
    reference = _reference(model, tmp_path / "reference")  # transformers' own save
    result = fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "exported",
                                base=tmp_path / "reference", **options)
    assert result.names_as_stored is None
    saved = tmp_path / "saved"
    assert _files(saved) == _files(tmp_path / "exported")  # byte for byte, index too
    if options:
        assert "model.safetensors.index.json" in _files(saved)
    _same(_exported(saved), reference)
    expert = "block_sparse_moe.experts.2.w3.weight" if arch == "mixtral" else \
        "mlp.experts.2.up_proj.weight"
    assert f"model.layers.1.{expert}" in reference
    _loads_clean(saved, model, caplog)


def test_a_plain_moe_model_in_one_process(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(_save_write, "WINDOW", 64)  # many windows per expert piece
    model = _model(_config("qwen3_moe"))
    reference = _reference(model, tmp_path / "reference")
    fsdpckpt.save_state(tmp_path / "ckpt", model)
    result = fsdpckpt.save_pretrained(model, tmp_path / "saved", max_shard_size="30KB")
    assert result.names_as_stored is None
    fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "exported", base=tmp_path / "reference",
                       max_shard_size="30KB")
    assert _files(tmp_path / "saved") == _files(tmp_path / "exported")
    _same(_exported(tmp_path / "saved"), reference)
    _loads_clean(tmp_path / "saved", model, caplog)


def test_without_the_model_class_the_names_are_written_as_stored_and_it_says_so(
        tmp_path, monkeypatch):
    missing = "transformers is not installed: pip install 'fsdpckpt[hf]'"
    monkeypatch.setattr(_save_moe, "expect_model", lambda *a, **k: missing)
    monkeypatch.setattr(hf_module, "expect_model", lambda *a, **k: missing)
    model = _model(_config("mixtral"))
    base = tmp_path / "base"  # config and tokenizer: no hub weights to check names against
    _reference(model, base)
    for weights in base.glob("*.safetensors"):
        weights.unlink()
    fsdpckpt.save_state(tmp_path / "ckpt", model)
    result = fsdpckpt.save_pretrained(model, tmp_path / "saved")
    assert result.names_as_stored == f"the model class was not built: {missing}"
    exported = fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "exported", base=base)
    assert exported.names_as_stored == result.names_as_stored
    assert _files(tmp_path / "saved") == _files(tmp_path / "exported")
    assert "model.layers.0.mlp.experts.gate_up_proj" in _exported(tmp_path / "saved")


def test_llava_is_saved_under_the_hub_names(tmp_path):
    model = _llava()
    reference = _reference(model, tmp_path / "reference")
    result = fsdpckpt.save_pretrained(model, tmp_path / "saved")
    assert result.names_as_stored is None
    _same(_exported(tmp_path / "saved"), reference)
    loaded, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(tmp_path / "saved"), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(_IDS).logits, model(_IDS).logits,
                                   atol=0, rtol=0)
