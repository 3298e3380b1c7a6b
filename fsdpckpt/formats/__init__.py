"""Output formats for merged checkpoints, behind one small interface.

A format turns the list of tensors (names, dtypes, shapes) and the non-tensor
entries into a :class:`FileLayout`: the header bytes and where they go, where
each tensor's bytes start, and the file's size. The merge then places
every chunk's bytes at its final offset. A new format is a new module here, subclassing
:class:`OutputFormat` (``_base.py``) and registered in :data:`FORMATS`.
"""

from __future__ import annotations

from fsdpckpt.formats._base import FileLayout, ObjectValue, OutputFormat, TensorSpec
from fsdpckpt.formats.safetensors import SafetensorsFormat
from fsdpckpt.formats.torch_bin import TorchBinFormat

__all__ = ["TensorSpec", "ObjectValue", "FileLayout", "OutputFormat", "get_format", "FORMATS"]


def get_format(name: str) -> OutputFormat:
    """The format called ``name`` (``"safetensors"`` or ``"bin"``)."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose one of {sorted(FORMATS)}") from None


#: Every format by its ``--format`` name; a new format is registered here.
FORMATS: dict[str, type[OutputFormat]] = {"safetensors": SafetensorsFormat, "bin": TorchBinFormat}
