"""fsdpckpt: inspect, verify and merge sharded PyTorch FSDP (DCP) checkpoints.

The read-only API never imports torch, so it starts instantly.

Example:
    >>> import fsdpckpt
    >>> report = fsdpckpt.inspect_checkpoint("fixtures/fsdp2_accelerate")
    >>> report.world_size
    2
"""

import sys as _sys

if _sys.argv and _sys.argv[0].rpartition("/")[2] == "fsdpckpt":
    # The installed command imports this package before fsdpckpt.__main__.run's guard: a
    # Ctrl-C from here until run() takes over is the command's one line, not a traceback.
    # Nothing is written yet, so the process just ends; raised instead, an exception can
    # land in an import lock's callback, which Python prints and ignores. These are the
    # module's first statements, each already loaded by Python's start (no
    # ``from __future__`` import, which reads a file, in front of them): the window before
    # the handler is a few bytecodes.
    import _signal  # type: ignore[import-not-found]  # built in: signal.py is one more import
    import os as _os

    def _interrupted_at_start(*_: object) -> None:
        _sys.stderr.write("fsdpckpt: error: interrupted\n")
        _sys.stderr.flush()
        _os._exit(130)  # 128 + SIGINT, as in __main__.run

    _signal.signal(_signal.SIGINT, _interrupted_at_start)

from typing import TYPE_CHECKING

from fsdpckpt._version import __version__
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    DiffOptionError,
    DiskFullError,
    ExportMismatchError,
    FsdpCkptError,
    MergePlanError,
    NotACheckpointError,
    OptionError,
    OutputExistsError,
    OutputNotWritableError,
    RankLocalStateError,
    RemoteStorageError,
    RemoteTimeoutError,
    ResumeWarning,
    StateMismatchError,
    Terminated,
    TorchTooOldError,
    UnfinishedSaveError,
    UnsafePickleError,
)

if TYPE_CHECKING:  # what mypy and editors see; at run time, ``__getattr__`` below
    from fsdpckpt.dcp.checks import Problem, check_folder
    from fsdpckpt.dcp.dtypes import DType
    from fsdpckpt.dcp.layout import CheckpointLayout, find_layout
    from fsdpckpt.dcp.metadata import Chunk, DcpMetadata, ObjectEntry, TensorEntry
    from fsdpckpt.dcp.reader import DcpFolder, read_dcp_folder
    from fsdpckpt.export.hf import ExportResult, export_hf
    from fsdpckpt.inspection.diff import DiffReport, diff
    from fsdpckpt.inspection.inspect import inspect_checkpoint
    from fsdpckpt.inspection.listing import CheckpointList, list_checkpoints
    from fsdpckpt.inspection.report import InspectReport, PartReport, TensorReport, VerifyReport
    from fsdpckpt.inspection.verify import verify_checkpoint
    from fsdpckpt.merging.full import load_full_state_dict
    from fsdpckpt.merging.merger import MergeResult, merge, merge_fsdp_weights
    from fsdpckpt.merging.plan import MergePlan, plan_merge
    from fsdpckpt.merging.to_dcp import ConvertResult, convert
    from fsdpckpt.training.manager import CheckpointManager
    from fsdpckpt.training.pretrained import load_pretrained
    from fsdpckpt.training.pretrained_save import save_pretrained
    from fsdpckpt.training.state import AsyncSave, LoadResult, load_state, save_state

#: Where each public name lives, imported on first use (PEP 562): ``import fsdpckpt`` loads
#: only this module and ``errors`` (``tests/test_public_api.py`` counts them).
_LAZY = {
    "Problem": "dcp.checks", "check_folder": "dcp.checks", "DType": "dcp.dtypes",
    "CheckpointLayout": "dcp.layout", "find_layout": "dcp.layout",
    "Chunk": "dcp.metadata", "DcpMetadata": "dcp.metadata", "ObjectEntry": "dcp.metadata",
    "TensorEntry": "dcp.metadata", "DcpFolder": "dcp.reader", "read_dcp_folder": "dcp.reader",
    "inspect_checkpoint": "inspection.inspect", "InspectReport": "inspection.report",
    "PartReport": "inspection.report", "TensorReport": "inspection.report",
    "VerifyReport": "inspection.report", "verify_checkpoint": "inspection.verify",
    "diff": "inspection.diff", "DiffReport": "inspection.diff",
    "list_checkpoints": "inspection.listing", "CheckpointList": "inspection.listing",
    "merge": "merging.merger", "merge_fsdp_weights": "merging.merger",
    "MergeResult": "merging.merger", "load_full_state_dict": "merging.full",
    "convert": "merging.to_dcp", "ConvertResult": "merging.to_dcp",
    "plan_merge": "merging.plan", "MergePlan": "merging.plan",
    "save_state": "training.state", "load_state": "training.state",
    "LoadResult": "training.state", "AsyncSave": "training.state",
    "CheckpointManager": "training.manager", "load_pretrained": "training.pretrained",
    "save_pretrained": "training.pretrained_save",
    "export_hf": "export.hf", "ExportResult": "export.hf",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once: later lookups do not come back here
        return value
    raise AttributeError(f"module 'fsdpckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

__all__ = [
    "__version__",
    "CheckpointLayout",
    "CheckpointNotFoundError",
    "ChecksumError",
    "Chunk",
    "CorruptCheckpointError",
    "DType",
    "DcpFolder",
    "DcpMetadata",
    "FsdpCkptError",
    "NotACheckpointError",
    "RankLocalStateError",
    "ObjectEntry",
    "Problem",
    "RemoteStorageError",
    "RemoteTimeoutError",
    "TensorEntry",
    "UnsafePickleError",
    "check_folder",
    "find_layout",
    "inspect_checkpoint",
    "list_checkpoints",
    "CheckpointList",
    "InspectReport",
    "PartReport",
    "TensorReport",
    "VerifyReport",
    "read_dcp_folder",
    "merge",
    "merge_fsdp_weights",
    "MergeResult",
    "load_full_state_dict",
    "convert",
    "ConvertResult",
    "plan_merge",
    "MergePlan",
    "MergePlanError",
    "OutputExistsError",
    "DiskFullError",
    "OutputNotWritableError",
    "save_state",
    "load_pretrained",
    "load_state",
    "LoadResult",
    "AsyncSave",
    "StateMismatchError",
    "TorchTooOldError",
    "UnfinishedSaveError",
    "ResumeWarning",
    "CheckpointManager",
    "save_pretrained",
    "verify_checkpoint",
    "export_hf",
    "ExportResult",
    "ExportMismatchError",
    "diff",
    "DiffReport",
    "DiffOptionError",
    "OptionError",
    "Terminated",
]
