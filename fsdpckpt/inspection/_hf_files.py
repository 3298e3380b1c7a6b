"""The Hugging Face files ``inspect`` names: a model's config and generation config, and the
tokenizer, processor and chat template files ``save_pretrained`` writes beside it.

They sit in an export (``export-hf`` copies them), in a run's output folder, and in a
checkpoint folder (HF Trainer saves the processor and config into each ``checkpoint-N``).
Each is recognized by the names export-hf copies (:mod:`fsdpckpt.export._config`, one list),
so a file the export would carry is never shown as "Not recognized".
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from fsdpckpt._io import storage
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp.layout import SideFile
from fsdpckpt.export._code_files import custom_code_names
from fsdpckpt.export._config import CONFIG, GENERATION_CONFIG, PROCESSOR_FILES, TOKENIZER_FILES

__all__ = ["HF_FILE_KINDS", "hf_file_kind", "split_hf_files"]

#: ``SideFile.kind`` of each Hugging Face file, in the order ``inspect`` lists them.
HF_FILE_KINDS = ("config", "generation_config", "processor", "tokenizer", "chat_template",
                 "code")
#: The folders ``save_pretrained`` writes beside the files, by kind: a processor's other
#: tokenizers (``qformer_tokenizer/``) and the extra named chat templates.
_FOLDER_KINDS = ((re.compile(r"^\w+_tokenizer$"), "tokenizer"),
                 (re.compile(r"^additional_chat_templates$"), "chat_template"))


def hf_file_kind(name: str) -> str | None:
    """The kind of a Hugging Face file, by its name.

    Args:
        name: a file's name in its folder.

    Returns:
        One of :data:`HF_FILE_KINDS`, or None for another file.

    Example:
        >>> hf_file_kind("processor_config.json"), hf_file_kind("scheduler.bin")
        ('processor', None)
    """
    if name == CONFIG:
        return "config"
    if name == GENERATION_CONFIG:
        return "generation_config"
    if name in PROCESSOR_FILES:
        return "processor"
    if name in TOKENIZER_FILES:
        return "chat_template" if name.startswith("chat_template.") else "tokenizer"
    return None


def split_hf_files(folder: Place, names: Iterable[str]
                   ) -> tuple[tuple[SideFile, ...], tuple[str, ...]]:
    """Pick the Hugging Face files out of ``names`` (files and ``name/`` folders of ``folder``).

    Args:
        folder: the folder that holds them. names: what it holds, as a layout lists it.

    Returns:
        The Hugging Face files as side files (by :data:`HF_FILE_KINDS`, then name), and the
        other names, in their order.

    Example:
        >>> found, rest = split_hf_files(Path("out"), ["config.json", "notes.txt"])
        >>> [f.kind for f in found], rest
        (['config'], ('notes.txt',))
    """
    found: list[SideFile] = []
    rest: list[str] = []
    code: set[str] | None = None  # the auto_map's modules, read once if a .py file is there
    for name in names:
        bare = name.rstrip("/")
        place = folder / bare
        if name.endswith(".py"):
            code = set(custom_code_names(folder)) if code is None else code
            kind = "code" if name in code else None
        else:
            kind = hf_file_kind(bare) if not name.endswith("/") else None
        if kind is not None and place.is_file():
            found.append(SideFile(bare, kind, None, storage.size(place)))
            continue
        kind = next((k for pattern, k in _FOLDER_KINDS if pattern.match(bare)), None)
        if kind is not None and place.is_dir():
            files = [f for f in place.iterdir() if f.is_file()]
            found.append(SideFile(bare + "/", kind, None, sum(storage.size(f) for f in files)))
        else:
            rest.append(name)
    found.sort(key=lambda f: (HF_FILE_KINDS.index(f.kind), f.name))
    return tuple(found), tuple(rest)
