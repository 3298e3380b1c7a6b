"""A vision-language run exported as its users would (issue 20, sections 3 and 4).

``fixtures/llava/`` is a real 2-rank FSDP2 run (Accelerate's ``save_state``, gloo, CPU) of a
tiny transformers 5 ``LlavaForConditionalGeneration``, with the ``LlavaProcessor`` (a tokenizer
and the PIL image processor, no torchvision) the run kept beside its checkpoints;
``fixtures/generate_llava.py`` writes it. Its checkpoint holds transformers 5's in-memory
names (``model.language_model.*``). The references are transformers' own: ``save_pretrained``
of the trained model (the hub's names, ``language_model.model.*``, and bytes), and the logits
the trained model computes on a fixed image and prompt.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import fsdpckpt  # noqa: E402

from conftest import FIXTURES, assert_same_safetensors, load_clean, run_cli  # noqa: E402

LLAVA = FIXTURES / "llava"
RUN = LLAVA / "run"
CKPT = RUN / "checkpoint-3"
REFERENCE = LLAVA / "reference"
PROCESSOR_FILES = ("processor_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    out = tmp_path_factory.mktemp("llava") / "out"
    result = run_cli("export-hf", CKPT, out, "--base", RUN, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["names_as_stored"] is None and doc["not_checked"] is None, doc
    return out


def _inputs() -> dict[str, torch.Tensor]:
    return load_file(LLAVA / "logits.safetensors")


def test_the_checkpoint_holds_the_in_memory_names_and_the_reference_the_hubs():
    with safe_open(str(REFERENCE / "model.safetensors"), "pt") as f:
        hub = set(f.keys())
    stored = {t.name for t in fsdpckpt.inspect_checkpoint(CKPT).parts[0].tensors}
    assert any(k.startswith("model.model.language_model.") for k in stored)
    assert any(k.startswith("language_model.model.") for k in hub)
    assert not any(k.startswith("model.language_model.") for k in hub)


def test_the_export_writes_the_names_and_bytes_save_pretrained_wrote(export):
    assert_same_safetensors(export / "model.safetensors", REFERENCE / "model.safetensors")


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     pixel_values=inputs["pixel_values"]).logits


def _reference_logits(caplog) -> torch.Tensor:
    # Computed here, in this process, from save_pretrained's folder: float sums are exact only
    # on one machine's kernels, so the stored logits of the training machine are no exact
    # reference for this one.
    reference = load_clean(transformers.LlavaForConditionalGeneration, REFERENCE, caplog)
    return _logits(reference, _inputs())


def test_the_export_loads_clean_with_save_pretraineds_logits(export, caplog):
    model = load_clean(transformers.LlavaForConditionalGeneration, export, caplog)
    torch.testing.assert_close(_logits(model, _inputs()), _reference_logits(caplog),
                               atol=0, rtol=0)


def test_the_exports_logits_are_the_runs_within_another_machines_rounding(export, caplog):
    model = load_clean(transformers.LlavaForConditionalGeneration, export, caplog)
    torch.testing.assert_close(_logits(model, _inputs()), _inputs()["logits"],
                               atol=1e-6, rtol=1e-4)


def test_the_processor_and_generation_config_are_what_the_run_and_save_pretrained_wrote(
        export):
    for name in PROCESSOR_FILES:
        assert (export / name).read_bytes() == (RUN / name).read_bytes(), name
    # Made from the config, as transformers' save_pretrained of the model makes it.
    made = json.loads((export / "generation_config.json").read_text())
    assert made == json.loads((REFERENCE / "generation_config.json").read_text())


def test_auto_processor_loads_the_export_without_torchvision_and_makes_the_runs_inputs(
        export, caplog):
    import importlib.util

    pytest.importorskip("PIL", reason="the PIL image processor needs pillow (test extra)")
    if importlib.util.find_spec("torchvision") is not None:  # it would pick torchvision's
        pytest.skip("checks the load where torchvision is not installed")
    processor = transformers.AutoProcessor.from_pretrained(str(export), trust_remote_code=False)
    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    ref = _inputs()
    with safe_open(str(LLAVA / "logits.safetensors"), "pt") as f:
        prompt = f.metadata()["prompt"]
    made = processor(images=ref["image"].numpy(), text=prompt, return_tensors="pt")
    for name in ("input_ids", "attention_mask", "pixel_values"):
        assert torch.equal(made[name], ref[name]), name
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(export)).eval()
    with torch.no_grad():  # the processor's inputs through the exported model: the run's logits
        torch.testing.assert_close(model(**made).logits, _reference_logits(caplog),
                                   atol=0, rtol=0)


def test_inspect_of_the_export_lists_its_processor_files(export):
    result = run_cli("inspect", export, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    kinds = {f["name"]: f["kind"] for f in doc["side_files"]}
    assert kinds == {"config.json": "config", "generation_config.json": "generation_config",
                     "processor_config.json": "processor", "tokenizer.json": "tokenizer",
                     "tokenizer_config.json": "tokenizer", "chat_template.jinja": "chat_template"}
    assert doc["other_files"] == [] and doc["ok"]
    text = run_cli("inspect", export).stdout
    assert "processor_config.json" in text and "Not recognized" not in text


def test_inspect_of_a_checkpoint_holding_the_processor_recognizes_it(tmp_path):
    # HF Trainer saves the processor (and config) into each checkpoint-N folder.
    ckpt = shutil.copytree(CKPT, tmp_path / "checkpoint-3")
    for name in (*PROCESSOR_FILES, "config.json"):
        shutil.copy(RUN / name, ckpt / name)
    report = fsdpckpt.inspect_checkpoint(ckpt)
    assert report.ok and report.other_files == ()
    assert {f.name: f.kind for f in report.side_files if f.rank is None} == {
        "config.json": "config", "processor_config.json": "processor",
        "tokenizer.json": "tokenizer", "tokenizer_config.json": "tokenizer",
        "chat_template.jinja": "chat_template"}
    text = run_cli("inspect", ckpt).stdout
    assert "Not recognized" not in text and "processor_config.json" in text


def test_verify_passes_on_the_runs_checkpoint():
    result = run_cli("verify", CKPT)
    assert result.exit_code == 0, result.output
    assert fsdpckpt.verify_checkpoint(CKPT).ok


def test_a_config_without_architectures_is_exported_under_the_hub_names(tmp_path):
    # A LlavaConfig built in the training script and saved as it is names no class: the
    # model type's image-text-to-text model is the one save_pretrained would have written.
    base = shutil.copytree(RUN, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoint-*"))
    config = json.loads((base / "config.json").read_text())
    del config["architectures"]
    (base / "config.json").write_text(json.dumps(config))
    result = fsdpckpt.export_hf(CKPT, tmp_path / "out", base=base)
    assert result.names_as_stored is None and result.not_checked is None
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == \
        sorted(load_file(REFERENCE / "model.safetensors"))


def test_without_base_the_runs_folder_above_the_checkpoint_gives_the_same_export(
        export, tmp_path):
    result = run_cli("export-hf", CKPT, tmp_path / "out")  # the config and processor: run/
    assert result.exit_code == 0, result.output
    for name in ("model.safetensors", "config.json", "generation_config.json",
                 *PROCESSOR_FILES):
        assert (tmp_path / "out" / name).read_bytes() == (export / name).read_bytes(), name
