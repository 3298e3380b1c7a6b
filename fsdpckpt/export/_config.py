"""The Hugging Face files beside the weights: where to find them, and the config fixed for export.

Pure file work, no torch, no transformers: :func:`find_side_files` looks where trainers leave
``config.json`` and the tokenizer, :func:`exported_config` rewrites the config for the
exported weights (``architectures`` without FSDP2's ``FSDP`` prefix, the dtype field).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt._io.jsonio import parse_json
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

__all__ = ["SideFiles", "CONFIG", "GENERATION_CONFIG", "TOKENIZER_FILES", "find_side_files",
           "exported_config", "strip_fsdp_prefix", "read_config", "config_bytes"]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
#: Every file a tokenizer (fast or slow) and its chat template may be saved as.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "chat_template.jinja", "chat_template.json")
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: A folder of .jinja templates (transformers 5 saves extra named chat templates there).
_TEMPLATES_DIR = "additional_chat_templates"

#: A config.json is a few KB; one larger than this is not one.
_MAX_CONFIG_BYTES = 16 * 2**20

#: FSDP2's ``fully_shard`` renames the class to ``FSDP<Class>``.
_FSDP_PREFIX = re.compile(r"^FSDP(?=[A-Z])")


@dataclass(frozen=True)
class SideFiles:
    """Where the files beside the weights come from.

    Attributes:
        config: the ``config.json`` to export (read, then rewritten).
        copied: the other files copied as they are (generation config, tokenizer, chat
            template), as (source path, name in the output).
        looked: the folders searched, in order.
    """

    config: Path
    copied: tuple[tuple[Path, str], ...]
    looked: tuple[Path, ...]


def _candidates(checkpoint_root: Path) -> list[Path]:
    # Where trainers leave the HF files: the checkpoint folder (HF Trainer), VeRL's
    # huggingface/ inside it, and the run's output folder above it (Accelerate and HF
    # Trainer runs: output/checkpoint-500), with its huggingface/ too.
    found: list[Path] = []
    for folder in (checkpoint_root, checkpoint_root / "huggingface", checkpoint_root.parent,
                   checkpoint_root.parent / "huggingface"):
        if folder not in found:
            found.append(folder)
    return found


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_MARKERS)


def find_side_files(checkpoint_root: Path, base: Path | None) -> SideFiles:
    """The config, generation config, tokenizer files and chat template to export.

    With ``base`` (a Hugging Face model folder), they come from there alone. Without it,
    the config comes from the first of the folders trainers leave it in that holds one
    (the checkpoint folder, its ``huggingface/``, the run's output folder above it and its
    ``huggingface/``); the tokenizer likewise, and the generation config from the config's
    folder, else the first that holds one.

    Raises:
        CheckpointNotFoundError: ``base`` is not a folder; no ``config.json`` or no
            tokenizer was found (the message lists where it looked and says to pass --base).
    """
    if base is not None:
        if not base.is_dir():
            raise CheckpointNotFoundError(f"{base}: --base is not a folder; pass the Hugging "
                                          "Face model folder the run started from")
        folders = [base]
    else:
        folders = _candidates(checkpoint_root)
    where = ", ".join(str(f) for f in folders)
    hint = ("pass --base with the model folder the run started from" if base is None else
            "pass a --base folder that holds it (the one from_pretrained loaded)")
    config = next((f / CONFIG for f in folders if (f / CONFIG).is_file()), None)
    if config is None:
        raise CheckpointNotFoundError(f"no {CONFIG} found for {checkpoint_root}; looked in "
                                      f"{where}; {hint}")
    tokenizer = next((f for f in [config.parent, *folders] if _has_tokenizer(f)), None)
    if tokenizer is None:
        raise CheckpointNotFoundError(f"no tokenizer (tokenizer.json, tokenizer_config.json or "
                                      f"tokenizer.model) found for {checkpoint_root}; looked in "
                                      f"{where}; {hint}")
    copied = [(tokenizer / name, name) for name in TOKENIZER_FILES
              if (tokenizer / name).is_file()]
    templates = tokenizer / _TEMPLATES_DIR
    if templates.is_dir():
        copied += [(p, f"{_TEMPLATES_DIR}/{p.name}") for p in sorted(templates.glob("*.jinja"))
                   if p.is_file()]
    generation = next((f / GENERATION_CONFIG for f in [config.parent, *folders]
                       if (f / GENERATION_CONFIG).is_file()), None)
    if generation is not None:
        copied.insert(0, (generation, GENERATION_CONFIG))
    return SideFiles(config, tuple(copied), tuple(folders))


def strip_fsdp_prefix(name: str) -> str:
    """``FSDPQwen2ForCausalLM`` -> ``Qwen2ForCausalLM``; other names unchanged."""
    return _FSDP_PREFIX.sub("", name)


def read_config(path: Path) -> dict[str, Any]:
    """``config.json`` as a dict.

    Raises:
        NotACheckpointError: it is not a JSON object with a ``model_type``.
    """
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"it is over {_MAX_CONFIG_BYTES} bytes")
        config = parse_json(path.read_bytes())
    except (ValueError, OSError) as exc:
        raise NotACheckpointError(f"{path}: cannot read it as JSON ({exc}); pass --base with "
                                  "a Hugging Face model folder") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise NotACheckpointError(f"{path}: has no model_type, so transformers cannot tell "
                                  "which model it is; pass --base with the model folder the "
                                  "run started from")
    return config


def exported_config(config: dict[str, Any], dtype_name: str, *,
                    untie: bool = False) -> dict[str, Any]:
    """The config written beside the exported weights.

    ``architectures`` loses FSDP2's ``FSDP`` class prefix; the dtype field is set to
    ``dtype_name`` (``"bfloat16"``...): ``torch_dtype`` and/or ``dtype``, whichever the
    config has (``torch_dtype``, which every transformers release reads, when it has none).
    With ``untie``, ``tie_word_embeddings`` is set to false (the output embeddings are
    written as their own tensor).
    """
    out = dict(config)
    if untie:
        out["tie_word_embeddings"] = False
    archs = out.get("architectures")
    if isinstance(archs, list):
        out["architectures"] = [strip_fsdp_prefix(a) if isinstance(a, str) else a
                                for a in archs]
    fields = [f for f in ("torch_dtype", "dtype") if f in out] or ["torch_dtype"]
    for field in fields:
        out[field] = dtype_name
    return out


def config_bytes(config: dict[str, Any]) -> bytes:
    """The config as transformers writes it: indented JSON, sorted keys, a final newline."""
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
