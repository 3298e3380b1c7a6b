"""Every private torch name fsdpckpt touches, in one place: the seam a torch upgrade goes through.

Two kinds of entry live here:

- **Names torch pickles into checkpoint files** (``module``, ``name`` pairs). fsdpckpt
  reads those files without importing torch, so it only needs the names; the allowlists
  (:mod:`fsdpckpt.dcp._allowlist`, :mod:`fsdpckpt.dcp._archive`) map each to a stand-in,
  and :mod:`fsdpckpt.formats.torch_bin` writes some of them. Old spellings stay: files
  written by older torch releases name them.
- **Private torch APIs called at run time** (training save/load, convert). Each is
  wrapped in a function that imports torch lazily, so no module but this one names them.
- **Python's pure-Python pickle classes** (``pickle._Pickler``, ``_Unpickler``, ``_Stop``):
  not torch's, but private all the same, and built on the way torch's own loader is. The
  restricted unpickler and the ``.bin`` writer extend them.

``tests/test_torch_compat.py`` checks every entry against the installed torch and fails
with a message naming the torch change and this file when torch moves one;
``tests/test_torch_versions.py`` reads metadata shaped as older releases wrote it.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "KNOWN_TORCH", "SUPPORTED_TORCH", "TORCH_MODULE", "DCP_METADATA_MODULE",
    "DCP_METADATA_CLASSES", "MEM_FORMAT_ENCODING", "OLD_TENSOR_PROPERTIES",
    "OLD_MEM_FORMAT_ENCODING", "STORAGE_INFO", "TORCH_SIZE", "GET_LAYOUT", "TORCH_CONSTANTS",
    "REBUILD_TENSOR_V2", "REBUILD_TENSOR_V3", "UNTYPED_STORAGE", "REBUILD_FROM_TYPE_V2",
    "REBUILD_WRAPPER_SUBCLASS", "TORCH_DEVICE", "DTENSOR", "DTENSOR_SPEC_CLASSES",
    "SHARDED_TENSOR", "SHARDED_TENSOR_CLASSES",
    "METADATA_TMP_SUFFIX",
    "PICKLED_NAMES", "is_torch_global", "storage_info", "flatten_state_dict",
    "set_writer_filesystem", "written_file_name", "store_loaded_value",
    "fsspec_writer", "fsspec_reader_class", "fsspec_filesystem_class",
    "takes_no_dist", "dcp_metadata", "reads_transforms", "DTYPE_SINCE", "dtype",
    "PurePythonPickler", "PurePythonUnpickler", "PickleStop",
]

#: The newest torch release whose checkpoint classes the allowlists were checked against.
#: A metadata global fsdpckpt does not know, in a torch module, is reported as "written by
#: a torch newer than this?". Raise it after re-running tests/test_torch_compat.py.
KNOWN_TORCH = "2.15"
#: What fsdpckpt runs with (pyproject's floor), and what it reads metadata from.
SUPPORTED_TORCH = "torch>=2.6 (metadata written by torch 2.4 or later is read)"

TORCH_MODULE = "torch"

# -- names torch pickles into .metadata -------------------------------------------------

DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
#: The dataclasses of a ``.metadata`` pickle (all public, in DCP's metadata module).
DCP_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "TensorProperties",
                        "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                        "StorageMeta")
#: The enum ``TensorProperties.__getstate__`` pickles the memory format as (torch >= 2.3).
MEM_FORMAT_ENCODING = (DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING")
#: Before torch 2.3, DCP pickled ShardedTensor's TensorProperties and its enum.
OLD_TENSOR_PROPERTIES = ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties")
OLD_MEM_FORMAT_ENCODING = ("torch.distributed._shard.sharded_tensor.metadata",
                           "MEM_FORMAT_ENCODING")
#: Where ``FileSystemWriter`` says each entry lies: ``storage_data``'s values.
STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
TORCH_SIZE = (TORCH_MODULE, "Size")
#: How older torch pickled a ``torch.layout``.
GET_LAYOUT = ("torch.serialization", "_get_layout")
#: ``torch.<name>`` constants (layouts, memory formats) a ``TensorProperties`` may name.
TORCH_CONSTANTS = ("strided", "sparse_coo", "sparse_csr", "_mkldnn", "contiguous_format",
                   "channels_last", "preserve_format", "channels_last_3d")

# -- names torch.save pickles into a tensor's archive -----------------------------------

REBUILD_TENSOR_V2 = ("torch._utils", "_rebuild_tensor_v2")
#: For dtypes without a legacy typed storage (float8, uint16...): names the dtype too.
REBUILD_TENSOR_V3 = ("torch._utils", "_rebuild_tensor_v3")
UNTYPED_STORAGE = ("torch.storage", "UntypedStorage")

# -- names torch.save pickles for a DTensor (per-rank files: Accelerate use_dcp=False, VeRL) --

#: ``torch._tensor._rebuild_from_type_v2(func, new_type, args, state)``: a tensor subclass.
REBUILD_FROM_TYPE_V2 = ("torch._tensor", "_rebuild_from_type_v2")
#: ``torch._utils._rebuild_wrapper_subclass(cls, dtype, size, stride, offset, layout, device,
#: requires_grad)``: the DTensor's global (wrapper) metadata.
REBUILD_WRAPPER_SUBCLASS = ("torch._utils", "_rebuild_wrapper_subclass")
TORCH_DEVICE = (TORCH_MODULE, "device")
DTENSOR = ("torch.distributed.tensor", "DTensor")
#: The classes torch registers with ``add_safe_globals`` for DTensors (``torch.distributed.
#: tensor`` and, for the mesh layout, ``torch.distributed._mesh_layout``): nothing broader.
DTENSOR_SPEC_CLASSES: Mapping[tuple[str, str], str] = {
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"): "DTensorSpec",
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"): "TensorMeta",
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"): "ShardOrderEntry",
    ("torch.distributed.device_mesh", "DeviceMesh"): "DeviceMesh",
    ("torch.distributed._mesh_layout", "_MeshLayout"): "_MeshLayout",
    ("torch.distributed._mesh_layout", "_FlatLayout"): "_FlatLayout",
    ("torch.distributed.tensor.placement_types", "Shard"): "Shard",
    ("torch.distributed.tensor.placement_types", "Replicate"): "Replicate",
    ("torch.distributed.tensor.placement_types", "Partial"): "Partial",
    ("torch.distributed.tensor.placement_types", "_StridedShard"): "_StridedShard",
}

#: FSDP1's sharded state dict (``torch.distributed._shard``): ``torch.save`` of a
#: ShardedTensor pickles the class, its local shards and metadata, and (through
#: ``getattr(ShardedTensor, "ProcessGroupState")``) the ranks that wrote it. torch allowlists
#: none of these for ``weights_only``; fsdpckpt reads exactly these, as data-only stand-ins.
SHARDED_TENSOR = ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")
SHARDED_TENSOR_CLASSES: Mapping[tuple[str, str], str] = {
    ("torch.distributed._shard.sharded_tensor.shard", "Shard"): "Shard",
    ("torch.distributed._shard.metadata", "ShardMetadata"): "ShardMetadata",
    ("torch.distributed._shard.sharded_tensor.metadata", "ShardedTensorMetadata"):
        "ShardedTensorMetadata",
    OLD_TENSOR_PROPERTIES: "TensorProperties",
    OLD_MEM_FORMAT_ENCODING: "MEM_FORMAT_ENCODING",
    ("torch.distributed.remote_device", "_remote_device"): "_remote_device",
    ("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"):
        "ChunkShardingSpec",
}

#: Every torch global above, with what pickles it: the checklist tests/test_torch_compat.py
#: resolves against the installed torch (dtypes and legacy storage classes, public
#: ``torch.<name>`` attributes, are listed in :mod:`fsdpckpt.dcp.dtypes`).
PICKLED_NAMES: Mapping[tuple[str, str], str] = {
    **{(DCP_METADATA_MODULE, c): ".metadata (a DCP dataclass)" for c in DCP_METADATA_CLASSES},
    MEM_FORMAT_ENCODING: ".metadata (TensorProperties' memory format)",
    OLD_TENSOR_PROPERTIES: ".metadata written by torch < 2.3",
    OLD_MEM_FORMAT_ENCODING: ".metadata written by torch < 2.3",
    STORAGE_INFO: ".metadata (storage_data's values)",
    TORCH_SIZE: ".metadata (shapes and offsets)",
    GET_LAYOUT: ".metadata written by older torch (a layout)",
    **{(TORCH_MODULE, c): ".metadata (TensorProperties' layout and memory format)"
       for c in TORCH_CONSTANTS},
    REBUILD_TENSOR_V2: "a torch.save archive (a tensor)",
    REBUILD_TENSOR_V3: "a torch.save archive (a tensor of a newer dtype)",
    UNTYPED_STORAGE: "a torch.save archive (a storage)",
    REBUILD_FROM_TYPE_V2: "a per-rank torch.save file (a DTensor)",
    REBUILD_WRAPPER_SUBCLASS: "a per-rank torch.save file (a DTensor)",
    TORCH_DEVICE: "a per-rank torch.save file (a DTensor's device)",
    DTENSOR: "a per-rank torch.save file (a DTensor)",
    **{key: "a per-rank torch.save file (a DTensor's spec)" for key in DTENSOR_SPEC_CLASSES},
    SHARDED_TENSOR: "a per-rank torch.save file (an FSDP1 ShardedTensor)",
    **{key: "a per-rank torch.save file (a ShardedTensor's metadata)"
       for key in SHARDED_TENSOR_CLASSES if key not in (OLD_TENSOR_PROPERTIES,
                                                        OLD_MEM_FORMAT_ENCODING)},
}

#: DCP writes ``.metadata`` under this suffix, then renames it (``FileSystemWriter.finish``).
METADATA_TMP_SUFFIX = ".tmp"


# Python's pure-Python pickle machinery: opcode methods and dispatch tables that the
# restricted unpickler (dcp/_safe_pickle.py) and the .bin writer (formats/torch_bin.py)
# extend. typeshed describes only the public classes, hence Any.
PurePythonPickler: Any = pickle._Pickler
PurePythonUnpickler: Any = pickle._Unpickler
PickleStop: Any = pickle._Stop  # type: ignore[attr-defined]  # STOP raises it, with the value


def is_torch_global(module: str) -> bool:
    """Whether a pickled global's module is torch's (``torch`` or ``torch.*``)."""
    return module == TORCH_MODULE or module.startswith(TORCH_MODULE + ".")


# -- private torch APIs called at run time -----------------------------------------------


def storage_info(relative_path: str, offset: int, length: int,
                 transforms: tuple[str, ...] = ()) -> Any:
    """torch's ``_StorageInfo``: where ``FileSystemReader`` finds an entry's bytes, and the
    stream transforms (``"stream.zstd/1"``) its reader must undo."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not transforms:
        return _StorageInfo(relative_path, offset, length)
    return _StorageInfo(relative_path, offset, length, transform_descriptors=list(transforms))


