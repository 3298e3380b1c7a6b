"""Which tensors of a PEFT-wrapped model's state dict are LoRA adapters, and their names.

A PEFT LoRA model trained with FSDP saves names such as::

    base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight  (DoRA)
    base_model.model.lm_head.modules_to_save.default.weight   (modules_to_save)
    base_model.model.lm_head.original_module.weight

HF Trainer and Accelerate (``adapter_only=True``) save ``get_peft_model_state_dict`` instead:
the adapter tensors alone, adapter name dropped (``...q_proj.lora_A.weight``), as PEFT's
adapter file names them; these are read as adapter ``default`` with no base weights.

:func:`find_lora` reads the names alone (no tensor data) and says which modules carry
adapters; a :class:`LoraLayout` renames keys for the two outputs: PEFT's adapter file
(adapter name dropped, ``base_model.model.`` kept) and the plain model (both dropped,
``.base_layer`` too). Pure functions, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from fsdpckpt.errors import NotACheckpointError

__all__ = ["DEFAULT_ADAPTER", "PEFT_PREFIX", "LoraLayout", "LoraModule", "find_lora",
           "refuse_unasked"]

#: What PEFT's wrapper puts before every name of the wrapped model.
PEFT_PREFIX = "base_model.model."

_ADAPTER = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B"
                      r"|lora_magnitude_vector|modules_to_save)\.(?P<adapter>[^.]+)"
                      r"(?P<rest>(\..+)?)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<rest>.+)$")
# The adapter name dropped, as get_peft_model_state_dict names them (what HF Trainer and
# Accelerate save under FSDP with adapter_only=True, and PEFT's adapter file holds).
_DROPPED = re.compile(r"^(?P<module>.+)\.(?:(?P<kind>lora_A|lora_B)\.(?P<rest>weight|bias)"
                      r"|(?P<bare>lora_embedding_A|lora_embedding_B|lora_magnitude_vector))$")
#: The adapter name PEFT loads an adapter file without names into.
DEFAULT_ADAPTER = "default"


def _adapter_match(name: str) -> tuple[str, str, str, str, bool] | None:
    """``(module, kind, adapter, rest, dropped)`` of an adapter tensor's name, or None."""
    dropped = _DROPPED.match(name)
    if dropped is not None:
        if dropped["bare"]:
            rest = ".weight" if dropped["bare"] == "lora_magnitude_vector" else ""
            return dropped["module"], dropped["bare"], DEFAULT_ADAPTER, rest, True
        return dropped["module"], dropped["kind"], DEFAULT_ADAPTER, "." + dropped["rest"], True
    match = _ADAPTER.match(name)
    if match is None:
        return None
    return match["module"], match["kind"], match["adapter"], match["rest"], False


@dataclass(frozen=True)
class LoraModule:
    """One module that carries a LoRA adapter.

    Attributes:
        name: the module's name in the plain model (``model.layers.0.self_attn.q_proj``),
            as ``rank_pattern``/``alpha_pattern`` match it.
        stored: its name as stored (``base_model.model.model.layers.0.self_attn.q_proj``).
        adapter: the adapter name (``default``).
        embedding: an ``nn.Embedding`` adapter (``lora_embedding_A/B``, no ``.weight``).
        weight: the stored name of the base weight (``....base_layer.weight``).
        lora_a, lora_b: the stored names of A (``r x in``) and B (``out x r``).
        magnitude: DoRA's magnitude vector, or None.
        lora_b_bias: ``lora_B``'s bias (PEFT's ``lora_bias``), or None.
        bias: the stored name of the base bias, or None.
    """

    name: str
    stored: str
    adapter: str
    embedding: bool
    weight: str
    lora_a: str
    lora_b: str
    magnitude: str | None = None
    lora_b_bias: str | None = None
    bias: str | None = None

    @property
    def adapter_keys(self) -> tuple[str, ...]:
        """The stored names of this module's adapter tensors."""
        keys = (self.lora_a, self.lora_b, self.magnitude, self.lora_b_bias)
        return tuple(k for k in keys if k is not None)


