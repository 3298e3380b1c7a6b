"""One ``model.safetensors`` written tensor by tensor: the fused model, in constant memory.

Fusion keeps every shape, so the whole file (header, each tensor's offset) is laid out
from the checkpoint's metadata before any data is read; each fused tensor is then written
at its place and dropped. The file is staged beside the target and renamed at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdpckpt._io.rawio import pwrite_all
from fsdpckpt.dcp.dtypes import dtype_from_name
from fsdpckpt.errors import CorruptCheckpointError
from fsdpckpt.export._lora_keys import LoraLayout
from fsdpckpt.export._lora_read import ModelSource
from fsdpckpt.formats import TensorSpec
from fsdpckpt.formats.safetensors import SafetensorsFormat
from fsdpckpt.merging.plan import parse_dtype

__all__ = ["fused_specs", "write_streaming"]


def fused_specs(source: ModelSource, layout: LoraLayout, adapter: str, dtype: str | None, *,
                exclude: frozenset[str] = frozenset()) -> list[TensorSpec]:
    """What the fused model holds, from ``source``'s metadata alone: each plain name (less
    ``exclude``), in stored order, with its shape and its dtype after the cast to ``dtype``
    (floating-point tensors only; ``dtype`` is one :func:`~fsdpckpt.export.lora` checked).

    Raises:
        CorruptCheckpointError: a stored dtype the output cannot hold.
    """
    target = parse_dtype(dtype)
    specs = []
    for stored in source.names:
        plain = layout.plain_name(stored, adapter)
        if plain is None or plain in exclude:
            continue
        stored_dtype = dtype_from_name(source.dtypes[stored])
        cast = target is not None and stored_dtype is not None and stored_dtype.is_floating
        found = target if cast else stored_dtype
        if found is None:
            raise CorruptCheckpointError(f"{stored}: dtype {source.dtypes[stored]} cannot be "
                                         "written")
        specs.append(TensorSpec(plain, (plain,), found, source.shapes[stored]))
    return specs


def write_streaming(source: ModelSource, layout: LoraLayout, adapter: str, path: Path,
                    dtype: str | None, tensors: Iterable[tuple[str, Any]], *,
                    exclude: frozenset[str] = frozenset()) -> int:
    """Lay out ``path`` from ``source``'s metadata (:func:`fused_specs`), then write each of
    ``tensors`` in place; tensors named in ``exclude`` (tied targets) are left out.

    Returns:
        How many tensors were written.

    Raises:
        CorruptCheckpointError: a tensor came out other than the layout said.
    """
    specs = fused_specs(source, layout, adapter, dtype, exclude=exclude)
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
            if name in exclude:
                continue
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
