"""fsdpckpt: inspect, verify and merge sharded PyTorch FSDP (DCP) checkpoints.

The read-only API never imports torch, so it starts instantly.

Example:
    >>> import fsdpckpt
    >>> doc = fsdpckpt.inspect_checkpoint("fixtures/fsdp2_accelerate")
    >>> doc["world_size"]
    2
"""

from __future__ import annotations

__version__ = "0.1.0"

from .checks import Problem, check_folder
from .dtypes import DType
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FsdpCkptError,
    NotACheckpointError,
    UnsafePickleError,
)
from .inspection import inspect_checkpoint
from .layout import CheckpointLayout, find_layout
from .metadata import Chunk, DcpMetadata, ObjectEntry, TensorEntry
from .reader import DcpFolder, read_dcp_folder

__all__ = [
    "__version__",
    "CheckpointLayout",
    "CheckpointNotFoundError",
    "Chunk",
    "CorruptCheckpointError",
    "DType",
    "DcpFolder",
    "DcpMetadata",
    "FsdpCkptError",
    "NotACheckpointError",
    "ObjectEntry",
    "Problem",
    "TensorEntry",
    "UnsafePickleError",
    "check_folder",
    "find_layout",
    "inspect_checkpoint",
    "read_dcp_folder",
]
