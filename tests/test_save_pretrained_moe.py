"""``save_pretrained`` of MoE (and LLaVA) models writes the hub's names, as export-hf does and
as transformers' own ``save_pretrained`` does: fused experts (``mlp.experts.gate_up_proj``)
split per expert, each rank writing the part of each expert tensor its shards hold.

The reference is threefold: ``export_hf`` of a ``save_state`` of the same model (byte for
byte: weights and index), transformers' ``save_pretrained`` (names, dtypes, bytes of every
tensor), and ``from_pretrained`` of the output (loads clean, the same logits).
"""

from __future__ import annotations

import logging
import math
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


def _sharded_save(rank: int, world: int, arch: str, kind: str, root: str, options: dict,
                  window: int | None) -> dict:
    """FSDP2 (or FSDP1) over every layer: the 3 experts of each layer sharded 2 + 1 on dim 0."""
    from test_save_pretrained import _full_state, _wrap
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fsdpckpt.training._save_plan import local_tensors

    if window is not None:  # windows smaller than one expert: a piece written in parts
        _save_write.WINDOW = window
    model = _wrap(_model(_config(arch)), kind)  # seeded: the same weights on every rank
    _train(model)
    experts = next(v for k, v in get_model_state_dict(model).items()
                   if k.endswith("gate_up_proj"))
    held = [t.shape[0] for t in local_tensors(experts)]
    fsdpckpt.save_state(Path(root) / "ckpt", model)
    result = fsdpckpt.save_pretrained(model, Path(root) / "saved", **options)
    full = _full_state(model)  # collective: on every rank
    return {"result": _report(result), "held": held, "full": full if rank == 0 else None}


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
@pytest.mark.parametrize("arch, kind, options, window", [
    ("mixtral", "fsdp2", {"max_shard_size": "20KB"}, 100),
    ("qwen2_moe", "fsdp2", {}, None),
    ("qwen3_moe", "fsdp1", {"max_shard_size": "10KB"}, None),
    ("mixtral", "fsdp2", {"dtype": "bf16"}, 64),
])
def test_two_rank_moe_saves_what_export_hf_writes(tmp_path, caplog, arch, kind, options,
                                                   window):
    ranks = run_ranks(_sharded_save, arch, kind, str(tmp_path), options, window)
    assert [r["held"] for r in ranks] == [[2], [1]]  # experts sharded unevenly
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
    if "max_shard_size" in options:
        assert "model.safetensors.index.json" in _files(saved)
    if "dtype" in options:  # the exact cast of transformers' own names and tensors
        reference = {k: v.to(torch.bfloat16) for k, v in reference.items()}
        model = model.to(torch.bfloat16)
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
    result = fsdpckpt.save_pretrained(model, tmp_path / "saved", max_shard_size="10KB")
    assert result.names_as_stored is None
    fsdpckpt.export_hf(tmp_path / "ckpt", tmp_path / "exported", base=tmp_path / "reference",
                       max_shard_size="10KB")
    assert _files(tmp_path / "saved") == _files(tmp_path / "exported")
    assert "model.safetensors.index.json" in _files(tmp_path / "saved")
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


def test_a_piece_is_cut_from_boxes_that_split_it_on_every_dim():
    # A [3, 8, 4] tensor held as four boxes that cut dims 1 and 2 (as tensor parallel
    # would), cut into Mixtral-like pieces (one expert's up half, a whole expert's slice):
    # each piece's elements are the part of each box inside it, in the piece's order.
    from fsdpckpt.dcp.dtypes import dtype_from_name
    from fsdpckpt.export._moe import Piece
    from fsdpckpt.merging._runs import chunk_runs
    from fsdpckpt.training._save_plan import SavedTensor, _box, cut
    from fsdpckpt.training._save_write import cut_elements

    tensor = torch.arange(96, dtype=torch.float32).reshape(3, 8, 4)
    boxes = [((0, 0, 0), (3, 5, 3)), ((0, 5, 0), (3, 3, 3)), ((0, 0, 3), (3, 5, 1)),
             ((0, 5, 3), (3, 3, 1))]
    held = [tensor[tuple(slice(o, o + n) for o, n in zip(*b))].contiguous() for b in boxes]
    whole = SavedTensor("k", "k", (3, 8, 4), dtype_from_name("torch.float32"),
                        tuple((i, _box(*b)) for i, b in enumerate(boxes)))

    def source(local, start, stop):
        return held[local].reshape(-1)[start:stop]

    for offsets, sizes, shape in [((1, 4, 0), (1, 4, 4), (4, 4)), ((0, 2, 1), (3, 5, 2),
                                                                     (3, 5, 2))]:
        piece = cut(whole, Piece("p", "k", offsets, sizes, shape, False))
        elements = cut_elements(source, piece)
        got = torch.full((math.prod(sizes),), -1.0)
        for local, box in piece.boxes:
            run, starts = chunk_runs(sizes, box)
            values = elements(local, 0, math.prod(box.sizes))
            for i, at in enumerate(starts):
                got[at:at + run] = values[i * run:(i + 1) * run]
        want = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
        assert torch.equal(got, want)
        for local, box in piece.boxes:  # any window of a part
            n = math.prod(box.sizes)
            full = elements(local, 0, n)
            for start, stop in {(0, 1), (1, n), (n // 2, n), (n - 1, n)} - {(1, 1)}:
                assert torch.equal(elements(local, start, stop), full[start:stop])


def _remote_save(rank: int, world: int, root: str, url: str, options: dict) -> None:
    from test_save_pretrained import _wrap

    _save_write.WINDOW = 100  # several windows, so several steps, per expert piece
    model = _wrap(_model(_config("mixtral")), "fsdp2")
    _train(model)
    for output, storage in ((url, options), (str(Path(root) / "local"), None)):
        fsdpckpt.save_pretrained(model, output, max_shard_size="20KB",
                                 storage_options=storage)


@pytest.mark.s3
@multirank
def test_two_ranks_save_moe_pieces_to_s3_as_they_save_them_locally(s3, tmp_path):
    # Object storage needs every rank to step through a file alike: the pieces' windows.
    server, root = s3
    run_ranks(_remote_save, str(tmp_path), f"s3://{root}/out", server.options)
    fs = server.filesystem()
    remote = {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p, info in
              fs.find(root, detail=True).items() if info["type"] == "file"}
    local = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert "model.safetensors.index.json" in local
    assert remote == local
    assert any("block_sparse_moe.experts.2.w1.weight" in k
               for k in _exported(tmp_path / "local"))