@dataclass(frozen=True)
class LoraLayout:
    """The LoRA structure of a state dict, from its names.

    Attributes:
        modules: every adapted module (one entry per module and adapter), in stored order.
        adapters: the adapter names found (``("default",)``).
        adapter_keys: every stored name that belongs to an adapter (A, B, magnitudes,
            ``modules_to_save`` copies), in stored order.
        base_keys: every other stored name (the base model, ``original_module`` copies included).
        without_base: the stored names of adapted modules whose base weight the names do
            not hold (HF Trainer's adapter-only FSDP saves hold none).
    """

    modules: tuple[LoraModule, ...]
    adapters: tuple[str, ...]
    adapter_keys: tuple[str, ...]
    base_keys: tuple[str, ...]
    without_base: tuple[str, ...] = ()

    def module_of(self, stored: str) -> LoraModule | None:
        """The adapted module whose base weight is ``stored``, or None."""
        return self._by_weight.get(stored)

    @property
    def _by_weight(self) -> dict[str, LoraModule]:
        found = self.__dict__.get("_weights")
        if found is None:
            found = {m.weight: m for m in self.modules}
            object.__setattr__(self, "_weights", found)
        return found

    def adapter_file_name(self, stored: str, adapter: str) -> str | None:
        """The name PEFT's ``save_pretrained`` gives ``stored`` in ``adapter_model.safetensors``
        (adapter name dropped; DoRA's magnitude without ``.weight``), or None when it is
        not part of ``adapter``."""
        match = _adapter_match(stored)
        if match is None or match[2] != adapter:
            return None
        module, kind, _, rest, dropped = match
        if dropped:  # already named as PEFT's adapter file names it
            return stored
        if kind == "modules_to_save":  # the copy is saved under the module's name
            return f"{module}{rest}"
        if kind == "lora_magnitude_vector" and rest == ".weight":
            rest = ""
        return f"{module}.{kind}{rest}"

    def plain_name(self, stored: str, adapter: str) -> str | None:
        """The name of ``stored`` in the plain model once ``adapter`` is fused in, or None
        when the fused model does not hold it (adapter tensors, ``original_module`` copies
        of a ``modules_to_save`` module)."""
        match = _adapter_match(stored)
        if match is not None:
            module, kind, found, rest, _ = match
            if kind != "modules_to_save" or found != adapter:
                return None
            stored = f"{module}{rest}"
        else:
            original = _ORIGINAL.match(stored)
            if original is not None and self._saves(original["module"], adapter):
                return None
        name = stored.removeprefix(PEFT_PREFIX)
        return name.replace(".base_layer.", ".")

    def _saves(self, module: str, adapter: str) -> bool:
        prefix = f"{module}.modules_to_save.{adapter}."
        return any(k.startswith(prefix) for k in self.adapter_keys)


def find_lora(names: Iterable[str]) -> LoraLayout:
    """The LoRA structure of a state dict, from its tensor names alone.

    Args:
        names: the model's state-dict names (the top-level key and wrapper segments
            already dropped, as ``fsdpckpt merge`` names them).

    Returns:
        The :class:`LoraLayout`; ``modules`` is empty when nothing is a LoRA adapter.

    Raises:
        NotACheckpointError: an adapter lacks its other half (``lora_A`` without
            ``lora_B``). A missing base weight is not an error here (``without_base``).
    """
    names = list(names)
    present = set(names)
    parts: dict[tuple[str, str], dict[str, str]] = {}
    adapters: dict[str, None] = {}
    adapter_keys: list[str] = []
    for name in names:
        match = _adapter_match(name)
        if match is None:
            continue
        module, kind, adapter, rest, _ = match
        adapter_keys.append(name)
        adapters[adapter] = None
        if kind == "modules_to_save":
            continue
        slot = kind.replace("lora_embedding_", "lora_") + ("_bias" if rest == ".bias" else "")
        parts.setdefault((module, adapter), {})[slot] = name
        if kind.startswith("lora_embedding"):
            parts[(module, adapter)]["embedding"] = "1"
    modules = []
    for (stored, adapter), found in parts.items():
        where = f"{stored} (adapter '{adapter}')"
        if "lora_A" not in found or "lora_B" not in found:
            missing = "lora_A" if "lora_A" not in found else "lora_B"
            raise NotACheckpointError(f"{where}: has no {missing}; the checkpoint holds half a "
                                      "LoRA adapter")
        # A missing base weight (an adapter-only save) is the fuser's to refuse: the
        # adapter export needs none, and fusion may take it from the base model.
        weight = f"{stored}.base_layer.weight"
        bias = f"{stored}.base_layer.bias"
        modules.append(LoraModule(
            name=stored.removeprefix(PEFT_PREFIX), stored=stored, adapter=adapter,
            embedding="embedding" in found, weight=weight, lora_a=found["lora_A"],
            lora_b=found["lora_B"], magnitude=found.get("lora_magnitude_vector"),
            lora_b_bias=found.get("lora_B_bias"), bias=bias if bias in present else None))
    taken = set(adapter_keys)
    return LoraLayout(tuple(modules), tuple(adapters), tuple(adapter_keys),
                      tuple(n for n in names if n not in taken),
                      tuple(m.stored for m in modules if m.weight not in present))


def refuse_unasked(names: Iterable[str], where: object) -> None:
    """Raise when ``names`` are a PEFT model's with LoRA adapters: a plain export of them
    would not be the model (adapter tensors and ``base_layer`` names match no model class).
    Names that only look like adapters (no ``base_model.model.`` wrapper, half an adapter)
    are left to the plain export.

    Raises:
        NotACheckpointError: naming the adapters and the two ways to export them.
    """
    try:
        layout = find_lora(names)
    except NotACheckpointError:
        return
    modules = [m for m in layout.modules if m.stored.startswith(PEFT_PREFIX)]
    if modules:
        held = ", ".join(f"'{a}'" for a in dict.fromkeys(m.adapter for m in modules))
        raise NotACheckpointError(
            f"{where}: holds LoRA adapters ({len(modules)} adapted modules, adapter "
            f"{held}) and is not a plain model; pass lora='adapter' to export the adapter or "
            "lora='fuse' to fuse it into the base weights")
