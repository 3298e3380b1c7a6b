"""export-hf: a sharded checkpoint to a folder ``from_pretrained`` loads as it is.

The fixture is a tiny real Llama trained by FSDP2 on 2 ranks (fixtures/tiny_llama/, tied and
untied), with the config and tokenizer where the run left them and the trained state
(``trained.safetensors``) the export must reproduce.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdpckpt import CheckpointNotFoundError, ExportMismatchError, OutputExistsError, export_hf
from fsdpckpt.cli import main
from fsdpckpt.export import hf as hf_module
from fsdpckpt.export._config import exported_config, strip_fsdp_prefix

from conftest import FIXTURES

TINY = FIXTURES / "tiny_llama"
VARIANTS = ("untied", "tied")


def _run(variant: str) -> Path:
    return TINY / variant / "checkpoint-3"


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def _exported(path: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


def _trained(variant: str) -> dict:
    from safetensors.torch import load_file

    return load_file(TINY / variant / "trained.safetensors")


def _load(path: Path, caplog: pytest.LogCaptureFixture):
    transformers = pytest.importorskip("transformers")
    with caplog.at_level(logging.WARNING, logger="transformers"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, output_loading_info=True)
    return model, info


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for variant in VARIANTS:
        export_hf(_run(variant), root / variant)
        out[variant] = root / variant
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_export_loads_without_missing_unexpected_or_newly_initialized_weights(
        exports, variant, caplog):
    _model, info = _load(exports[variant], caplog)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    text = caplog.text.lower()
    assert "newly initialized" not in text and "missing" not in text, caplog.text


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_exported_weights_are_the_trained_weights_byte_for_byte(exports, variant):
    got, want = _exported(exports[variant]), _trained(variant)
    if variant == "tied":
        want.pop("lm_head.weight")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
        assert got[key].numpy().tobytes() == \
            want[key].numpy().tobytes(), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_logits_equal_the_trained_models(exports, variant, caplog):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    loaded, _ = _load(exports[variant], caplog)
    config = transformers.AutoConfig.from_pretrained(exports[variant])
    trained = transformers.LlamaForCausalLM(config)
    trained.load_state_dict(_trained(variant))
    ids = torch.tensor([[1, 5, 9, 14, 20, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trained(ids).logits)


def test_the_tied_target_is_left_out_and_the_untied_one_written(exports):
    assert "lm_head.weight" not in _exported(exports["tied"])
    assert "lm_head.weight" in _exported(exports["untied"])


def test_a_tied_export_loads_with_the_head_tied_to_the_embeddings(exports, caplog):
    model, _ = _load(exports["tied"], caplog)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_architectures_lose_fsdp2s_class_prefix(exports):
    assert json.loads((TINY / "untied" / "config.json").read_text())["architectures"] == \
        ["FSDPLlamaForCausalLM"]
    assert json.loads((exports["untied"] / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]


def test_the_weights_are_one_model_safetensors_with_hf_header_metadata(exports):
    assert sorted(p.name for p in exports["untied"].glob("*.safetensors")) == \
        ["model.safetensors"]
    assert not (exports["untied"] / "model.safetensors.index.json").exists()
    assert _header(exports["untied"] / "model.safetensors")["__metadata__"] == {"format": "pt"}


def test_the_tokenizer_generation_config_and_chat_template_are_copied(exports):
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (exports["tied"] / name).read_bytes() == (TINY / "tied" / name).read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exports["tied"])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert chat == "user: hello\n"


def test_the_export_generates_tokens(exports, caplog):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, _ = _load(exports["untied"], caplog)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exports["untied"])
    inputs = tokenizer("hello world", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_a_bf16_export_is_the_exact_cast_and_the_config_says_bfloat16(tmp_path, caplog):
    torch = pytest.importorskip("torch")
    result = export_hf(_run("tied"), tmp_path / "out", dtype="bf16")
    assert result.dtype == "bfloat16"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config
    got, want = _exported(tmp_path / "out"), _trained("tied")
    for key, value in got.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value.view(torch.int16), want[key].to(torch.bfloat16).view(torch.int16))
    model, _ = _load(tmp_path / "out", caplog)
    assert model.dtype == torch.bfloat16


def test_a_small_max_shard_size_writes_indexed_shards_that_load(tmp_path, caplog):
    result = export_hf(_run("untied"), tmp_path / "out", max_shard_size="100KB")
    names = sorted(p.name for p in (tmp_path / "out").glob("model*"))
    assert len(result.weights) > 2 and "model.safetensors.index.json" in names
    assert "model-00001-of-" in names[0]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_trained("untied"))
    for shard in set(index["weight_map"].values()):
        assert _header(tmp_path / "out" / shard)["__metadata__"] == {"format": "pt"}
    _model, info = _load(tmp_path / "out", caplog)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_model_dcp_folder_itself_finds_the_runs_files(tmp_path):
    result = export_hf(_run("untied") / "pytorch_model_fsdp_0", tmp_path / "out")
    assert result.config_from == TINY / "untied" / "config.json"


def _copy_run(tmp_path: Path, variant: str = "untied") -> Path:
    run = tmp_path / "run"
    shutil.copytree(TINY / variant, run)
    return run


def test_verls_huggingface_subfolder_is_found(tmp_path):
    run = _copy_run(tmp_path)
    hf = run / "checkpoint-3" / "huggingface"
    hf.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (run / name).rename(hf / name)
    result = export_hf(run / "checkpoint-3", tmp_path / "out")
    assert result.config_from == hf / "config.json"
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_base_gives_the_config_and_tokenizer(tmp_path):
    run = _copy_run(tmp_path)
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (run / name).rename(base / name)
    result = export_hf(run / "checkpoint-3", tmp_path / "out", base=base)
    assert result.config_from == base / "config.json"
    assert not (tmp_path / "out" / "chat_template.jinja").exists()  # not in base


def test_no_config_is_an_error_naming_where_it_looked(tmp_path):
    run = _copy_run(tmp_path)
    (run / "config.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"no config\.json.*looked in .*run.*--base"):
        export_hf(run / "checkpoint-3", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _without_tokenizer(tmp_path):
    run = _copy_run(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (run / name).unlink()
    return run


def test_a_run_without_a_tokenizer_exports_without_one_and_says_so(tmp_path):
    run = _without_tokenizer(tmp_path)
    result = export_hf(run / "checkpoint-3", tmp_path / "out")
    assert not any("tokenizer" in p.name for p in (tmp_path / "out").iterdir())
    assert result.no_tokenizer.startswith("no tokenizer (tokenizer.json, tokenizer_config.json "
                                          "or tokenizer.model) in ")
    assert str(run) in result.no_tokenizer and "pass --base" in result.no_tokenizer
    assert result.to_json()["no_tokenizer"] == result.no_tokenizer
    transformers = pytest.importorskip("transformers")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_an_export_with_a_tokenizer_says_nothing_of_it(tmp_path):
    result = export_hf(_copy_run(tmp_path) / "checkpoint-3", tmp_path / "out")
    assert result.no_tokenizer is None and (tmp_path / "out" / "tokenizer.json").is_file()


def test_the_command_says_in_one_line_that_the_export_has_no_tokenizer(tmp_path):
    run = _without_tokenizer(tmp_path)
    result = CliRunner().invoke(main, ["export-hf", str(run / "checkpoint-3"),
                                       str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "tokenizer" in line]
    assert len(said) == 1 and "the export has none" in said[0] and "--base" in said[0]


def test_a_config_of_another_model_is_refused_before_anything_is_written(tmp_path):
    pytest.importorskip("transformers")
    run = _copy_run(tmp_path)
    config = json.loads((run / "config.json").read_text())
    config.update(num_hidden_layers=3, intermediate_size=96)
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportMismatchError, match=r"missing \(model\.layers\.2\..*wrong shape"):
        export_hf(run / "checkpoint-3", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_without_transformers_tied_keys_follow_the_config(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_module, "expect_model", lambda *_a, **_k: "no transformers")
    result = export_hf(_run("tied"), tmp_path / "out")
    assert result.model_class is None
    assert result.tied == (("lm_head.weight", "model.embed_tokens.weight"),)
    assert "lm_head.weight" not in _exported(tmp_path / "out")


def test_an_earlier_export_is_kept_unless_overwrite(tmp_path):
    export_hf(_run("untied"), tmp_path / "out")
    before = (tmp_path / "out" / "config.json").read_bytes()
    with pytest.raises(OutputExistsError, match="--overwrite"):
        export_hf(_run("untied"), tmp_path / "out", dtype="bf16")
    assert (tmp_path / "out" / "config.json").read_bytes() == before
    export_hf(_run("untied"), tmp_path / "out", dtype="bf16", overwrite=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_cli_prints_a_json_report(tmp_path):
    result = CliRunner().invoke(main, ["export-hf", str(_run("tied")), str(tmp_path / "out"),
                                       "--dtype", "fp16", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["dtype"] == "float16" and report["tied"] == {
        "lm_head.weight": "model.embed_tokens.weight"}
    assert report["weights"] == [str(tmp_path / "out" / "model.safetensors")]


def test_the_cli_error_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["export-hf", str(FIXTURES / "dtensor"),
                                       str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.output.startswith("fsdpckpt: error: no config.json found")


@pytest.mark.parametrize("name, want", [("FSDPQwen2ForCausalLM", "Qwen2ForCausalLM"),
                                        ("LlamaForCausalLM", "LlamaForCausalLM"),
                                        ("FSDPmodel", "FSDPmodel")])
def test_strip_fsdp_prefix(name, want):
    assert strip_fsdp_prefix(name) == want


@pytest.mark.parametrize("fields", [{"torch_dtype": "float32"}, {"dtype": "float32"},
                                    {"dtype": "x", "torch_dtype": "x"}, {}])
def test_the_config_dtype_field_is_transformers_5s_dtype(fields):
    out = exported_config({"model_type": "llama", **fields}, "bfloat16")
    assert {k for k in out if "dtype" in k} == {"dtype"}
    assert out["dtype"] == "bfloat16"


def _tied_config_on_untied_weights(tmp_path: Path) -> Path:
    # A run whose config ties the embeddings but whose checkpoint holds two different ones.
    run = _copy_run(tmp_path, "untied")
    config = json.loads((run / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (run / "config.json").write_text(json.dumps(config))
    return run


def test_a_tied_target_with_other_bytes_is_refused_before_anything_is_written(tmp_path):
    run = _tied_config_on_untied_weights(tmp_path)
    with pytest.raises(ExportMismatchError,
                       match=r"lm_head\.weight and model\.embed_tokens\.weight differ.*--untie"):
        export_hf(run / "checkpoint-3", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_refusal_is_one_cli_line_naming_both_keys(tmp_path):
    run = _tied_config_on_untied_weights(tmp_path)
    result = CliRunner().invoke(main, ["export-hf", str(run / "checkpoint-3"),
                                       str(tmp_path / "out")])
    assert result.exit_code == 1 and len(result.output.splitlines()) == 1
    assert "lm_head.weight and model.embed_tokens.weight differ" in result.output


def test_untie_writes_both_and_the_untied_export_loads_with_the_trained_logits(tmp_path,
                                                                              caplog):
    torch = pytest.importorskip("torch")
    run = _tied_config_on_untied_weights(tmp_path)
    result = CliRunner().invoke(main, ["export-hf", str(run / "checkpoint-3"),
                                       str(tmp_path / "out"), "--untie", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tied"] == {}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    got, want = _exported(tmp_path / "out"), _trained("untied")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    model, info = _load(tmp_path / "out", caplog)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, want["lm_head.weight"])


def test_without_transformers_a_differing_tied_target_is_refused_too(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_module, "expect_model", lambda *_a, **_k: "no transformers")
    run = _tied_config_on_untied_weights(tmp_path)
    with pytest.raises(ExportMismatchError, match="differ"):
        export_hf(run / "checkpoint-3", tmp_path / "out")


@pytest.mark.parametrize("variant, equal", [("tied", True), ("untied", False)])
def test_same_bytes_reads_in_small_boxes_and_tells_equal_from_different(variant, equal):
    from fsdpckpt.dcp._datafiles import DataFiles
    from fsdpckpt.dcp.reader import read_dcp_folder
    from fsdpckpt.export._tied import same_bytes

    folder = read_dcp_folder(_run(variant) / "pytorch_model_fsdp_0")
    entries = {t.name.split(".", 1)[1]: t for t in folder.metadata.tensors}
    files = DataFiles(folder.path)
    try:
        assert same_bytes(files, entries["lm_head.weight"], entries["model.embed_tokens.weight"],
                          box_bytes=100) is equal
        assert same_bytes(files, entries["lm_head.weight"], entries["lm_head.weight"],
                          box_bytes=100)
        assert not same_bytes(files, entries["lm_head.weight"],
                              entries["model.norm.weight"])  # another shape
    finally:
        files.close()


_CONFIGURATION = "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n" \
                 "    pass\n"
_MODELING = "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom import " \
            "CustomConfig  # noqa: F401\n\n\nclass CustomForCausalLM(LlamaForCausalLM):\n" \
            "    config_class = CustomConfig\n"


def _custom_code_run(tmp_path: Path) -> Path:
    # A trust_remote_code model: the config's auto_map names modules beside it.
    run = _copy_run(tmp_path)
    (run / "configuration_custom.py").write_text(_CONFIGURATION)
    (run / "modeling_custom.py").write_text(_MODELING)
    (run / "unrelated.py").write_text("raise SystemExit\n")
    config = json.loads((run / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig",
                          "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (run / "config.json").write_text(json.dumps(config))
    return run


def test_custom_code_auto_map_needs_is_copied_and_loads_with_trust_remote_code(tmp_path):
    transformers = pytest.importorskip("transformers")
    run = _custom_code_run(tmp_path)
    export_hf(run / "checkpoint-3", tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "modeling_custom.py").read_text() == _MODELING
    assert (out / "configuration_custom.py").read_text() == _CONFIGURATION  # imported by it
    assert not (out / "unrelated.py").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(model).__name__ == "CustomForCausalLM"


def test_a_custom_code_file_auto_map_needs_but_missing_is_an_error(tmp_path):
    run = _custom_code_run(tmp_path)
    (run / "configuration_custom.py").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"configuration_custom\.py.*--base"):
        export_hf(run / "checkpoint-3", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module", ["../../etc/passwd", "/abs/path", "a b"])
def test_an_auto_map_module_that_is_no_module_name_is_refused(tmp_path, module):
    from fsdpckpt import NotACheckpointError

    run = _copy_run(tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["auto_map"] = {"AutoModel": f"{module}.Cls"}
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotACheckpointError, match="auto_map"):
        export_hf(run / "checkpoint-3", tmp_path / "out")


def test_auto_map_code_from_another_repo_is_left_to_the_hub(tmp_path):
    run = _copy_run(tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "org/repo--configuration_x.XConfig"}
    (run / "config.json").write_text(json.dumps(config))
    export_hf(run / "checkpoint-3", tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.py"))


def test_additional_chat_templates_are_copied(tmp_path):
    run = _copy_run(tmp_path)
    (run / "additional_chat_templates").mkdir()
    (run / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    export_hf(run / "checkpoint-3", tmp_path / "out")
    assert (tmp_path / "out" / "additional_chat_templates" / "tool_use.jinja").read_text() \
        == "{{ tools }}"


@pytest.mark.parametrize("link", ["tokenizer.json", "modeling_custom.py",
                                  "additional_chat_templates/tool_use.jinja",
                                  "additional_chat_templates"])
def test_a_side_file_symlinked_out_of_its_folder_is_refused(tmp_path, link):
    from fsdpckpt import NotACheckpointError

    run = _custom_code_run(tmp_path)
    (run / "additional_chat_templates").mkdir()
    (run / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    outside = tmp_path / "elsewhere"
    shutil.move(run / link, outside)
    (run / link).symlink_to(outside)
    with pytest.raises(NotACheckpointError, match="symlink.*outside"):
        export_hf(run / "checkpoint-3", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_hub_cache_snapshot_linking_to_its_blobs_is_a_base(tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(("config.json", "tokenizer.json", "tokenizer_config.json")):
        shutil.copy(TINY / "untied" / name, blobs / f"blob{i}")
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    export_hf(_run("untied"), tmp_path / "out", base=snapshot)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == \
        (TINY / "untied" / "tokenizer.json").read_bytes()
