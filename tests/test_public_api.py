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
    "inspect_checkpoint", "verify_checkpoint", "diff",
    "InspectReport", "PartReport", "TensorReport", "VerifyReport", "DiffReport",
    # errors
    "FsdpCkptError", "CheckpointNotFoundError", "CorruptCheckpointError", "ChecksumError",
    "NotACheckpointError", "UnsafePickleError", "RemoteStorageError", "RemoteTimeoutError",
    # merging and converting
    "merge", "merge_fsdp_weights", "MergeResult", "load_full_state_dict", "convert",
    "ConvertResult", "plan_merge", "MergePlan", "MergePlanError", "OutputExistsError",
    "DiskFullError", "OutputNotWritableError",
    # training
    "save_state", "load_state", "LoadResult", "AsyncSave", "StateMismatchError",
    "ResumeWarning", "CheckpointManager",
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
