"""inspect names every file save_pretrained writes beside a model: the processor's other
tokenizers in their folders, the extra chat templates, and the custom code an auto_map names,
in a checkpoint folder (as HF Trainer saves them into checkpoint-N/) and in a model folder.
"""

from __future__ import annotations

import json
import shutil

import pytest

import fsdpckpt

from conftest import FIXTURES, run_cli

TOKENIZER = FIXTURES / "tiny_llama" / "untied"


def _hf_files(folder) -> None:
    (folder / "config.json").write_text(json.dumps({
        "model_type": "custom", "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    (folder / "modeling_x.py").write_text("from .helpers_x import thing\n")
    (folder / "helpers_x.py").write_text("thing = 1\n")
    (folder / "unrelated.py").write_text("print('not named by the auto_map')\n")
    (folder / "qformer_tokenizer").mkdir()
    shutil.copy(TOKENIZER / "tokenizer_config.json", folder / "qformer_tokenizer")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")


@pytest.fixture
def checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / "fsdp2_accelerate", ckpt)
    _hf_files(ckpt)
    return ckpt


def _kinds(report) -> dict[str, str]:
    return {f.name: f.kind for f in report.side_files}


def test_a_checkpoints_code_and_tokenizer_folders_are_named(checkpoint):
    report = fsdpckpt.inspect_checkpoint(checkpoint)
    kinds = _kinds(report)
    assert kinds["modeling_x.py"] == "code" and kinds["helpers_x.py"] == "code"
    assert kinds["qformer_tokenizer/"] == "tokenizer"
    assert kinds["additional_chat_templates/"] == "chat_template"
    assert report.other_files == ("unrelated.py",)


def test_a_folders_size_counts_its_files(checkpoint):
    sizes = {f.name: f.size for f in fsdpckpt.inspect_checkpoint(checkpoint).side_files}
    assert sizes["qformer_tokenizer/"] == (TOKENIZER / "tokenizer_config.json").stat().st_size
    assert sizes["additional_chat_templates/"] == len("{{ messages }}")


def test_python_files_without_an_auto_map_are_not_recognized(checkpoint):
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama"}))
    report = fsdpckpt.inspect_checkpoint(checkpoint)
    assert "code" not in _kinds(report).values()
    assert set(report.other_files) == {"modeling_x.py", "helpers_x.py", "unrelated.py"}


def test_a_model_folder_lists_them_too(tmp_path):
    shutil.copy(TOKENIZER / "trained.safetensors", tmp_path / "model.safetensors")
    _hf_files(tmp_path)
    kinds = _kinds(fsdpckpt.inspect_checkpoint(tmp_path))
    assert {kinds[n] for n in ("modeling_x.py", "qformer_tokenizer/",
                               "additional_chat_templates/")} == {"code", "tokenizer",
                                                                  "chat_template"}
    assert "unrelated.py" not in kinds


def test_the_cli_shows_them_under_hugging_face_files(checkpoint):
    out = run_cli("inspect", checkpoint, "--summary").stdout
    listed = out.split("Hugging Face files:")[1]
    for name in ("modeling_x.py", "qformer_tokenizer/", "additional_chat_templates/"):
        assert name in listed
    assert "Not recognized: unrelated.py" in out
