"""diff of a checkpoint against its export, where export-hf renamed or cut the tensors.

The export writes the names ``save_pretrained`` writes (Mixtral's fused experts per expert,
LLaVA's ``language_model.model.*``) or a trainer's names as its converter gives them
(torchtune's Llama with q/k rows reordered by heads, torchtitan's Qwen 3 renamed). diff reads
the checkpoint under the export's names by export-hf's own plan
(fsdpckpt/inspection/_diff_names.py) and compares each tensor with its box of the stored
one, bit for bit: the fixtures' exports are EQUAL in both argument orders, and one element
changed in the export is found under its export name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fsdpckpt
from fsdpckpt.inspection import diff as diff_module
from fsdpckpt.inspection.diff import diff
from fsdpckpt.training import _save_moe

from chunked import split, write_dcp
from conftest import FIXTURES
from conftest import run_cli as run

#: name -> (checkpoint, base, the export tensor changed, what the names note says)
RUNS = {
    "mixtral": (FIXTURES / "mixtral" / "run" / "checkpoint-3", None,
                "model.layers.1.block_sparse_moe.experts.2.w3.weight", "save_pretrained"),
    "llava": (FIXTURES / "llava" / "run" / "checkpoint-3", None,
              "language_model.model.layers.0.self_attn.o_proj.weight", "save_pretrained"),
    "torchtune": (FIXTURES / "torchtune" / "dist_epoch_0", FIXTURES / "torchtune_hf",
                  "model.layers.0.self_attn.q_proj.weight", "q/k rows reordered"),
    "torchtitan_qwen3": (FIXTURES / "torchtitan_qwen3" / "checkpoint" / "step-2",
                         FIXTURES / "torchtitan_qwen3" / "hf",
                         "model.layers.0.self_attn.q_proj.weight", "Qwen 3 names"),
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def exported(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    if request.param in ("mixtral", "llava"):
        pytest.importorskip("transformers")
    checkpoint, base, _, _ = RUNS[request.param]
    out = tmp_path_factory.mktemp(request.param) / "hf"
    fsdpckpt.export_hf(checkpoint, out, base=base)
    return request.param, checkpoint, out


def _changed(out: Path, name: str, at: Path, *, as_bin: bool = False) -> Path:
    # A copy of the export with one element of ``name`` changed (row 3 where it has rows).
    shutil.copytree(out, at)
    tensors = load_file(out / "model.safetensors")
    value = tensors[name].clone()
    value.view(-1)[3 * value.shape[-1] + 1] += 1
    tensors[name] = value
    (at / "model.safetensors").unlink()
    if as_bin:
        torch.save(tensors, at / "pytorch_model.bin")
    else:
        save_file(tensors, at / "model.safetensors", metadata={"format": "pt"})
    return at


def test_a_checkpoint_equals_its_export_in_either_order(exported):
    which, checkpoint, out = exported
    for a, b, side in ((checkpoint, out, "a"), (out, checkpoint, "b")):
        report = diff(a, b)
        assert report.equal, (report.missing, report.unexpected, report.differing)
        assert all(t.identical for t in report.tensors)
        assert report.names is not None and report.names.side == side
        assert RUNS[which][3] in (report.names.converted or ""), report.names
        assert len(report.tensors) == len(load_file(out / "model.safetensors")) + \
            len(report.tied)


def test_a_changed_element_of_the_export_is_named_as_the_export_names_it(exported, tmp_path):
    which, checkpoint, out = exported
    name = RUNS[which][2]
    changed = _changed(out, name, tmp_path / "changed")
    for a, b in ((checkpoint, changed), (changed, checkpoint)):
        report = diff(a, b)
        assert not report.equal and not report.missing and not report.unexpected
        assert [(t.name, t.mismatched) for t in report.differing] == [(name, 1)]


def test_an_export_as_torch_save_is_read_box_by_box_under_its_names(exported, tmp_path):
    # The export side has no pieces: the checkpoint side's boxes are read through its
    # pieces, cut and reordered (ConvertedSource.read).
    which, checkpoint, out = exported
    name = RUNS[which][2]
    shutil.copytree(out, tmp_path / "bin")
    torch.save(load_file(out / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "model.safetensors").unlink()
    assert diff(checkpoint, tmp_path / "bin").equal
    report = diff(checkpoint, _changed(out, name, tmp_path / "changed", as_bin=True))
    assert [(t.name, t.mismatched) for t in report.differing] == [(name, 1)]


def test_a_merged_trainer_checkpoint_as_torch_save_against_its_export(tmp_path):
    # Both sides read only by boxes: the stored rows are read one by one in the hub's order.
    checkpoint, base, name, _ = RUNS["torchtune"]
    fsdpckpt.export_hf(checkpoint, tmp_path / "hf", base=base)
    fsdpckpt.merge(checkpoint, tmp_path / "merged")
    torch.save(load_file(tmp_path / "merged" / "model.safetensors"), tmp_path / "tune.bin")
    torch.save(load_file(tmp_path / "hf" / "model.safetensors"), tmp_path / "hf.bin")
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "config.json")
    report = diff(tmp_path / "tune.bin", tmp_path / "hf.bin")
    assert report.equal and report.names is not None and report.names.reordered == 2
    report = diff(tmp_path / "merged" / "model.safetensors",
                  _changed(tmp_path / "hf", name, tmp_path / "changed"))
    assert [(t.name, t.mismatched) for t in report.differing] == [(name, 1)]


def test_the_cli_says_how_names_were_matched_in_text_and_json(exported):
    which, checkpoint, out = exported
    result = run("diff", checkpoint, out, "-q")
    assert result.exit_code == 0, result.output
    assert "names: A read as export-hf writes it" in result.stdout
    result = run("diff", out, checkpoint, "-q", "--json")
    assert result.exit_code == 0, result.output
    names = json.loads(result.stdout)["names"]
    assert names["side"] == "b" and RUNS[which][3] in names["converted"]
    assert names["not_mapped"] is None and names["renamed"] + names["cut"] > 0


def test_without_the_model_class_names_are_compared_as_stored_and_it_says_why(
        exported, monkeypatch):
    which, checkpoint, out = exported
    monkeypatch.setattr(_save_moe, "expect_model", lambda *_a, **_k: "no transformers")
    report = diff(checkpoint, out)
    if which.startswith("torch"):  # a trainer's names need no model class
        assert report.equal and report.names is not None and report.names.converted
        return
    assert not report.equal and report.missing and report.unexpected
    assert report.names is not None and report.names.converted is None
    assert "no transformers" in (report.names.not_mapped or "")
    result = run("diff", checkpoint, out, "-q", "--json")
    assert result.exit_code == 1
    assert "no transformers" in json.loads(result.stdout)["names"]["not_mapped"]


def test_a_folder_with_the_checkpoints_own_names_needs_no_mapping(tmp_path):
    # A merge has the checkpoint's names: nothing to map, and nothing said.
    checkpoint = RUNS["torchtune"][0]
    fsdpckpt.merge(checkpoint, tmp_path / "merged")
    shutil.copy(RUNS["torchtune"][1] / "config.json", tmp_path / "merged" / "config.json")
    report = diff(checkpoint, tmp_path / "merged")
    assert report.equal and report.names is None
    assert report.to_json()["names"] is None


@pytest.mark.parametrize("which", ["torchtune", "mixtral"])
def test_chunks_cut_inside_heads_and_experts_and_stored_transposed(which, tmp_path):
    # The same weights rewritten as a DCP folder cut in three on every dim (a chunk ends
    # inside a head's rows, inside an expert, across gate and up), 2-d chunks stored
    # column-major: each written tensor is still compared with exactly its stored elements.
    checkpoint, base, name, _ = RUNS[which]
    if which == "mixtral":
        pytest.importorskip("transformers")
        base = checkpoint.parent
    fsdpckpt.merge(checkpoint, tmp_path / "merged")
    tensors = load_file(tmp_path / "merged" / "model.safetensors")
    layouts = {k: (t, split(tuple(range(t.dim())), 3, transpose=t.dim() == 2))
               for k, t in tensors.items()}
    cut = write_dcp(tmp_path / "cut", layouts)
    fsdpckpt.export_hf(cut, tmp_path / "hf", base=base)
    report = diff(cut, tmp_path / "hf")
    assert report.equal and report.names is not None and report.names.converted
    report = diff(_changed(tmp_path / "hf", name, tmp_path / "changed"), cut)
    assert [(t.name, t.mismatched) for t in report.differing] == [(name, 1)]


def test_a_class_transformers_fails_to_build_is_compared_as_stored(exported, monkeypatch):
    which, checkpoint, out = exported
    if which.startswith("torch"):
        pytest.skip("a trainer's names need no model class")

    def failing(*_args, **_kwargs):
        raise ValueError("no such attention implementation")

    monkeypatch.setattr(_save_moe, "expect_model", failing)
    report = diff(out, checkpoint)
    assert not report.equal and report.names is not None and report.names.side == "b"
    assert "ValueError: no such attention implementation" in (report.names.not_mapped or "")


def test_tiny_boxes_cut_across_experts_and_reordered_rows(exported, tmp_path, monkeypatch):
    # Tiles of 5 elements: each one crosses row, head and expert boundaries somewhere.
    which, checkpoint, out = exported
    monkeypatch.setattr(diff_module, "BOX_ELEMENTS", 5)
    assert diff(checkpoint, out).equal and diff(out, checkpoint).equal
    name = RUNS[which][2]
    report = diff(checkpoint, _changed(out, name, tmp_path / "changed"))
    assert [(t.name, t.mismatched) for t in report.differing] == [(name, 1)]
