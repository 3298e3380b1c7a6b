"""export-hf keeps the model class's answer after the first export of a config, so the next
export of the same run never imports transformers (issue 21; fsdpckpt/export/_expect_cache.py).

The answer (keys, shapes, ties, the names ``save_pretrained`` writes) is JSON under a key of
the exported config and the installed versions. A hit writes the same bytes as the miss did;
a file that is not exactly what the cache wrote (damaged, edited, hostile) is ignored and
replaced; another transformers is another key; custom code is never kept; a cache that
cannot be written, or is switched off, changes nothing but the time. conftest.py gives each
test its own cache folder in ``$FSDPCKPT_CACHE_DIR``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import fsdpckpt
from fsdpckpt.export import _expect_cache
from fsdpckpt.export._config import exported_config, read_config
from fsdpckpt.export._expect_cache import recall, remember
from fsdpckpt.export._model import ModelExpectation, expect_model
from fsdpckpt.export._moe import Piece

from conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
RUN = FIXTURES / "tiny_llama" / "tied"
CKPT = RUN / "checkpoint-3"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _config(**changes) -> dict:
    return exported_config({**read_config(RUN / "config.json"), **changes}, "float32")


def _kept() -> list[Path]:
    folder = Path(os.environ["FSDPCKPT_CACHE_DIR"]) / "expectations"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _cache_file() -> Path:
    found = _expect_cache._file(_config())
    assert found is not None
    return found[1]


def _export_in_a_child(out: Path, *extra: str) -> dict:
    code = (f"import sys, json, fsdpckpt\n"
            f"r = fsdpckpt.export_hf({str(CKPT)!r}, {str(out)!r}{''.join(extra)})\n"
            "print(json.dumps([r.model_class, r.tied, 'transformers' in sys.modules, "
            "'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    model_class, tied, transformers, torch = json.loads(done.stdout.splitlines()[-1])
    return {"model_class": model_class, "tied": tied, "transformers": transformers,
            "torch": torch}


def test_a_second_export_is_the_same_byte_for_byte_and_imports_neither_transformers_nor_torch(
        tmp_path):
    first = fsdpckpt.export_hf(CKPT, tmp_path / "first")
    assert first.model_class == "LlamaForCausalLM" and len(_kept()) == 1
    second = _export_in_a_child(tmp_path / "second")
    assert second == {"model_class": "LlamaForCausalLM",
                      "tied": [["lm_head.weight", "model.embed_tokens.weight"]],
                      "transformers": False, "torch": False}
    assert _files(tmp_path / "first") == _files(tmp_path / "second")
    assert not [p for p in _kept() if p.suffix != ".json"]  # no temporary file left


def test_the_dtype_is_not_in_the_key_and_untie_is(tmp_path):
    fsdpckpt.export_hf(CKPT, tmp_path / "fp32")
    assert recall(exported_config(read_config(RUN / "config.json"), "bfloat16")) is not None
    bf16 = fsdpckpt.export_hf(CKPT, tmp_path / "bf16", dtype="bf16")
    assert bf16.model_class == "LlamaForCausalLM" and len(_kept()) == 1
    untied = fsdpckpt.export_hf(CKPT, tmp_path / "untied", untie=True)
    assert untied.tied == () and len(_kept()) == 2


def test_a_hit_gives_back_exactly_what_was_kept():
    answer = ModelExpectation(
        "MixtralForCausalLM", {"a": (6, 4), "b": (4,), "c": (4,), "e": ()}, {"c": "b"},
        {"a": (Piece("a.0", "a", (0, 0), (3, 4), (3, 4), False),
               Piece("a.1", "a", (3, 0), (3, 4), (3, 4), False)),
         "b": (Piece("b", "b", (0,), (4,), (4,), True),),
         "c": (Piece("hub.c", "c", (0,), (4,), (4,), True),),
         "e": (Piece("e", "e", (), (), (), True),)})
    config = _config()
    assert remember(config, answer) is answer
    assert recall(config) == answer
    reason = ModelExpectation("X", {"a": (1,)}, {}, "transformers writes a computed from ...")
    remember(config, reason)
    assert recall(config) == reason


def test_a_real_moe_models_cut_pieces_come_back_the_same(tmp_path):
    import transformers

    transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                               num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, num_local_experts=3,
                               architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    config = read_config(tmp_path / "config.json")
    answer = expect_model(tmp_path, config)
    assert isinstance(answer, ModelExpectation) and isinstance(answer.saved, dict)
    assert any(not p.whole for pieces in answer.saved.values() for p in pieces)
    remember(config, answer)
    assert recall(config) == answer


def _valid_doc(tmp_path: Path) -> dict:
    fsdpckpt.export_hf(CKPT, tmp_path / "first")
    return json.loads(_cache_file().read_text())


def _resealed(doc: dict) -> dict:
    # As anyone who edits the file can do: the digest recomputed, so only the checks of the
    # content stand between the edit and the export.
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return {**body, "sha256": _expect_cache._digest(body)}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _shifted(piece: list) -> None:
    # The whole key as a box one row further on: the right size, past the key's end.
    piece[2][0] += 1
    piece[5] = False


def _damage(doc: dict, how: str) -> bytes | None:
    shapes = doc["shapes"]
    first = next(iter(doc["saved"]))
    edits = {
        "tied to an absent key": lambda d: d["tied"].update({"lm_head.weight": "no.such.key"}),
        "a tied target absent": lambda d: d["tied"].update({"nothing": "lm_head.weight"}),
        "a negative dimension": lambda d: shapes.update({"lm_head.weight": [-1, 64]}),
        "a dimension as text": lambda d: shapes.update({"lm_head.weight": ["103", 64]}),
        "a dimension as a bool": lambda d: shapes.update({"model.norm.weight": [True]}),
        "a float dimension": lambda d: shapes.update({"model.norm.weight": [64.0]}),
        "shapes as a list": lambda d: d.update(shapes=list(shapes.items())),
        "the class as a number": lambda d: d.update(model_class=7),
        "another format": lambda d: d.update(format=2),
        "another key": lambda d: d.update(key="0" * 64),
        "a piece out of bounds": lambda d: _shifted(d["saved"][first][0]),
        "a piece of another key": lambda d: d["saved"][first][0].__setitem__(1, "lm_head.weight"),
        "a saved key the model lacks": lambda d: d["saved"].update({"extra": d["saved"][first]}),
        "a piece nested deep": lambda d: d["saved"][first].append(json.loads(_nested(90))),
        "an extra field": lambda d: d.update(pickle="gASVAAAA"),
    }
    if how in edits:
        edits[how](doc)
        return json.dumps(_resealed(doc)).encode()
    if how == "edited, digest stale":
        shapes["lm_head.weight"] = [1, 1]
        return json.dumps(doc).encode()
    if how == "truncated":
        return json.dumps(doc).encode()[:-10]
    return {"garbage": os.urandom(4096), "empty": b"", "not UTF-8": b"\xff\xfe{}",
            "a list": b"[]", "nested past the bound": _nested(100_000).encode(),
            "a huge number": b'{"format": 1' + b"9" * 5000 + b"}"}.get(how)


_DAMAGES = ["tied to an absent key", "a tied target absent", "a negative dimension",
            "a dimension as text", "a dimension as a bool", "a float dimension",
            "shapes as a list", "the class as a number", "another format", "another key",
            "a piece out of bounds", "a piece of another key", "a saved key the model lacks",
            "a piece nested deep", "an extra field", "edited, digest stale", "truncated",
            "garbage", "empty", "not UTF-8", "a list", "nested past the bound",
            "a huge number"]


@pytest.mark.parametrize("how", _DAMAGES)
def test_a_damaged_or_hostile_file_is_ignored_and_replaced(tmp_path, how):
    doc = _valid_doc(tmp_path)
    file = _cache_file()
    damaged = _damage(json.loads(json.dumps(doc)), how)
    assert damaged is not None
    file.write_bytes(damaged)
    assert recall(_config()) is None
    again = fsdpckpt.export_hf(CKPT, tmp_path / "again")
    assert again.model_class == "LlamaForCausalLM"
    assert again.tied == (("lm_head.weight", "model.embed_tokens.weight"),)
    assert _files(tmp_path / "first") == _files(tmp_path / "again")
    assert json.loads(file.read_text()) == doc and recall(_config()) is not None


def test_a_file_over_the_bound_is_not_read(tmp_path):
    _valid_doc(tmp_path)
    file = _cache_file()
    with open(file, "r+b") as handle:  # sparse: a huge file that costs no disk
        handle.truncate(_expect_cache.MAX_BYTES + 1)
    assert recall(_config()) is None
    fsdpckpt.export_hf(CKPT, tmp_path / "again")
    assert file.stat().st_size < 2**20 and recall(_config()) is not None


def test_a_fifo_in_place_of_the_file_neither_hangs_nor_fails(tmp_path):
    _valid_doc(tmp_path)
    file = _cache_file()
    file.unlink()
    os.mkfifo(file)
    assert recall(_config()) is None
    assert fsdpckpt.export_hf(CKPT, tmp_path / "again").model_class == "LlamaForCausalLM"


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user takes root")
def test_a_file_another_user_owns_is_not_trusted(tmp_path):
    # In a shared cache folder anyone could write the answer that lets a wrong checkpoint
    # pass the key check: only the user's own files are read.
    _valid_doc(tmp_path)
    file = _cache_file()
    os.chown(file, 12345, 12345)
    assert recall(_config()) is None
    os.chown(file, 0, 0)
    assert recall(_config()) is not None


def test_another_transformers_version_misses(tmp_path, monkeypatch):
    from importlib import metadata

    fsdpckpt.export_hf(CKPT, tmp_path / "first")
    assert recall(_config()) is not None
    real = metadata.version
    monkeypatch.setattr(metadata, "version",
                        lambda name: "0.0.1" if name == "transformers" else real(name))
    assert recall(_config()) is None
    fsdpckpt.export_hf(CKPT, tmp_path / "second")
    assert len(_kept()) == 2 and recall(_config()) is not None


def test_without_transformers_installed_nothing_is_kept(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    answer = ModelExpectation("LlamaForCausalLM", {"a": (1,)}, {})
    remember(_config(), answer)
    assert _kept() == [] and recall(_config()) is None


@pytest.mark.parametrize("where", ["a file", "under a file", "expectations a file"])
def test_a_cache_that_cannot_be_written_still_exports(tmp_path, monkeypatch, where):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "expectations").write_text("not a folder")
    cache = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "cache",
             "expectations a file": tmp_path / "cache"}[where]
    monkeypatch.setenv("FSDPCKPT_CACHE_DIR", str(cache))
    result = fsdpckpt.export_hf(CKPT, tmp_path / "out")
    assert result.model_class == "LlamaForCausalLM"
    assert recall(_config()) is None


def test_a_failing_write_leaves_no_temporary_file(tmp_path):
    _cache_file().mkdir(parents=True)  # a folder where the file goes: the rename fails
    assert fsdpckpt.export_hf(CKPT, tmp_path / "out").model_class == "LlamaForCausalLM"
    assert _kept() == [_cache_file()] and recall(_config()) is None


def test_custom_code_is_never_kept_nor_read():
    config = _config(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    assert _expect_cache._key(config) is None
    remember(config, ModelExpectation("XForCausalLM", {"a": (1,)}, {}))
    assert _kept() == [] and recall(config) is None


@pytest.mark.parametrize("off", [{"FSDPCKPT_NO_CACHE": "1"}, {"FSDPCKPT_CACHE_DIR": ""}])
def test_the_off_switch_neither_reads_nor_writes(tmp_path, monkeypatch, off):
    from fsdpckpt.export import hf as hf_module

    fsdpckpt.export_hf(CKPT, tmp_path / "first")
    (file,) = _kept()
    before = file.stat().st_mtime_ns, file.read_bytes()
    for name, value in off.items():
        monkeypatch.setenv(name, value)
    assert _expect_cache.cache_dir() is None and recall(_config()) is None
    built = []
    monkeypatch.setattr(hf_module, "expect_model",
                        lambda *a, **k: built.append(1) or expect_model(*a, **k))
    monkeypatch.chdir(tmp_path)  # FSDPCKPT_CACHE_DIR="" is no cache, not the current folder
    fsdpckpt.export_hf(CKPT, tmp_path / "second")
    assert built == [1]  # the kept answer was not read
    assert (file.stat().st_mtime_ns, file.read_bytes()) == before and [file] == [
        p for p in file.parent.iterdir()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "second"]
    assert _files(tmp_path / "first") == _files(tmp_path / "second")


def test_where_the_cache_is(monkeypatch, tmp_path):
    monkeypatch.delenv("FSDPCKPT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _expect_cache.cache_dir() == tmp_path / "xdg" / "fsdpckpt"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: ignored
    assert _expect_cache.cache_dir() == tmp_path / "home" / ".cache" / "fsdpckpt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _expect_cache.cache_dir() == tmp_path / "home" / ".cache" / "fsdpckpt"
    monkeypatch.setenv("FSDPCKPT_CACHE_DIR", str(tmp_path / "mine"))
    assert _expect_cache.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("FSDPCKPT_NO_CACHE", "0")
    assert _expect_cache.cache_dir() == tmp_path / "mine"


def test_a_base_whose_weights_do_not_answer_is_answered_by_the_cache(tmp_path, monkeypatch):
    # --untie of a tied run: the base (save_pretrained of the run) has no lm_head.weight, so
    # its weights cannot stand in for the class; the first export builds it, the second not.
    import shutil

    import transformers
    from safetensors.torch import load_file

    from fsdpckpt.export import hf as hf_module

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(RUN))
    model.load_state_dict(load_file(RUN / "trained.safetensors"))
    model.save_pretrained(tmp_path / "base")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(RUN / name, tmp_path / "base")
    first = fsdpckpt.export_hf(CKPT, tmp_path / "first", base=tmp_path / "base", untie=True)
    assert first.base_weights is None and len(_kept()) == 1

    def never(*_args, **_kwargs):
        raise AssertionError("the model class was built")

    monkeypatch.setattr(hf_module, "expect_model", never)
    monkeypatch.setattr(hf_module, "start_import", never)
    second = fsdpckpt.export_hf(CKPT, tmp_path / "second", base=tmp_path / "base", untie=True)
    assert second.base_weights is None and second.model_class == first.model_class
    assert second.tied == () and _files(tmp_path / "first") == _files(tmp_path / "second")
