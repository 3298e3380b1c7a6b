"""export-hf never runs code from a checkpoint, a --base folder or an adapter folder.

A config whose ``auto_map`` names custom code (``modeling_x.XForCausalLM``, or
``<folder>--modeling_x.XForCausalLM`` by path) can only be built by running that code.
Each ``.py`` file below writes a marker file when it is imported; without
``--trust-remote-code`` no marker may ever appear, whatever stdin holds, and the export
still succeeds: the code files copied, the keys checked against the base's own weights,
and one line saying what was not checked. With ``--trust-remote-code`` the code runs, as
documented. The config's declared layer and expert counts are bounded by the checkpoint's
keys before the class is built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdpckpt import ExportMismatchError, export_hf
from fsdpckpt.export import hf as hf_module
from fsdpckpt.export._keycheck import check_declared_sizes, numbered_siblings

from conftest import FIXTURES, ROOT, run_cli, upload

TINY = FIXTURES / "tiny_llama" / "untied"

_CONFIGURATION = ("from transformers import LlamaConfig\n\n\nclass XConfig(LlamaConfig):\n"
                  "    model_type = 'xmodel'\n")
_MODELING = ("from transformers import LlamaForCausalLM\n\nfrom .configuration_x import XConfig"
             "\n\n\nclass XForCausalLM(LlamaForCausalLM):\n    config_class = XConfig\n")


def _ran(markers: Path) -> list[str]:
    return sorted(p.name for p in markers.glob("*.ran"))


def _add_custom_code(folder: Path, markers: Path, *, by_path: bool = False) -> None:
    """Make ``folder``'s config a custom-code model whose modules leave a marker when run."""
    markers.mkdir(exist_ok=True)
    for module, body in (("configuration_x", _CONFIGURATION), ("modeling_x", _MODELING)):
        mark = f"import pathlib\npathlib.Path({str(markers / module)!r} + '.ran').touch()\n"
        (folder / f"{module}.py").write_text(mark + body)
    config = json.loads((folder / "config.json").read_text())
    prefix = f"{folder}--" if by_path else ""
    config.update(model_type="xmodel", architectures=["XForCausalLM"],
                  auto_map={"AutoConfig": f"{prefix}configuration_x.XConfig",
                            "AutoModelForCausalLM": f"{prefix}modeling_x.XForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(TINY, run)
    return run


def _base(tmp_path: Path, markers: Path) -> Path:
    """A Hugging Face model folder with custom code and the run's weights."""
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, base / name)
    shutil.copy(TINY / "trained.safetensors", base / "model.safetensors")
    _add_custom_code(base, markers)
    return base


def _cli(tmp_path: Path, *args: object, stdin: bytes | None) -> subprocess.CompletedProcess:
    # A real process: its stdin is closed (None) or holds what a user might type.
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "fsdpckpt", "export-hf",
                           *(str(a) for a in args)],
                          input=stdin, stdin=subprocess.DEVNULL if stdin is None else None,
                          capture_output=True, env=env, timeout=300)


@pytest.mark.parametrize("stdin", [None, b"y\n"], ids=["stdin-closed", "stdin-yes"])
@pytest.mark.parametrize("where", ["checkpoint-folder-by-path", "base-folder"])
def test_custom_code_never_runs_and_nothing_asks_whatever_stdin_holds(tmp_path, stdin, where):
    pytest.importorskip("transformers")
    markers = tmp_path / "markers"
    run = _run(tmp_path)
    extra: list[object] = []
    if where == "base-folder":
        extra = ["--base", _base(tmp_path, markers)]
    else:
        _add_custom_code(run, markers, by_path=True)
    done = _cli(tmp_path, run / "checkpoint-3", tmp_path / "out", *extra, stdin=stdin)
    out = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0, out
    assert _ran(markers) == []
    assert "[y/N]" not in out and "Traceback" not in out
    assert "not checked: " in out and "--trust-remote-code" in out
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_with_trust_remote_code_the_code_runs_and_the_keys_are_checked_against_it(tmp_path):
    pytest.importorskip("transformers")
    markers = tmp_path / "markers"
    base = _base(tmp_path, markers)
    done = _cli(tmp_path, _run(tmp_path) / "checkpoint-3", tmp_path / "out", "--base", base,
                "--trust-remote-code", stdin=None)
    assert done.returncode == 0, done.stderr.decode()
    assert _ran(markers) == ["configuration_x.ran", "modeling_x.ran"]  # as documented
    assert "keys and shapes match XForCausalLM" in done.stdout.decode()
    assert "not checked" not in done.stdout.decode()


