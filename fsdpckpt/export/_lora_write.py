"""The fused model written tensor by tensor, in constant memory: one ``model.safetensors``,
or shards and their index as a merge splits them.

Fusion keeps every shape, so the whole file (header, each tensor's offset) is laid out
from the checkpoint's metadata before any data is read; each fused tensor is then written
at its place and dropped. The file is staged beside the target and renamed at the end
(:func:`fsdpckpt._io.publish.beside`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdpckpt._io import publish
from fsdpckpt._io.durable import write_bytes
from fsdpckpt._io.rawio import pwrite_all
from fsdpckpt.dcp.dtypes import dtype_from_name
from fsdpckpt.errors import CorruptCheckpointError
from fsdpckpt.export._lora_keys import LoraLayout
from fsdpckpt.export._lora_read import ModelSource
from fsdpckpt.formats import TensorSpec
from fsdpckpt.formats.safetensors import SafetensorsFormat
from fsdpckpt.merging.plan import parse_dtype, split_shards

__all__ = ["fused_specs", "write_streaming", "write_sharded"]


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
    return _write_files([(path, specs)], tensors)


def write_sharded(source: ModelSource, layout: LoraLayout, adapter: str, folder: Path,
                  dtype: str | None, tensors: Iterable[tuple[str, Any]], *,
                  exclude: frozenset[str] = frozenset(), limit: int | None = None,
                  stem: str = "model") -> tuple[list[Path], int]:
    """As :func:`write_streaming`, split as a merge splits (:func:`~fsdpckpt.merging.plan.
    split_shards`): one ``{stem}.safetensors`` when it fits in ``limit`` bytes, otherwise
    ``{stem}-0000i-of-0000N.safetensors`` and ``{stem}.safetensors.index.json``, in ``folder``.

    Returns:
        The files written (the index last) and how many tensors were written.
    """
    fmt = SafetensorsFormat()
    specs = fused_specs(source, layout, adapter, dtype, exclude=exclude)
    shards = split_shards(specs, lambda s: s.nbytes, limit)
    if len(shards) == 1:
        files = [(folder / fmt.single_file_name(stem), shards[0])]
    else:
        files = [(folder / fmt.shard_file_name(stem, i, len(shards)), shard)
                 for i, shard in enumerate(shards, 1)]
    count = _write_files(files, tensors)
    paths = [path for path, _ in files]
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: path.name for path, shard in files for s in shard}}
        paths.append(folder / fmt.index_file_name(stem))
        write_bytes(paths[-1], (json.dumps(index, indent=2) + "\n").encode())
    return paths, count


def _write_files(files: list[tuple[Path, list[TensorSpec]]],
                 tensors: Iterable[tuple[str, Any]]) -> int:
    # Every file laid out first (header and size), each staged beside its target; then each
    # tensor is written at its place as it comes, and the files renamed into place at the
    # end (fsdpckpt/_io/publish.py). On any error the staged files are removed and no
    # target is touched.
    fmt = SafetensorsFormat()
    where: dict[str, tuple[int, int, TensorSpec]] = {}  # name -> (fd, offset, spec)
    count = 0
    with publish.beside([path for path, _ in files]) as staged, \
            contextlib.ExitStack() as opened:
        fds = []
        for tmp, (_path, specs) in zip(staged, files, strict=True):
            file = fmt.layout(specs, [], nested=False)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            opened.callback(os.close, fd)
            fds.append(fd)
            os.ftruncate(fd, file.size)
            for offset, data in file.fixed:
                pwrite_all(fd, memoryview(data), offset)
            where.update((s.name, (fd, file.starts[s.name], s)) for s in specs)
        for name, tensor in tensors:
            if name not in where:  # a tied target (excluded)
                continue
            fd, offset, spec = where[name]
            data = tensor.contiguous().view(-1).view(dtype=_uint8()).numpy()
            if tuple(tensor.shape) != spec.shape or len(data) != spec.nbytes:
                raise CorruptCheckpointError(f"{name}: came out {tuple(tensor.shape)}, "
                                             f"{tensor.dtype}; the layout said {spec.shape}")
            pwrite_all(fd, memoryview(data), offset)
            count += 1
        for fd in fds:
            os.fsync(fd)
    return count


def _uint8() -> Any:
    import torch

    return torch.uint8
