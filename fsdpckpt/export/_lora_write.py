"""One ``model.safetensors`` written tensor by tensor: the fused model, in constant memory.

Fusion keeps every shape, so the whole file (header, each tensor's offset) is laid out
from the checkpoint's metadata before any data is read; each fused tensor is then written
at its place and dropped. The file is staged beside the target and renamed at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from fsdpckpt._io.rawio import pwrite_all
from fsdpckpt.dcp.dtypes import dtype_from_name
from fsdpckpt.errors import CorruptCheckpointError
from fsdpckpt.export._lora_keys import LoraLayout
from fsdpckpt.formats import TensorSpec
from fsdpckpt.formats.safetensors import SafetensorsFormat

__all__ = ["TensorTable", "write_streaming"]


class TensorTable(Protocol):
    """What the layout needs of a source: its stored names, shapes and dtype names
    (a :class:`~fsdpckpt.export._lora_read.ModelSource`, or a view of one)."""

    @property
    def names(self) -> tuple[str, ...]: ...
    @property
    def shapes(self) -> dict[str, tuple[int, ...]]: ...
    @property
    def dtypes(self) -> dict[str, str]: ...

_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def write_streaming(source: TensorTable, layout: LoraLayout, adapter: str, path: Path,
                    dtype: str | None, tensors: Iterable[tuple[str, Any]]) -> int:
    """Lay out ``path`` from ``source``'s metadata, then write each of ``tensors`` in place.

    Returns:
        How many tensors were written.

    Raises:
        CorruptCheckpointError: a tensor came out other than the layout said.
    """
    specs = []
    for stored in source.names:
        plain = layout.plain_name(stored, adapter)
        if plain is None:
            continue
        stored_dtype = dtype_from_name(source.dtypes[stored])
        is_float = stored_dtype is not None and stored_dtype.is_floating
        found = dtype_from_name(_NAMES.get(dtype, dtype)) if dtype and is_float else stored_dtype
        name = dtype if dtype and is_float else source.dtypes[stored]
        if found is None:
            raise CorruptCheckpointError(f"{stored}: dtype {name} cannot be written")
        specs.append(TensorSpec(plain, (plain,), found, source.shapes[stored]))
    file = SafetensorsFormat().layout(specs, [], nested=False)
    by_name = {s.name: s for s in specs}
    staging = path.with_name(f".{path.name}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    count = 0
    try:
        os.ftruncate(fd, file.size)
        for offset, data in file.fixed:
            pwrite_all(fd, memoryview(data), offset)
        for name, tensor in tensors:
            spec = by_name[name]
            data = tensor.contiguous().view(-1).view(dtype=_uint8()).numpy()
            if tuple(tensor.shape) != spec.shape or len(data) != spec.nbytes:
                raise CorruptCheckpointError(f"{name}: came out {tuple(tensor.shape)}, "
                                             f"{tensor.dtype}; the layout said {spec.shape}")
            pwrite_all(fd, memoryview(data), file.starts[name])
            count += 1
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(staging, path)
    finally:
        if fd >= 0:
            os.close(fd)
        staging.unlink(missing_ok=True)
    return count


def _uint8() -> Any:
    import torch

    return torch.uint8