def test_the_code_files_are_copied_so_the_user_can_load_them_later(tmp_path):
    markers = tmp_path / "markers"
    run = _run(tmp_path)
    _add_custom_code(run, markers)
    result = export_hf(run / "checkpoint-3", tmp_path / "out")
    assert _ran(markers) == []
    for module in ("configuration_x.py", "modeling_x.py"):
        assert (tmp_path / "out" / module).read_bytes() == (run / module).read_bytes()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"] == \
        json.loads((run / "config.json").read_text())["auto_map"]
    assert result.model_class is None


def test_without_a_base_the_result_says_the_keys_were_not_checked(tmp_path):
    markers = tmp_path / "markers"
    run = _run(tmp_path)
    _add_custom_code(run, markers)
    result = export_hf(run / "checkpoint-3", tmp_path / "out")
    assert result.not_checked is not None
    assert result.not_checked.startswith("keys and shapes (config.json's auto_map names "
                                         "custom code (configuration_x.XConfig")
    assert "--trust-remote-code" in result.not_checked and "--base" in result.not_checked
    assert result.to_json()["not_checked"] == result.not_checked


def test_with_a_base_the_keys_are_checked_against_its_weights(tmp_path):
    markers = tmp_path / "markers"
    base = _base(tmp_path, markers)
    result = export_hf(_run(tmp_path) / "checkpoint-3", tmp_path / "out", base=base)
    assert result.not_checked is not None
    assert f"keys and shapes were checked against {base / 'model.safetensors'}" in \
        result.not_checked
    assert _ran(markers) == []


def test_the_json_report_has_the_not_checked_line(tmp_path):
    markers = tmp_path / "markers"
    base = _base(tmp_path, markers)
    result = run_cli("export-hf", _run(tmp_path) / "checkpoint-3", tmp_path / "out",
                     "--base", base, "--json", "-q")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["checked_against"] is None and "auto_map" in doc["not_checked"]
    assert _ran(markers) == []


