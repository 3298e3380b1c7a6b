"""Errors and messages at the right layer (issue 18 §6).

The library raises its own errors, each also the builtin it resembles, and its messages name
its parameters (``overwrite=True``); the command line's one error boundary says the flags
(``--overwrite``). Every result type turns itself into the JSON ``--json`` prints.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import fsdpckpt
from fsdpckpt._cli_common import as_flags
from fsdpckpt.errors import MergePlanError, OptionError, OutputExistsError

from conftest import DCP_FOLDERS, FIXTURES, assert_one_line_error
from conftest import run_cli as run

PACKAGE = Path(fsdpckpt.__path__[0])

#: Modules whose ``raise ValueError`` is an internal signal, caught a few lines up the stack
#: and raised again as an fsdpckpt error naming the file (or, for ``rawio``, Python's own
#: file protocol; for ``batched``, a caller inside fsdpckpt handing it pieces outside their
#: buffer, a bug no input reaches, refused before the kernel writes there). Nothing else
#: raises a bare ``ValueError``.
INTERNAL_VALUE_ERRORS = {"_io/jsonio.py", "_io/rawio.py", "dcp/_zstd.py",
                         "merging/_convert_source.py", "merging/to_dcp.py",
                         "merging/_distributed.py", "export/_config.py", "_io/batched.py"}


# --- no bare ValueError for user input ----------------------------------------------------

def _bare_value_errors() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and getattr(node.exc.func, "id", None) == "ValueError":
                found.add(path.relative_to(PACKAGE).as_posix())
    return found


def test_only_internal_signals_are_bare_value_errors():
    assert _bare_value_errors() <= INTERNAL_VALUE_ERRORS


def test_an_option_error_is_an_fsdpckpt_error_and_a_value_error():
    assert issubclass(OptionError, fsdpckpt.FsdpCkptError)
    assert issubclass(OptionError, ValueError)
    assert issubclass(fsdpckpt.DiffOptionError, OptionError)


def test_a_manager_keeping_no_checkpoint_is_an_option_error(tmp_path):
    with pytest.raises(OptionError, match="keep_last must be at least 1"):
        fsdpckpt.CheckpointManager(tmp_path / "run", keep_last=0)


def test_an_unknown_format_is_an_option_error():
    from fsdpckpt.formats import get_format

    with pytest.raises(OptionError, match="unknown format 'zip'"):
        get_format("zip")


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"digest": "md5"}, "unknown digest 'md5'"),
    ({"digest": "sha256", "manifest": False}, "needs manifest=True"),
    ({"optimizer": object()}, "an optimizer needs its model: pass model="),
], ids=["unknown-digest", "digest-without-manifest", "optimizer-without-model"])
def test_a_save_with_options_that_cannot_be_used_is_an_option_error(tmp_path, kwargs, says):
    with pytest.raises(OptionError, match=says):
        fsdpckpt.save_state(tmp_path / "ckpt", **kwargs)


# --- the library names parameters, the command line flags ----------------------------------

def test_the_command_line_says_the_flag_for_an_existing_merge_output(tmp_path):
    fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path)
    result = run("merge", DCP_FOLDERS["dtensor"], tmp_path)
    assert_one_line_error(result, "already exists", "pass --overwrite")
    assert "overwrite=True" not in result.stderr


def test_the_library_says_the_parameter_for_an_existing_convert_output(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExistsError) as caught:
        fsdpckpt.convert(_merged(tmp_path), tmp_path / "out")
    assert "overwrite=True" in str(caught.value) and "--overwrite" not in str(caught.value)


def test_the_command_line_says_the_flag_for_an_existing_convert_output(tmp_path):
    (tmp_path / "out").mkdir()
    result = run("convert", _merged(tmp_path), tmp_path / "out")
    assert_one_line_error(result, "already exists", "pass --overwrite")
    assert "overwrite=True" not in result.stderr


def test_a_file_name_for_two_parts_names_the_parameter_not_a_flag(tmp_path):
    with pytest.raises(MergePlanError, match="both write merged.safetensors; leave out "
                                             "file_name=") as caught:
        fsdpckpt.merge(FIXTURES / "fsdp2_accelerate", tmp_path, optimizer=True,
                       file_name="merged.safetensors")
    assert "--file-name" not in str(caught.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("library", "command_line"), [
    ("a: already exists; pass overwrite=True to replace it",
     "a: already exists; pass --overwrite to replace it"),
    ("a: already exists; pass overwrite=True (--overwrite) to replace it",
     "a: already exists; pass --overwrite to replace it"),
    ("tensor 'x': safetensors has no float8 type; use format='bin'",
     "tensor 'x': safetensors has no float8 type; use --format bin"),
    ("x: two entries would both be named 'w'; pass keep_keys=True",
     "x: two entries would both be named 'w'; pass --keep-keys"),
    ("x: not a model's weights; merge the model weights only (leave out optimizer=True)",
     "x: not a model's weights; merge the model weights only (leave out --optimizer)"),
    ("x: no config.json; pass base= with the model folder the run started from",
     "x: no config.json; pass --base with the model folder the run started from"),
    ("x: no adapter config; pass the one the run's PEFT model wrote as lora_config=",
     "x: no adapter config; pass the one the run's PEFT model wrote as --lora-config"),
    ("s3://b/x: no answer; check the endpoint (endpoint_url in storage_options=)",
     "s3://b/x: no answer; check the endpoint (endpoint_url in --storage-options)"),
    ("a message without parameters", "a message without parameters"),
], ids=["parameter", "parameter-and-flag", "format", "keep-keys", "optimizer", "base",
        "lora-config", "storage-options", "none"])
def test_the_command_line_turns_parameters_into_flags(library, command_line):
    assert as_flags(library) == command_line


def _merged(tmp_path: Path) -> Path:
    return fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path / "merged")[0].path


# --- every result type has to_json(), and --json prints it -----------------------------------

RESULT_TYPES = ["MergeResult", "ConvertResult", "ExportResult", "LoadResult", "InspectReport",
                "VerifyReport", "DiffReport"]


@pytest.mark.parametrize("name", RESULT_TYPES)
def test_every_result_type_has_to_json(name):
    assert callable(getattr(getattr(fsdpckpt, name), "to_json", None))


def test_the_adapter_export_has_to_json():
    from fsdpckpt.export.lora import AdapterExport

    result = AdapterExport(Path("out"), ("adapter_model.safetensors", "adapter_config.json"),
                           4, "default", 2)
    assert json.dumps(result.to_json(), indent=2) == json.dumps(
        {"output": "out", "files": ["adapter_model.safetensors", "adapter_config.json"],
         "tensors": 4, "adapter": "default", "modules": 2}, indent=2)


def test_a_load_result_has_to_json():
    result = fsdpckpt.LoadResult(7, ("model", "rng"), ("the RNG was not restored",))
    assert result.to_json() == {"step": 7, "restored": ["model", "rng"],
                                "warnings": ["the RNG was not restored"]}


def test_merge_json_is_each_result_to_json(tmp_path):
    result = run("merge", FIXTURES / "fsdp2_accelerate", tmp_path, "--optimizer", "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    results = fsdpckpt.merge(FIXTURES / "fsdp2_accelerate", tmp_path, optimizer=True,
                             overwrite=True)
    for got, r in zip(printed["outputs"], results, strict=True):
        assert got.pop("seconds") >= 0
        want = r.to_json()
        del want["seconds"]
        assert got == want
        # as the command line built it before to_json() (its output is unchanged)
        assert list(r.to_json()) == ["source", "files", "tensors", "bytes", "objects",
                                     "seconds"]
        assert want == {"source": str(r.source), "files": [str(f) for f in r.files],
                        "tensors": r.tensors, "bytes": r.bytes, "objects": list(r.objects)}


def test_convert_json_is_the_result_to_json(tmp_path):
    merged = _merged(tmp_path)
    result = run("convert", merged, tmp_path / "dcp", "--json")
    assert result.exit_code == 0, result.output
    again = fsdpckpt.convert(merged, tmp_path / "dcp", overwrite=True)
    assert result.stdout == json.dumps(again.to_json()) + "\n"
    # as the command line built it before to_json() (its output is unchanged)
    assert result.stdout == json.dumps({"source": str(again.source), "output": str(again.path),
                                        "tensors": again.tensors, "objects": again.objects,
                                        "bytes": again.bytes}) + "\n"
