"""A full export and an adapter export share no folder: one over the other replaces it.

transformers, with PEFT installed, follows an ``adapter_config.json`` to the base model and
loads the adapter over it, so a fused model left beside an adapter (or an adapter beside a
full model) would load as neither. What a crash may leave on the way is checked in
tests/test_crash_states.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fsdpckpt

LORA = Path(__file__).parent.parent / "fixtures" / "hf_trainer_lora"


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def test_an_adapter_export_over_a_full_one_leaves_no_full_model_beside_it(tmp_path):
    source, base = LORA / "run" / "checkpoint-3", LORA / "base"
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="fuse")
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="adapter", overwrite=True)
    names = _files(tmp_path / "out")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert not names & {"config.json", "generation_config.json", "model.safetensors"}


def test_a_full_export_over_an_adapter_export_leaves_no_adapter_beside_it(tmp_path):
    source, base = LORA / "run" / "checkpoint-3", LORA / "base"
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="adapter")
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="fuse", overwrite=True)
    names = _files(tmp_path / "out")
    assert {"config.json", "model.safetensors"} <= names
    assert not names & {"adapter_config.json", "adapter_model.safetensors"}


def test_an_export_over_one_of_the_other_kind_needs_overwrite(tmp_path):
    source, base = LORA / "run" / "checkpoint-3", LORA / "base"
    fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="adapter")
    with pytest.raises(fsdpckpt.OutputExistsError, match="adapter_"):
        fsdpckpt.export_hf(source, tmp_path / "out", base=base, lora="fuse")
    fsdpckpt.export_hf(source, tmp_path / "full", base=base, lora="fuse")
    with pytest.raises(fsdpckpt.OutputExistsError, match="config.json|model.safetensors"):
        fsdpckpt.export_hf(source, tmp_path / "full", base=base, lora="adapter")
