"""export-hf checks the keys against the base's own weights when they answer for the model
class, and then never imports transformers (issue 21: export-hf at the merge's speed).

A base written by ``save_pretrained`` holds the names and shapes its class writes, tied
targets left out. When the exported config is that base's own and the checkpoint's names and
shapes are exactly those, the class has nothing to add: the export is the same, byte for
byte, as the one that builds the class. Anything else (other names, other shapes, a config
from elsewhere, weights that give no shapes) builds the class as before.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import fsdpckpt

from conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent


def _base(run: Path, out: Path, *, shard: str | None = None) -> Path:
    """``save_pretrained`` of the run's trained weights, with the run's tokenizer."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(run)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(load_file(run / "trained.safetensors"))
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(run / name, out)
    return out


@pytest.fixture(scope="module", params=["tied", "untied"])
def run(request) -> Path:
    return FIXTURES / "tiny_llama" / request.param


@pytest.fixture(scope="module")
def base(run, tmp_path_factory) -> Path:
    return _base(run, tmp_path_factory.mktemp("base") / "base")


def _config_only(base: Path, out: Path) -> Path:
    """The same base without its weights: the class must be built."""
    out.mkdir()
    for file in base.iterdir():
        if not file.name.startswith("model"):
            shutil.copy(file, out)
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_the_bases_weights_answer_and_the_export_is_the_same_byte_for_byte(run, base, tmp_path):
    quick = fsdpckpt.export_hf(run / "checkpoint-3", tmp_path / "quick", base=base)
    built = fsdpckpt.export_hf(run / "checkpoint-3", tmp_path / "built",
                               base=_config_only(base, tmp_path / "config_only"))
    assert quick.base_weights == base / "model.safetensors" and built.base_weights is None
    assert quick.model_class == built.model_class == "LlamaForCausalLM"
    assert quick.tied == built.tied and quick.not_checked is None
    assert _files(tmp_path / "quick") == _files(tmp_path / "built")


def test_transformers_is_never_imported_when_the_base_answers(run, base, tmp_path):
    code = (f"import sys, json, fsdpckpt\n"
            f"r = fsdpckpt.export_hf({str(run / 'checkpoint-3')!r}, {str(tmp_path / 'o')!r}, "
            f"base={str(base)!r})\n"
            "print(json.dumps([r.base_weights is not None, 'transformers' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == [True, False]


def test_a_sharded_bases_index_answers_too(run, tmp_path):
    base = _base(run, tmp_path / "base", shard="20KB")
    assert (base / "model.safetensors.index.json").is_file()
    result = fsdpckpt.export_hf(run / "checkpoint-3", tmp_path / "out", base=base)
    assert result.base_weights == base / "model.safetensors.index.json"


def test_a_base_of_another_shape_builds_the_class_which_refuses(run, tmp_path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(run)
    config.intermediate_size *= 2
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    shutil.copy(run / "tokenizer.json", tmp_path / "base")
    with pytest.raises(fsdpckpt.ExportMismatchError, match="LlamaForCausalLM"):
        fsdpckpt.export_hf(run / "checkpoint-3", tmp_path / "out", base=tmp_path / "base")


def test_a_config_other_than_the_bases_builds_the_class(run, base, tmp_path):
    # The config export-hf takes is the run's own (beside the checkpoint); the base's weights
    # describe another config, so they cannot stand in for this one's class.
    ckpt = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(run / "checkpoint-3", ckpt)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(run / name, tmp_path / "run")
    result = fsdpckpt.export_hf(ckpt, tmp_path / "out")
    assert result.base_weights is None and result.model_class == "LlamaForCausalLM"


def test_the_json_says_which_weights_answered(run, base, tmp_path):
    from conftest import run_cli

    out = run_cli("export-hf", run / "checkpoint-3", tmp_path / "out", "--base", base, "--json")
    doc = json.loads(out.stdout)
    assert doc["base_weights"] == str(base / "model.safetensors")
    assert doc["checked_against"] == "LlamaForCausalLM"
