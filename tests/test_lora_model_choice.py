"""LoRA reads the model folder merge would merge, and refuses where merge refuses (issue 18 §3).

A checkpoint with several model folders (``pytorch_model_fsdp_0/`` and ``_1/``, one per
model an Accelerate run wrapped) is ambiguous: merge asks for ``--model-index``, and LoRA
export and fusion did too little, reading the first folder whatever it held.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import fsdpckpt  # noqa: E402
from fsdpckpt.errors import NotACheckpointError  # noqa: E402
from fsdpckpt.export._lora_read import open_model_source  # noqa: E402
from fsdpckpt.export.lora import export_adapter, fuse_into, fused_tensors  # noqa: E402

_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["proj"],
           "fan_in_fan_out": False, "bias": "none"}


def _model(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"base_model.model.proj.base_layer.weight": torch.randn(4, 3, generator=generator),
            "base_model.model.proj.lora_A.default.weight": torch.randn(2, 3, generator=generator),
            "base_model.model.proj.lora_B.default.weight": torch.randn(4, 2, generator=generator)}


def _save(folder, models: dict[int, dict[str, torch.Tensor]]):
    import torch.distributed.checkpoint as dcp

    for index, state in models.items():
        dcp.save({"model": state}, checkpoint_id=str(folder / f"pytorch_model_fsdp_{index}"))
    (folder / "adapter_config.json").write_text(json.dumps(_CONFIG))
    return folder


@pytest.fixture
def two_models(tmp_path):
    return _save(tmp_path / "ckpt", {0: _model(0), 1: _model(1)})


@pytest.mark.parametrize("read", [
    lambda ckpt, out: export_adapter(ckpt, out),
    lambda ckpt, out: fuse_into(ckpt, out),
    lambda ckpt, out: list(fused_tensors(ckpt)),
    lambda ckpt, out: fsdpckpt.export_hf(ckpt, out, lora="adapter"),
], ids=["export_adapter", "fuse_into", "fused_tensors", "export_hf-adapter"])
def test_several_model_folders_are_refused_as_merge_refuses_them(two_models, tmp_path, read):
    with pytest.raises(NotACheckpointError) as merge_refused:
        fsdpckpt.merge(two_models, tmp_path / "merged")
    with pytest.raises(NotACheckpointError) as lora_refused:
        read(two_models, tmp_path / "out")
    assert str(lora_refused.value) == str(merge_refused.value)
    assert "--model-index" in str(lora_refused.value)
    assert "pytorch_model_fsdp_0" in str(lora_refused.value)
    assert "pytorch_model_fsdp_1" in str(lora_refused.value)
    assert not (tmp_path / "out").exists()


def test_the_model_index_chooses_the_folder_as_merge_chooses_it(two_models):
    for index in (0, 1):
        source = open_model_source(two_models, model_index=index)
        assert source.path == two_models / f"pytorch_model_fsdp_{index}"
        read = dict(source.read())
        for name, tensor in _model(index).items():
            torch.testing.assert_close(read[name], tensor, rtol=0, atol=0)


def test_a_model_folder_named_directly_is_read(two_models, tmp_path):
    result = export_adapter(two_models / "pytorch_model_fsdp_1", tmp_path / "out",
                            lora_config=two_models)
    assert result.tensors == 2


def test_one_model_folder_is_read_without_a_choice(tmp_path):
    ckpt = _save(tmp_path / "ckpt", {0: _model(0)})
    fused = dict(fused_tensors(ckpt))
    state = _model(0)
    want = state["base_model.model.proj.base_layer.weight"] + 2.0 * (
        state["base_model.model.proj.lora_B.default.weight"]
        @ state["base_model.model.proj.lora_A.default.weight"])
    torch.testing.assert_close(fused["proj.weight"], want)


def test_an_unfinished_model_folder_is_refused_as_merge_refuses_it(tmp_path):
    ckpt = _save(tmp_path / "ckpt", {0: _model(0)})
    (ckpt / "pytorch_model_fsdp_0" / ".metadata").unlink()
    with pytest.raises(NotACheckpointError) as merge_refused:
        fsdpckpt.merge(ckpt, tmp_path / "merged")
    with pytest.raises(NotACheckpointError) as lora_refused:
        list(fused_tensors(ckpt))
    assert str(lora_refused.value) == str(merge_refused.value)