def flatten_state_dict(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flat names for a nested state dict, and each one's key path.

    torch has no public route to the names ``dcp.save`` gives nested entries
    (``optimizer.state.0.weight.exp_avg``); they must match it exactly.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    flat, mappings = flatten(state)
    return flat, dict(mappings)


def set_writer_filesystem(writer: Any, filesystem: Any) -> None:
    """Make ``FileSystemWriter`` write through ``filesystem`` (its undocumented ``fs``).

    Raises:
        TypeError: this torch's writer has no ``fs`` attribute to replace.
    """
    if not hasattr(writer, "fs"):
        raise TypeError(f"{type(writer).__name__} has no 'fs' attribute in this torch; "
                        "fsdpckpt cannot record checksums while it writes: update "
                        "fsdpckpt/_torch.py")
    writer.fs = filesystem


def written_file_name(path: str | Path) -> str:
    """The name a file DCP writes ends up with (``.metadata.tmp`` becomes ``.metadata``)."""
    return Path(path).name.removesuffix(METADATA_TMP_SUFFIX)


def store_loaded_value(planner: Any, fqn: str, value: Any) -> None:
    """Put a loaded non-tensor ``value`` where ``DefaultLoadPlanner.load_bytes`` would.

    Uses the planner's undocumented attributes (``flatten_state_dict``, ``mappings``,
    ``original_state_dict``, ``state_dict``); the nesting is fsdpckpt's own
    :func:`~fsdpckpt.dcp._nesting.set_element`, which does what DCP's does.
    """
    from fsdpckpt.dcp._nesting import set_element

    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, tuple(planner.mappings[fqn]), value)
    else:
        planner.state_dict[fqn] = value


