"""Output formats for merged checkpoints, behind one small interface.

A format turns the list of tensors (names, dtypes, shapes) and the non-tensor
entries into a :class:`FileLayout`: the header bytes and where they go, where
each tensor's bytes start, and the file's size. The merge then places
every chunk's bytes at its final offset. A new format is a new module here, subclassing
:class:`OutputFormat` (``_base.py``) and registered in :func:`_formats`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from fsdpckpt.errors import OptionError
from fsdpckpt.formats._base import FileLayout, ObjectValue, OutputFormat, TensorSpec

__all__ = ["TensorSpec", "ObjectValue", "FileLayout", "OutputFormat", "get_format", "FORMATS"]


def get_format(name: str) -> OutputFormat:
    """The format called ``name`` (``"safetensors"`` or ``"bin"``)."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise OptionError(f"unknown format {name!r}; choose one of {sorted(FORMATS)}") from None


def _formats() -> dict[str, type[OutputFormat]]:
    """Every format by its ``--format`` name; a new format is registered here."""
    from fsdpckpt.formats.safetensors import SafetensorsFormat
    from fsdpckpt.formats.torch_bin import TorchBinFormat

    return {"safetensors": SafetensorsFormat, "bin": TorchBinFormat}


class _Registry(Mapping[str, type[OutputFormat]]):
    """The formats by name, their modules imported on first use: ``import fsdpckpt.formats``
    (which the merge's plan needs for :class:`TensorSpec`) does not load every writer."""

    def __init__(self) -> None:
        self._formats: dict[str, type[OutputFormat]] | None = None

    def _loaded(self) -> dict[str, type[OutputFormat]]:
        if self._formats is None:
            self._formats = _formats()
        return self._formats

    def __getitem__(self, name: str) -> type[OutputFormat]:
        return self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def __repr__(self) -> str:
        return repr(self._loaded())


FORMATS: Mapping[str, type[OutputFormat]] = _Registry()
