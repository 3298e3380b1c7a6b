"""safetensors: an 8-byte header length, a JSON header, then the raw tensor bytes.

The header depends only on names, dtypes and shapes, so it is written first and
every tensor's offset is known before any data is read. Tensors are ordered as
safetensors' own ``save_file`` orders them (larger itemsize first, then name),
which keeps every tensor aligned to its itemsize.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import fsdpckpt.dcp._objects as objects_codec
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.errors import MergePlanError
from fsdpckpt.formats._base import FileLayout, ObjectValue, OutputFormat, TensorSpec

__all__ = ["SafetensorsFormat", "OBJECTS_KEY", "KEY_PATHS_KEY", "RESERVED_NAME"]

#: The header key that holds the file's metadata; no tensor may take it.
RESERVED_NAME = "__metadata__"

#: safetensors metadata key holding the non-tensor entries as JSON ``{name: value}``.
OBJECTS_KEY = "fsdpckpt.objects"
#: safetensors metadata key holding ``{name: key_path}`` when the nesting matters.
KEY_PATHS_KEY = "fsdpckpt.key_paths"


class SafetensorsFormat(OutputFormat):
    name = "safetensors"
    suffix = "safetensors"
    model_file = "model.safetensors"

    def can_hold(self, dtype: DType) -> bool:
        return dtype.safetensors is not None

    def name_problem(self, stored: str, name: str) -> str | None:
        if name != RESERVED_NAME:
            return None
        # safetensors reads this header key as the file's metadata: the file would be
        # unreadable. (Objects live inside the metadata, so their names are free.)
        return (f"tensor '{stored}' would be named '{RESERVED_NAME}', which safetensors "
                f"reserves for its header; leave it out with --exclude '{RESERVED_NAME}', or "
                "use --format bin")

    def layout(self, tensors: Sequence[TensorSpec], objects: Sequence[ObjectValue], *,
               nested: bool) -> FileLayout:
        metadata = {"format": "pt"}
        if objects:
            metadata[OBJECTS_KEY] = objects_codec.dumps({o.name: o.value for o in objects})
        if nested:
            paths = {t.name: list(t.key_path) for t in tensors}
            paths.update({o.name: list(o.key_path) for o in objects})
            metadata[KEY_PATHS_KEY] = json.dumps(paths, separators=(",", ":"))
        ordered = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.name))
        header: dict[str, object] = {RESERVED_NAME: metadata}
        relative, end = {}, 0
        for spec in ordered:
            if spec.dtype.safetensors is None:
                raise MergePlanError(f"tensor '{spec.name}': safetensors has no {spec.dtype.name} "
                                 "type; use format='bin'")
            header[spec.name] = {"dtype": spec.dtype.safetensors, "shape": list(spec.shape),
                                 "data_offsets": [end, end + spec.nbytes]}
            relative[spec.name] = end
            end += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        prefix = struct.pack("<Q", len(text)) + text
        starts = {t.name: len(prefix) + relative[t.name] for t in tensors}
        return FileLayout(((0, prefix),), starts, len(prefix) + end)
