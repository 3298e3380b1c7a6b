"""fsdpckpt: inspect, verify and merge sharded PyTorch FSDP (DCP) checkpoints.

The read-only API never imports torch, so it starts instantly.

Example:
    >>> import fsdpckpt
    >>> report = fsdpckpt.inspect_checkpoint("fixtures/fsdp2_accelerate")
    >>> report.world_size
    2
"""

from __future__ import annotations

__version__ = "0.1.0"

from fsdpckpt.dcp.checks import Problem, check_folder
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.layout import CheckpointLayout, find_layout
from fsdpckpt.dcp.metadata import Chunk, DcpMetadata, ObjectEntry, TensorEntry
from fsdpckpt.dcp.reader import DcpFolder, read_dcp_folder
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    DiskFullError,
    FsdpCkptError,
    NotACheckpointError,
    RemoteStorageError,
    RemoteTimeoutError,
    UnsafePickleError,
)
from fsdpckpt.inspection.inspect import inspect_checkpoint
from fsdpckpt.inspection.report import InspectReport, PartReport, TensorReport, VerifyReport


def __getattr__(name: str):
    # The verbs below pull in more modules (and torch, for some paths) on first use only.
    lazy = {
        "merge": "merging.merger", "merge_fsdp_weights": "merging.merger",
        "MergeResult": "merging.merger", "load_full_state_dict": "merging.full",
        "convert": "merging.to_dcp", "ConvertResult": "merging.to_dcp",
        "plan_merge": "merging.plan", "MergePlan": "merging.plan", "MergePlanError": "merging.plan",
        "OutputExistsError": "merging.writer",
        "OutputNotWritableError": "merging.writer",
        "save_state": "training.state", "load_state": "training.state",
        "LoadResult": "training.state",
        "AsyncSave": "training.state", "StateMismatchError": "training.state",
        "ResumeWarning": "training.state",
        "CheckpointManager": "training.manager", "verify_checkpoint": "inspection.verify",
        "export_hf": "export.hf", "ExportResult": "export.hf",
        "ExportMismatchError": "export.hf",
        "diff": "inspection.diff", "DiffReport": "inspection.diff",
    }
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(f".{lazy[name]}", __name__), name)
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
    "ObjectEntry",
    "Problem",
    "RemoteStorageError",
    "RemoteTimeoutError",
    "TensorEntry",
    "UnsafePickleError",
    "check_folder",
    "find_layout",
    "inspect_checkpoint",
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
    "load_state",
    "LoadResult",
    "AsyncSave",
    "StateMismatchError",
    "ResumeWarning",
    "CheckpointManager",
    "verify_checkpoint",
    "export_hf",
    "ExportResult",
    "ExportMismatchError",
    "diff",
    "DiffReport",
]
