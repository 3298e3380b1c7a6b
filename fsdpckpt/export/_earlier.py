"""What an earlier export left in its folder that a new export of the other kind replaces.

A full export (``config.json`` and the weights) and an adapter export
(``adapter_config.json`` and the adapter's weights) cannot share a folder: a loader finding
both loads the wrong one (transformers, with PEFT installed, follows ``adapter_config.json``
to the base model and loads the adapter over it). Over an earlier export of the other kind,
its commit file is removed before the first new file lands, and its other files once the
new export is committed (:func:`fsdpckpt._io.publish.remove_durably`, both). Tokenizer and
processor files, which either kind may sit beside, are kept.
"""

from __future__ import annotations

from pathlib import Path

from fsdpckpt.export._config import CONFIG, GENERATION_CONFIG
from fsdpckpt.export._lora_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from fsdpckpt.formats import get_format
from fsdpckpt.merging._outputs import earlier_files

__all__ = ["ADAPTER_FILES", "earlier_adapter_export", "earlier_full_export"]

#: An adapter export's files, as PEFT's ``save_pretrained`` names them (either weights format).
ADAPTER_FILES = (ADAPTER_WEIGHTS, "adapter_model.bin", ADAPTER_CONFIG)


def earlier_full_export(out: Path) -> list[Path]:
    """The files of a full export in ``out``: its config, generation config and weights
    (single file, or index and the shards it names, safetensors or ``.bin``)."""
    if not out.is_dir():
        return []
    found = [out / n for n in (CONFIG, GENERATION_CONFIG) if (out / n).is_file()]
    for name in ("safetensors", "bin"):
        found += earlier_files(out, get_format(name), "model")
    return found


def earlier_adapter_export(out: Path) -> list[Path]:
    """The files of an adapter export in ``out``."""
    return [out / n for n in ADAPTER_FILES if (out / n).is_file()]
