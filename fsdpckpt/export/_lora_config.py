"""A PEFT LoRA adapter's configuration (``adapter_config.json``), read and checked.

The file is plain JSON, read with :mod:`fsdpckpt._io.jsonio` (depth-bounded, one error
naming the file). Only the fields the fused weights depend on are checked and kept as
typed values; the whole document is kept as it was, so that an exported adapter
carries the same file PEFT wrote.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fsdpckpt._io.jsonio import loads_json
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LoraConfig", "parse_lora_config",
           "read_lora_config"]

#: The file PEFT's ``save_pretrained`` writes beside the adapter weights.
ADAPTER_CONFIG = "adapter_config.json"
#: The adapter's weights, as PEFT's ``save_pretrained`` names them (safetensors).
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# adapter_config.json of a large model is a few KB; anything this big is not one.
_MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class LoraConfig:
    """The fields of a LoRA ``adapter_config.json`` that fusion depends on.

    Attributes:
        r: the default rank.
        lora_alpha: the default alpha.
        target_modules: module names or a regex, as PEFT keeps them (informative).
        use_rslora: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``.
        use_dora: the adapters are DoRA (a magnitude vector per module).
        fan_in_fan_out: the base weights are stored transposed (GPT-2's Conv1D).
        rank_pattern, alpha_pattern: per-module overrides of ``r`` and ``lora_alpha``,
            keyed by a module-name pattern (PEFT's matching rule).
        raw: the whole document, as read.
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None = None
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def rank_of(self, module: str) -> int:
        """The rank PEFT gives ``module`` (its name in the plain model, e.g.
        ``model.layers.0.self_attn.q_proj``): ``rank_pattern`` first, else ``r``."""
        key = _pattern_key(self.rank_pattern, module)
        return self.r if key is None else self.rank_pattern[key]

    def alpha_of(self, module: str) -> float:
        """The alpha PEFT gives ``module``: ``alpha_pattern`` first, else ``lora_alpha``."""
        key = _pattern_key(self.alpha_pattern, module)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scaling_of(self, module: str, rank: int | None = None) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, for ``module``.

        Args:
            module: the module's name in the plain model.
            rank: the rank the stored adapter has (its ``lora_A`` rows); by default the
                configured one.
        """
        r = self.rank_of(module) if rank is None else rank
        alpha = self.alpha_of(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The pattern of ``patterns`` that names ``module``, as PEFT's ``get_pattern_key``
    picks it: a pattern matches when the module name ends with it at a dot boundary
    (``(.*\\.)?PATTERN$``); the first such pattern in the file's order wins."""
    for pattern in patterns:
        try:
            if re.match(rf"(.*\.)?({pattern})$", module):
                return pattern
        except re.error:  # checked when the config was read; a plain name then
            if module == pattern or module.endswith("." + pattern):
                return pattern
    return None


def _field_error(source: str, name: str, want: str, value: Any) -> NotACheckpointError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return NotACheckpointError(f"{source}: field '{name}' must be {want}, not {shown}; fix the "
                               "adapter config or pass another as lora_config=")


def _positive_int(doc: Mapping[str, Any], name: str, source: str) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _field_error(source, name, "a positive integer", value)
    return value


def _number(value: Any, name: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _field_error(source, name, "a finite number", value)
    return float(value)


def _flag(doc: Mapping[str, Any], name: str, source: str) -> bool:
    value = doc.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _field_error(source, name, "true or false", value)
    return value


def _pattern_map(doc: Mapping[str, Any], name: str, source: str, *,
                 ints: bool) -> dict[str, Any]:
    value = doc.get(name) or {}
    if not isinstance(value, dict):
        raise _field_error(source, name, "an object of module patterns to numbers", value)
    out: dict[str, Any] = {}
    for pattern, number in value.items():
        where = f"{name}.{pattern}"
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _field_error(source, name, f"module patterns ({exc})", pattern) from None
        if ints:
            if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
                raise _field_error(source, where, "a positive integer", number)
            out[pattern] = number
        else:
            out[pattern] = _number(number, where, source)
    return out


def parse_lora_config(doc: Any, *, source: str = ADAPTER_CONFIG) -> LoraConfig:
    """Check an adapter config document and keep what fusion needs.

    Args:
        doc: the parsed ``adapter_config.json``.
        source: where it came from, for messages.

    Raises:
        NotACheckpointError: not a LoRA config, or a field has a wrong type or value;
            the message names the field.
    """
    if not isinstance(doc, dict):
        raise NotACheckpointError(f"{source}: not an adapter config (a JSON object)")
    peft_type = doc.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _field_error(source, "peft_type", '"LORA" (other PEFT methods are not fused)',
                           peft_type)
    targets = doc.get("target_modules")
    if isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            raise _field_error(source, "target_modules", "a list of module names or a regex",
                               targets)
        targets = tuple(targets)
    elif targets is not None and not isinstance(targets, str):
        raise _field_error(source, "target_modules", "a list of module names or a regex",
                           targets)
    if "lora_alpha" not in doc:
        raise _field_error(source, "lora_alpha", "a finite number", None)
    return LoraConfig(
        r=_positive_int(doc, "r", source),
        lora_alpha=_number(doc["lora_alpha"], "lora_alpha", source),
        target_modules=targets,
        use_rslora=_flag(doc, "use_rslora", source),
        use_dora=_flag(doc, "use_dora", source),
        fan_in_fan_out=_flag(doc, "fan_in_fan_out", source),
        rank_pattern=_pattern_map(doc, "rank_pattern", source, ints=True),
        alpha_pattern=_pattern_map(doc, "alpha_pattern", source, ints=False),
        raw=dict(doc),
    )


def read_lora_config(path: str | os.PathLike[str] | RemotePath, *,
                     storage_options: dict[str, Any] | None = None) -> LoraConfig:
    """Read ``adapter_config.json`` (the file, or a folder holding it), local or on object
    storage (``storage_options``: the fsspec filesystem's, for a URL).

    Raises:
        CheckpointNotFoundError: no such file.
        CorruptCheckpointError: not JSON.
        NotACheckpointError: not a LoRA config; a field is wrong (named).
    """
    p = location(path, storage_options=storage_options)
    if p.is_dir():
        p = p / ADAPTER_CONFIG
    if not p.is_file():
        raise CheckpointNotFoundError(f"{p}: no such file; pass the adapter_config.json the "
                                      "run's PEFT model wrote as lora_config=")
    size = p.stat().st_size  # checked before a byte is read
    if size > _MAX_CONFIG_BYTES:
        raise NotACheckpointError(f"{p}: {size} bytes is too large for an "
                                  "adapter config; pass the adapter_config.json PEFT wrote")
    return parse_lora_config(loads_json(p.read_bytes(), source=str(p)), source=str(p))