def _save_weights(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


@pytest.mark.parametrize("change", ["renamed", "reshaped"])
def test_a_checkpoint_that_does_not_match_the_bases_weights_is_refused(tmp_path, change):
    import torch
    from safetensors.torch import load_file

    markers = tmp_path / "markers"
    base = _base(tmp_path, markers)
    weights = load_file(base / "model.safetensors")
    if change == "renamed":
        weights["model.norm.scale"] = weights.pop("model.norm.weight")
    else:
        weights["model.norm.weight"] = torch.zeros(3)
    _save_weights(base / "model.safetensors", weights)
    with pytest.raises(ExportMismatchError, match=r"base's weights .*model\.norm\.") as caught:
        export_hf(_run(tmp_path) / "checkpoint-3", tmp_path / "out", base=base)
    assert "missing" in str(caught.value) if change == "renamed" else \
        "wrong shape" in str(caught.value)
    assert not (tmp_path / "out").exists() and _ran(markers) == []


def test_a_bases_shard_index_names_are_checked_when_its_shards_are_absent(tmp_path):
    from safetensors.torch import load_file

    markers = tmp_path / "markers"
    base = _base(tmp_path, markers)
    (base / "model.safetensors").unlink()
    checkpoint = _run(tmp_path) / "checkpoint-3"
    weight_map = {n: "model-00001-of-00002.safetensors"
                  for n in load_file(TINY / "trained.safetensors")}
    del weight_map["model.norm.weight"]
    (base / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ExportMismatchError, match=r"1 unexpected \(model\.norm\.weight\)"):
        export_hf(checkpoint, tmp_path / "out", base=base)
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (base / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    result = export_hf(checkpoint, tmp_path / "out", base=base)
    assert result.not_checked is not None
    assert "the keys were checked against" in result.not_checked


@pytest.mark.s3
def test_a_remote_bases_safetensors_headers_are_read_for_the_key_check(s3, tmp_path):
    server, root = s3
    markers = tmp_path / "markers"
    url = upload(server, _base(tmp_path, markers), f"s3://{root}/base")
    result = export_hf(_run(tmp_path) / "checkpoint-3", tmp_path / "out", base=url,
                       storage_options=server.options)
    assert result.not_checked is not None
    assert f"keys and shapes were checked against {url}/model.safetensors" in result.not_checked
    assert _ran(markers) == []


def test_a_model_type_transformers_does_not_know_is_exported_unchecked(tmp_path):
    pytest.importorskip("transformers")
    run = _run(tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["model_type"] = "nobody-knows-this-model"
    (run / "config.json").write_text(json.dumps(config))
    result = export_hf(run / "checkpoint-3", tmp_path / "out")
    assert result.not_checked is not None
    assert "'nobody-knows-this-model' is not one transformers" in result.not_checked


def _never_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model class was built")

    monkeypatch.setattr(hf_module, "expect_model", build)


@pytest.mark.parametrize("field, where", [("num_hidden_layers", ""),
                                          ("num_local_experts", ""),
                                          ("num_hidden_layers", "text_config.")])
def test_a_declared_count_far_beyond_the_keys_is_refused_before_building(
        tmp_path, monkeypatch, field, where):
    run = _run(tmp_path)
    config = json.loads((run / "config.json").read_text())
    if where:
        config["text_config"] = {"model_type": "llama", field: 100000}
    else:
        config[field] = 100000
    (run / "config.json").write_text(json.dumps(config))
    _never_built(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(ExportMismatchError) as caught:
        export_hf(run / "checkpoint-3", tmp_path / "out")
    assert time.perf_counter() - start < 3
    message = str(caught.value)
    assert message.startswith(f"{run / 'config.json'}: {where}{field} is 100000, but the "
                              "checkpoint's keys show 2 numbered")
    assert "\n" not in message and not (tmp_path / "out").exists()


def test_trusted_custom_code_is_bounded_too_before_it_runs(tmp_path):
    markers = tmp_path / "markers"
    run = _run(tmp_path)
    _add_custom_code(run, markers)
    config = json.loads((run / "config.json").read_text())
    config["num_hidden_layers"] = 100000
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportMismatchError, match="num_hidden_layers is 100000"):
        export_hf(run / "checkpoint-3", tmp_path / "out", trust_remote_code=True)
    assert _ran(markers) == []


def test_the_cli_refuses_a_huge_layer_count_in_one_line(tmp_path, monkeypatch):
    run = _run(tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["num_hidden_layers"] = 100000
    (run / "config.json").write_text(json.dumps(config))
    _never_built(monkeypatch)
    result = run_cli("export-hf", run / "checkpoint-3", tmp_path / "out")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "num_hidden_layers is 100000" in result.stderr


def test_numbered_siblings_counts_the_most_indices_under_one_prefix():
    shapes = {f"model.layers.{i}.mlp.experts.{e}.w": (1,) for i in range(3) for e in range(5)}
    shapes["model.embed_tokens.weight"] = (4, 2)
    assert numbered_siblings(shapes) == 5


def test_fused_experts_count_by_their_leading_dimension(tmp_path):
    shapes = {f"model.layers.{i}.mlp.experts.gate_up_proj": (64, 8, 4) for i in range(2)}
    check_declared_sizes({"num_experts": 64, "num_hidden_layers": 2}, shapes,
                         tmp_path / "config.json")
    with pytest.raises(ExportMismatchError, match=r"num_experts is 1000, .* show 64 numbered"):
        check_declared_sizes({"num_experts": 1000}, shapes, tmp_path / "config.json")


def test_a_declared_count_within_the_bound_is_accepted(tmp_path):
    shapes = {f"model.layers.{i}.w": (1,) for i in range(16)}  # one pipeline stage's half
    check_declared_sizes({"num_hidden_layers": 32}, shapes, tmp_path / "config.json")


def test_a_lora_adapter_folders_code_never_runs(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import torch
    import torch.distributed.checkpoint as dcp

    markers = tmp_path / "markers"
    markers.mkdir()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = tmp_path / "base"
    transformers.LlamaForCausalLM(config).save_pretrained(str(base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, base / name)
    _add_custom_code(base, markers)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj"]))
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    model.peft_config["default"].save_pretrained(str(ckpt))
    adapter = json.loads((ckpt / "adapter_config.json").read_text())
    adapter["auto_mapping"] = {"base_model_class": "XForCausalLM", "parent_library": "modeling_x"}
    (ckpt / "adapter_config.json").write_text(json.dumps(adapter))
    shutil.copy(base / "modeling_x.py", ckpt / "modeling_x.py")
    fused = export_hf(ckpt, tmp_path / "fused", base=base, lora="fuse")
    export_hf(ckpt, tmp_path / "adapter", base=base, lora="adapter")
    assert _ran(markers) == []
    assert fused.not_checked is not None and "checked against" in fused.not_checked