def fsspec_filesystem_class() -> Any:
    """torch's fsspec ``FileSystem`` for DCP (``_fsspec_filesystem.FileSystem``): the
    ``create_stream``/``rename``/``exists`` DCP's writer and reader call, over an fsspec
    filesystem held in its ``fs`` attribute."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    return FileSystem


def fsspec_writer(url: str, filesystem: Any) -> Any:
    """torch's ``FsspecWriter`` for the folder ``url``, writing through ``filesystem`` (an
    instance of a :func:`fsspec_filesystem_class` subclass whose ``fs`` is already set), so
    that the credentials and endpoint fsdpckpt resolved are the ones used.

    ``sync_files`` is off: an object is durable once its upload completes, and torch's
    fallback for streams without a file descriptor is ``os.sync()`` of the whole machine.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer = FsspecWriter(url, sync_files=False)
    set_writer_filesystem(writer, filesystem)
    return writer


def fsspec_reader_class() -> Any:
    """torch's ``FsspecReader`` (DCP's reader over fsspec), to subclass; its ``fs`` is
    replaced as the writer's is."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def takes_no_dist(fn: Any) -> bool:
    """Whether the DCP entry point ``fn`` (``dcp.save``, ``dcp.load``, ``async_save``) takes
    ``no_dist=``: torch 2.7 added it; torch 2.6 decides from the process group alone, which
    is the same answer where there is none."""
    import inspect

    try:
        return "no_dist" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: call it the plain way
        return False


def dcp_metadata(entries: dict[str, Any], *, version: str | None, **fields: Any) -> Any:
    """torch's ``Metadata`` of a checkpoint: ``version`` (the format version, torch 2.7 and
    later) given only to a torch whose ``Metadata`` has the field."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import Metadata

    if version is not None and "version" in {f.name for f in dataclasses.fields(Metadata)}:
        fields["version"] = version
    return Metadata(entries, **fields)


