"""The public API: exactly these names in ``fsdpckpt.__all__``, each importable from ``fsdpckpt``.

A name added or removed here is a change to what users may rely on: do it on purpose.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import fsdpckpt

PUBLIC = {
    "__version__",
    # reading, without torch
    "CheckpointLayout", "Chunk", "DType", "DcpFolder", "DcpMetadata", "ObjectEntry",
    "TensorEntry", "Problem", "check_folder", "find_layout", "read_dcp_folder",
    # inspection, verification and comparison, and their typed results
    "inspect_checkpoint", "verify_checkpoint", "diff", "list_checkpoints",
    "InspectReport", "PartReport", "TensorReport", "VerifyReport", "DiffReport",
    "CheckpointList",
    # errors
    "FsdpCkptError", "CheckpointNotFoundError", "CorruptCheckpointError", "ChecksumError",
    "NotACheckpointError", "UnsafePickleError", "RemoteStorageError", "RemoteTimeoutError",
    "DiffOptionError", "OptionError", "Terminated", "RankLocalStateError", "TorchTooOldError",
    "UnfinishedSaveError",
    # merging and converting
    "merge", "merge_fsdp_weights", "MergeResult", "load_full_state_dict", "convert",
    "ConvertResult", "plan_merge", "MergePlan", "MergePlanError", "OutputExistsError",
    "DiskFullError", "OutputNotWritableError",
    # training
    "save_state", "load_state", "LoadResult", "AsyncSave", "StateMismatchError",
    "ResumeWarning", "CheckpointManager", "load_pretrained", "save_pretrained",
    # exporting
    "export_hf", "ExportResult", "ExportMismatchError",
}


def test_all_lists_exactly_the_public_names():
    assert set(fsdpckpt.__all__) == PUBLIC


def test_all_lists_each_name_once():
    assert len(fsdpckpt.__all__) == len(set(fsdpckpt.__all__))


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_name_is_importable_from_the_package(name):
    # ``from fsdpckpt import name``, the way users write it (lazy names included).
    module = __import__("fsdpckpt", fromlist=[name])
    assert getattr(module, name) is not None


def test_dir_shows_every_public_name():
    assert set(dir(fsdpckpt)) >= PUBLIC


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'inspect'"):
        _ = fsdpckpt.inspect


def test_the_read_side_and_its_report_types_do_not_import_torch():
    code = ("import sys, fsdpckpt\n"
            "fsdpckpt.inspect_checkpoint('fixtures/fsdp2_accelerate')\n"
            "fsdpckpt.InspectReport, fsdpckpt.VerifyReport\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=fsdpckpt.__path__[0] + "/..").stdout
    assert out.strip() == "False"


# --- every public error in one module ---------------------------------------------------

#: Where each error lived before it moved to ``fsdpckpt.errors``: users may import it there.
OLD_HOMES = {
    "MergePlanError": "fsdpckpt.merging.plan",
    "OutputExistsError": "fsdpckpt.merging.writer",
    "OutputNotWritableError": "fsdpckpt.merging.writer",
    "ExportMismatchError": "fsdpckpt.export._keycheck",
    "DiffOptionError": "fsdpckpt.inspection.diff",
    "StateMismatchError": "fsdpckpt.training.state",
    "ResumeWarning": "fsdpckpt.training.state",
    "Terminated": "fsdpckpt.merging.writer",
}


def _public_exceptions() -> set[str]:
    return {name for name in PUBLIC
            if isinstance(getattr(fsdpckpt, name), type)
            and issubclass(getattr(fsdpckpt, name), BaseException)}


def test_every_public_exception_is_defined_in_the_errors_module():
    import fsdpckpt.errors

    for name in _public_exceptions():
        assert getattr(fsdpckpt, name).__module__ == "fsdpckpt.errors", name
    assert set(fsdpckpt.errors.__all__) == _public_exceptions()


def test_no_module_but_errors_defines_an_error_class():
    import ast
    import pathlib

    root = pathlib.Path(fsdpckpt.__path__[0])
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    getattr(base, "id", "").endswith(("Error", "Warning", "Interrupt"))
                    for base in node.bases):
                found.append(f"{path.relative_to(root)}: {node.name}")
    assert found == []


@pytest.mark.parametrize("name", sorted(OLD_HOMES))
def test_an_error_still_imports_from_where_it_lived(name):
    import importlib

    assert getattr(importlib.import_module(OLD_HOMES[name]), name) is getattr(fsdpckpt, name)


# --- a lazy package -----------------------------------------------------------------------

def _modules_loaded(statement: str) -> list[str]:
    code = (f"import sys\n{statement}\n"
            "print(' '.join(m for m in sys.modules if m.startswith('fsdpckpt')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=fsdpckpt.__path__[0] + "/..").stdout
    return out.split()


def test_importing_the_package_loads_at_most_four_of_its_modules():
    assert len(_modules_loaded("import fsdpckpt")) <= 4


@pytest.mark.parametrize("package", ["dcp", "formats", "inspection", "merging", "export",
                                     "training", "_io", "errors"])
def test_importing_a_subpackage_loads_only_it_and_what_its_own_names_need(package):
    # ``formats`` defines its dataclasses over ``dcp.dtypes`` and ``dcp.metadata``; the
    # format writers themselves load on first use of ``FORMATS``.
    needs = {"formats": {"fsdpckpt.formats._base", "fsdpckpt.dcp", "fsdpckpt.dcp.dtypes",
                         "fsdpckpt.dcp.metadata"}}
    loaded = set(_modules_loaded(f"import fsdpckpt.{package}"))
    package_itself = {"fsdpckpt", "fsdpckpt._version", "fsdpckpt.errors"}
    assert loaded == package_itself | {f"fsdpckpt.{package}"} | needs.get(package, set())


def test_a_public_name_is_loaded_on_first_use():
    loaded = _modules_loaded("import fsdpckpt\nfsdpckpt.DcpMetadata")
    assert "fsdpckpt.dcp.metadata" in loaded and "fsdpckpt.merging.merger" not in loaded
