"""The files beside the weights: every one ``save_pretrained`` of a model, tokenizer or
processor writes comes through export-hf and ``fsdpckpt.save_pretrained``, with the safety
rules of the others; a generation config is made where the run left none (as VeRL's merger
does); the config says ``dtype``, never the legacy ``torch_dtype``.

The fixture is the tiny Llama run of fixtures/tiny_llama/ (HF Trainer's layout; VeRL's
``huggingface/`` subfolder is made from it). The file names fsdpckpt keeps are checked
against the installed transformers' own, where it is installed.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from fsdpckpt import NotACheckpointError, export_hf
from fsdpckpt.export import _config
from fsdpckpt.export._config import (
    GENERATION_FIELDS,
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    generation_config,
)

from conftest import FIXTURES
from multirank import run_ranks

TINY = FIXTURES / "tiny_llama"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
#: The processor files as transformers 4 and 5 write them, each with its own bytes.
PROCESSOR_BYTES = {
    "processor_config.json": b'{"processor_class": "Qwen2AudioProcessor"}\n',
    "preprocessor_config.json": b'{"feature_extractor_type": "WhisperFeatureExtractor"}\n',
    "video_preprocessor_config.json": b'{"video_processor_type": "LlavaOnevisionVideo"}\n',
    "chat_template.json": json.dumps({"chat_template": TEMPLATE}).encode(),
}


def _run(tmp_path: Path) -> Path:
    """A copy of the tied run: config, tokenizer, generation config beside checkpoint-3."""
    run = tmp_path / "run"
    shutil.copytree(TINY / "tied", run)
    return run


def _verl_run(tmp_path: Path) -> Path:
    """The run as VeRL leaves it when the model was not loaded from a hub folder: config and
    tokenizer in ``huggingface/`` inside the checkpoint, no generation config, and a config
    written by transformers 4 (``torch_dtype``)."""
    run = _run(tmp_path)
    hf = run / "checkpoint-3" / "huggingface"
    hf.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (run / name).rename(hf / name)
    (run / "generation_config.json").unlink()
    config = json.loads((hf / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    return run


def _export(run: Path, tmp_path: Path) -> Path:
    export_hf(run / "checkpoint-3", tmp_path / "out")
    return tmp_path / "out"


# --- processors -----------------------------------------------------------------------


def test_every_processor_file_is_copied_as_it_is(tmp_path):
    run = _run(tmp_path)
    for name, data in PROCESSOR_BYTES.items():
        (run / name).write_bytes(data)
    out = _export(run, tmp_path)
    assert {name: (out / name).read_bytes() for name in PROCESSOR_BYTES} == PROCESSOR_BYTES


def _audio_processor(folder: Path):
    # Qwen2-Audio's processor: a Whisper feature extractor (numpy only; image and video
    # processors need PIL or torchvision) beside the run's tokenizer, with a chat template.
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.Qwen2AudioProcessor(
        feature_extractor=transformers.WhisperFeatureExtractor(feature_size=8),
        tokenizer=tokenizer, chat_template=TEMPLATE)


def test_auto_processor_loads_an_export_whose_run_holds_a_processor(tmp_path):
    transformers = pytest.importorskip("transformers")
    run = _run(tmp_path)
    saved = _audio_processor(run)
    saved.save_pretrained(run)  # transformers 5: processor_config.json, chat_template.jinja
    loaded = transformers.AutoProcessor.from_pretrained(_export(run, tmp_path))
    assert type(loaded) is type(saved)
    assert loaded.feature_extractor.to_dict() == saved.feature_extractor.to_dict()
    assert loaded.chat_template == TEMPLATE


def test_auto_processor_loads_a_transformers_4_processor_layout(tmp_path):
    transformers = pytest.importorskip("transformers")
    run = _run(tmp_path)
    saved = _audio_processor(run)
    # As transformers 4 saved it: the feature extractor's preprocessor_config.json naming
    # the processor class, the template in chat_template.json.
    saved.feature_extractor.processor_class = type(saved).__name__
    saved.feature_extractor.save_pretrained(run)
    (run / "chat_template.jinja").unlink()
    (run / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    loaded = transformers.AutoProcessor.from_pretrained(_export(run, tmp_path))
    assert type(loaded) is type(saved)
    assert loaded.chat_template == TEMPLATE


def test_a_processors_other_tokenizer_is_copied_into_its_folder(tmp_path):
    # InstructBLIP's processor saves its second tokenizer in qformer_tokenizer/.
    run = _run(tmp_path)
    (run / "qformer_tokenizer").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(run / name, run / "qformer_tokenizer" / name)
    out = _export(run, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "qformer_tokenizer" / name).read_bytes() == (run / name).read_bytes()
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoTokenizer.from_pretrained(out, subfolder="qformer_tokenizer")
    assert loaded("hello world")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(run)("hello world")["input_ids"]


def test_a_processor_file_linking_out_of_its_folder_is_refused(tmp_path):
    run = _run(tmp_path)
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (run / "preprocessor_config.json").symlink_to(outside)
    with pytest.raises(NotACheckpointError, match=r"preprocessor_config\.json.*outside"):
        _export(run, tmp_path)
    assert not (tmp_path / "out").exists()


def test_an_oversized_processor_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    run = _run(tmp_path)
    limit = (run / "tokenizer.json").stat().st_size + 100  # the tokenizer still fits
    monkeypatch.setattr(_config, "MAX_SIDE_BYTES", limit)
    (run / "preprocessor_config.json").write_bytes(b" " * (limit + 1))
    with pytest.raises(NotACheckpointError, match=r"preprocessor_config\.json.*bytes, over"):
        _export(run, tmp_path)
    assert not (tmp_path / "out").exists()


# --- the names, as the installed transformers writes them ------------------------------


def _vocab_file_names(transformers) -> set[str]:
    # Every tokenizer class's vocab_files_names, read from transformers' source: importing
    # each class needs backends (sentencepiece...) this machine may lack.
    names: set[str] = set()
    for path in (Path(transformers.__file__).parent / "models").glob("*/tokenization_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                    isinstance(t, ast.Name) and t.id in ("VOCAB_FILES_NAMES", "vocab_files_names")
                    for t in node.targets):
                names |= {v.value for v in node.value.values
                          if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return names


def test_every_tokenizer_file_transformers_names_is_copied():
    transformers = pytest.importorskip("transformers")
    from transformers import tokenization_utils_base as base

    names = _vocab_file_names(transformers)
    assert "tokenizer.model" in names and "vocab.txt" in names  # the scan found them
    names |= {base.FULL_TOKENIZER_FILE, base.TOKENIZER_CONFIG_FILE,
              base.SPECIAL_TOKENS_MAP_FILE, base.ADDED_TOKENS_FILE}
    assert sorted(names - set(TOKENIZER_FILES)) == []


def test_processor_and_template_names_are_transformers_constants():
    pytest.importorskip("transformers")
    from transformers import utils

    assert set(PROCESSOR_FILES) == {utils.PROCESSOR_NAME, utils.FEATURE_EXTRACTOR_NAME,
                                    utils.IMAGE_PROCESSOR_NAME, utils.VIDEO_PROCESSOR_NAME}
    assert {utils.CHAT_TEMPLATE_FILE, utils.LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE} <= \
        set(TOKENIZER_FILES)
    assert (utils.CHAT_TEMPLATE_DIR, utils.GENERATION_CONFIG_NAME, utils.CONFIG_NAME) == \
        (_config._TEMPLATES_DIR, _config.GENERATION_CONFIG, _config.CONFIG)


def test_generation_fields_are_every_generation_config_setting():
    transformers = pytest.importorskip("transformers")
    default = transformers.GenerationConfig().to_dict()
    settings = set(default) - {"transformers_version", "_from_model_config"}
    assert set(GENERATION_FIELDS) == settings
    assert all(default[k] is None for k in settings)  # so the diff is what is set


# --- the generation config and dtype of a VeRL export -----------------------------------


def test_a_generation_config_is_made_where_the_run_left_none(tmp_path):
    transformers = pytest.importorskip("transformers")
    run = _verl_run(tmp_path)
    out = _export(run, tmp_path)
    # VeRL's merger: from_config, then save_pretrained (GenerationConfig.from_model_config).
    config = transformers.AutoConfig.from_pretrained(run / "checkpoint-3" / "huggingface")
    model = transformers.AutoModelForCausalLM.from_config(config)
    want = model.generation_config.to_diff_dict()
    got = json.loads((out / "generation_config.json").read_bytes())
    assert got.pop("transformers_version") == config.transformers_version  # the config's
    want.pop("transformers_version")
    assert got == want
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 2


def _verl_fsdp1(rank: int, world: int, root: str) -> None:
    """What VeRL's FSDPCheckpointManager.save_checkpoint writes for an FSDP1 model built from
    its config (so no generation config: its name_or_path is empty), under transformers 4
    (``torch_dtype``)."""
    import torch
    import transformers
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

    config = transformers.AutoConfig.from_pretrained(TINY / "tied")
    torch.manual_seed(0)
    model = FSDP(transformers.AutoModelForCausalLM.from_config(config),
                 device_id=torch.device("cpu"))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                              ShardedStateDictConfig()):
        torch.save(model.state_dict(), Path(root) / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        hf = Path(root) / "huggingface"
        model.module.config.save_pretrained(hf)
        transformers.AutoTokenizer.from_pretrained(TINY / "tied").save_pretrained(hf)
        legacy = json.loads((hf / "config.json").read_text())
        legacy["torch_dtype"] = legacy.pop("dtype")
        (hf / "config.json").write_text(json.dumps(legacy, indent=2))
        (Path(root) / "fsdp_config.json").write_text(json.dumps(
            {"FSDP_version": 1, "world_size": world}))


@pytest.mark.multirank
def test_a_verl_fsdp1_export_has_its_mergers_generation_config_and_dtype(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "ckpt").mkdir()
    run_ranks(_verl_fsdp1, str(tmp_path / "ckpt"))
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    hf = tmp_path / "ckpt" / "huggingface"
    assert not (hf / "generation_config.json").exists()
    want = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(hf)).generation_config.to_diff_dict()
    got = json.loads((tmp_path / "out" / "generation_config.json").read_bytes())
    assert {k: v for k, v in got.items() if k != "transformers_version"} == \
        {k: v for k, v in want.items() if k != "transformers_version"}
    config = json.loads((tmp_path / "out" / "config.json").read_bytes())
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.generation_config.eos_token_id == 2


def test_a_composite_models_generation_config_takes_its_decoders_settings(tmp_path):
    transformers = pytest.importorskip("transformers")
    tiny = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 32}
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(vocab_size=50, bos_token_id=3, eos_token_id=7,
                                             pad_token_id=0, **tiny),
        vision_config=transformers.CLIPVisionConfig(image_size=8, patch_size=4, **tiny))
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    want = transformers.GenerationConfig.from_model_config(
        transformers.AutoConfig.from_pretrained(tmp_path)).to_diff_dict()
    got = generation_config(json.loads((tmp_path / "config.json").read_bytes()))
    assert got == want and got["eos_token_id"] == 7


def test_a_model_that_does_not_generate_gets_no_generation_config():
    for arch in ("LlamaForSequenceClassification", "BertForTokenClassification", "TinyMLP"):
        assert generation_config({"architectures": [arch], "eos_token_id": 2}) is None
    assert generation_config({"architectures": ["FSDPLlamaForCausalLM"]}) is not None


def test_a_legacy_torch_dtype_config_exports_dtype(tmp_path):
    out = _export(_verl_run(tmp_path), tmp_path)
    config = json.loads((out / "config.json").read_bytes())
    assert config["dtype"] == "float32" and "torch_dtype" not in config


def test_a_sub_configs_torch_dtype_becomes_its_dtype():
    config = {"model_type": "llava", "torch_dtype": "float32",
              "text_config": {"model_type": "llama", "torch_dtype": "bfloat16"}}
    out = _config.exported_config(config, "float16")
    assert out["dtype"] == "float16" and "torch_dtype" not in out
    assert out["text_config"] == {"model_type": "llama", "dtype": "bfloat16"}


# --- fsdpckpt.save_pretrained: the same finder ------------------------------------------


def _save_pretrained(tmp_path: Path):
    """fsdpckpt.save_pretrained of a Llama whose base holds a processor and no generation
    config; the model's own generation config differs from the one its config makes."""
    transformers = pytest.importorskip("transformers")
    import fsdpckpt

    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / "tied" / name, base / name)
    _audio_processor(base).save_pretrained(base)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(base))
    model.generation_config.max_new_tokens = 5
    fsdpckpt.save_pretrained(model, tmp_path / "out", base=base)
    return base, model, tmp_path / "out"


def test_save_pretrained_copies_the_processor_from_base(tmp_path):
    transformers = pytest.importorskip("transformers")
    base, _, out = _save_pretrained(tmp_path)
    assert (out / "processor_config.json").read_bytes() == \
        (base / "processor_config.json").read_bytes()
    assert type(transformers.AutoProcessor.from_pretrained(out)).__name__ == \
        "Qwen2AudioProcessor"


def test_save_pretrained_writes_the_models_generation_config_where_base_has_none(tmp_path):
    _, model, out = _save_pretrained(tmp_path)
    assert (out / "generation_config.json").read_bytes() == \
        model.generation_config.to_json_string(use_diff=True).encode()