def reads_transforms() -> bool:
    """Whether this torch's DCP loader decodes transformed (zstd-compressed) entries: its
    ``_extension`` module, which torch 2.6 lacks."""
    import importlib.util

    return importlib.util.find_spec("torch.distributed.checkpoint._extension") is not None


#: The dtypes fsdpckpt reads that a torch from the declared floor (2.6) on may lack, with the
#: release that added each. Without torch they are read, inspected, verified and merged as
#: bytes; a verb that must build a torch tensor of one needs that release.
DTYPE_SINCE: Mapping[str, str] = {"float8_e8m0fnu": "2.7", "float4_e2m1fn_x2": "2.7"}


def dtype(name: str, *, what: str = "") -> Any:
    """``torch.<name>``, the dtype a checkpoint names; one the installed torch lacks raises
    :class:`~fsdpckpt.errors.TorchTooOldError` naming the release that has it, instead of
    an ``AttributeError`` from inside."""
    import torch

    found = getattr(torch, name, None)
    if isinstance(found, torch.dtype):
        return found
    from fsdpckpt.errors import TorchTooOldError

    since = DTYPE_SINCE.get(name)
    upgrade = f"torch {since} or later" if since else "a newer torch"
    raise TorchTooOldError(
        f"{what + ': ' if what else ''}{name} tensors cannot be made with torch "
        f"{torch.__version__}, which lacks torch.{name}: install {upgrade}. Without "
        "torch tensors, fsdpckpt inspects, verifies and diffs them, and merges them as "
        "they are (no --dtype)")
