"""An adapter export from a DCP checkpoint is copied by the merge's checked copy, without torch.

``export-hf --lora adapter`` only renames the adapter's stored tensors (and casts them with
``dtype``): from a DCP folder the merge's copy does that, every byte checked against its
CRC-32, and torch is never imported. The file is the one the torch path writes, byte for
byte, and holds what PEFT's own ``save_pretrained`` holds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.export import _adapter_copy, lora

from chunked import flip_stored_byte


def _model():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "embed_tokens"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A PEFT Llama (LoRA on q, v and the embeddings) saved as Accelerate's save_state lays
    it out, its adapter_config.json beside it, and PEFT's own save_pretrained of it."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("adapter-copy")
    model = _model()
    ckpt = root / "ckpt"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    model.peft_config["default"].save_pretrained(str(ckpt))
    model.save_pretrained(str(root / "peft"))
    return ckpt, root / "peft"


def _through_torch(monkeypatch, ckpt: Path, out: Path, dtype: str | None) -> bytes:
    with monkeypatch.context() as patch:
        patch.setattr(lora, "copyable", lambda *_args: None)
        fsdpckpt.export_hf(ckpt, out, lora="adapter", dtype=dtype)
    return (out / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_the_copied_adapter_is_the_torch_paths_file_byte_for_byte(run, tmp_path, monkeypatch,
                                                                  dtype):
    ckpt, _peft = run
    fsdpckpt.export_hf(ckpt, tmp_path / "copied", lora="adapter", dtype=dtype)
    copied = (tmp_path / "copied" / "adapter_model.safetensors").read_bytes()
    assert copied == _through_torch(monkeypatch, ckpt, tmp_path / "torch", dtype)


def test_the_copied_adapter_holds_what_peft_saves(run, tmp_path):
    ckpt, peft_dir = run
    fsdpckpt.export_hf(ckpt, tmp_path / "out", lora="adapter")
    ours = load_file(tmp_path / "out" / "adapter_model.safetensors")
    theirs = load_file(peft_dir / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_an_adapter_export_from_dcp_never_imports_torch(run, tmp_path):
    ckpt, _peft = run
    code = (f"import sys, fsdpckpt\nfsdpckpt.export_hf({str(ckpt)!r}, "
            f"{str(tmp_path / 'out')!r}, lora='adapter', dtype='bf16')\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_a_flipped_bit_in_the_adapter_leaves_no_output_folder(run, tmp_path):
    import shutil

    ckpt = Path(shutil.copytree(run[0], tmp_path / "ckpt"))
    folder = ckpt / "pytorch_model_fsdp_0"
    names = [t.name for t in read_dcp_folder(folder).metadata.tensors]
    flip_stored_byte(folder, next(i for i, n in enumerate(names) if "lora_B" in n))
    with pytest.raises(fsdpckpt.ChecksumError):
        fsdpckpt.export_hf(ckpt, tmp_path / "out" / "adapter", lora="adapter")
    assert not (tmp_path / "out").exists()


def test_a_second_export_with_overwrite_replaces_only_the_adapter_files(run, tmp_path):
    ckpt, _peft = run
    out = tmp_path / "out"
    fsdpckpt.export_hf(ckpt, out, lora="adapter")
    (out / "README.md").write_text("mine")
    with pytest.raises(fsdpckpt.OutputExistsError):
        fsdpckpt.export_hf(ckpt, out, lora="adapter", dtype="bf16")
    fsdpckpt.export_hf(ckpt, out, lora="adapter", dtype="bf16", overwrite=True)
    assert (out / "README.md").read_text() == "mine"
    assert {t.dtype for t in load_file(out / "adapter_model.safetensors").values()} == \
        {torch.bfloat16}
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]


class _Source:
    """What copyable asks of a ModelSource: stored entries by name."""

    def __init__(self, entries):
        self._entries = entries

    def stored_entry(self, name):
        return self._entries.get(name)


def _entry(dtype: str, chunked: bool = True):
    from fsdpckpt.dcp.dtypes import dtype_from_name
    from fsdpckpt.dcp.metadata import TensorEntry

    return TensorEntry("x", dtype_from_name(dtype), (2, 2), (object(),) if chunked else (), ("x",))


def test_only_stored_chunks_with_a_castable_dtype_are_copied():
    floating, integer = _entry("float32"), _entry("int64")
    assert _adapter_copy.copyable(_Source({"a": floating}), {"a": "A"}, "bf16") == {"A": floating}
    assert _adapter_copy.copyable(_Source({"a": integer}), {"a": "A"}, None) == {"A": integer}
    # Tensor.to would cast an integer tensor; the merge keeps it: the torch path decides.
    assert _adapter_copy.copyable(_Source({"a": integer}), {"a": "A"}, "bf16") is None
    # A tensor of a .safetensors source, or one without stored chunks: read through torch.
    assert _adapter_copy.copyable(_Source({}), {"a": "A"}, None) is None
    unchunked = _Source({"a": _entry("float32", chunked=False)})
    assert _adapter_copy.copyable(unchunked, {"a": "A"}, None) is None
