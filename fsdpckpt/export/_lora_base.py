"""Base weights for a LoRA fusion from the base model's folder, when the checkpoint has none.

HF Trainer (and Accelerate with ``adapter_only=True``) saves only the adapter tensors under
FSDP; a QLoRA run saves its base weights packed to 4 bits (a bf16 ``[N, 1]`` tensor without
the quantization state). Either way the weights to fuse into are the base model's own
(``--base``: its ``model.safetensors`` or shard index, read through the project's checked
safetensors reader). :func:`with_base` joins them, under the names PEFT's wrapper gives them
(``base_model.model.`` + ``.base_layer.`` for adapted modules), to what the checkpoint holds
that was trained (an adapter-only save: everything it holds, ``modules_to_save`` copies
saved under the module's name included; a QLoRA save: its adapter tensors and its
``modules_to_save`` copies, the base's module then named ``M.original_module.*`` as in PEFT's
model); the fuser then works as on a checkpoint that held everything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp.dtypes import dtype_from_name
from fsdpckpt.errors import ExportMismatchError, NotACheckpointError
from fsdpckpt.export._lora_keys import PEFT_PREFIX, LoraLayout, find_lora
from fsdpckpt.export._lora_read import ModelSource, open_model_source

__all__ = ["JoinedSource", "packed_weights", "with_base"]

_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors")


@dataclass(frozen=True)
class JoinedSource(ModelSource):
    """The base model's tensors, renamed, then the checkpoint's: read in that order.

    Attributes:
        _parts: each source with the map of its names to the joined names.
    """

    _parts: tuple[tuple[ModelSource, dict[str, str]], ...] = ()

    def read(self, want: Callable[[str], bool] | None = None) -> Iterator[tuple[str, Any]]:
        for source, renamed in self._parts:
            for name, tensor in source.read(_wanted(renamed, want)):
                yield renamed[name], tensor


def _wanted(renamed: dict[str, str], want: Callable[[str], bool] | None
            ) -> Callable[[str], bool]:
    # A part's names that the joined source holds and the caller wants (by joined name).
    return lambda name: name in renamed and (want is None or want(renamed[name]))


def packed_weights(source: ModelSource, layout: LoraLayout) -> tuple[str, ...]:
    """The adapted modules' stored base weights that are packed 4-bit data (QLoRA's
    bitsandbytes ``Params4bit``: ``[N, 1]`` holding half a byte per weight), not weights."""
    packed = []
    for module in layout.modules:
        shape = source.shapes.get(module.weight)
        if shape is None or len(shape) != 2 or shape[1] != 1 or module.embedding:
            continue
        a, b = source.shapes[module.lora_a], source.shapes[module.lora_b]
        if _holds_packed(source, module.weight, a[-1] * b[0]):  # in x out features
            packed.append(module.weight)
    return tuple(packed)


def _holds_packed(source: ModelSource, name: str, weights: int) -> bool:
    # ``name`` is stored as ``weights`` 4-bit codes, two to a byte, in an [N, 1] tensor.
    shape, dtype = source.shapes[name], dtype_from_name(source.dtypes[name])
    return (len(shape) == 2 and shape[1] == 1 and dtype is not None and weights > 1
            and shape[0] * dtype.itemsize * 2 == weights)


def _weights_file(base: Place) -> Place:
    if base.is_file():
        return base
    for name in _WEIGHT_FILES:
        if (base / name).is_file():
            return base / name
    raise NotACheckpointError(f"{base}: holds no model.safetensors (nor its index); pass "
                              "base=... the Hugging Face folder the run started from")


def _copied_modules(layout: LoraLayout) -> tuple[str, ...]:
    # The modules a full save holds trained copies of (``M.modules_to_save.<adapter>.*``).
    marker = ".modules_to_save."
    return tuple(dict.fromkeys(k.partition(marker)[0] for k in layout.adapter_keys
                               if marker in k))


def _peft_name(name: str, copied: tuple[str, ...]) -> str:
    # PEFT's name of a base tensor: a module with a modules_to_save copy keeps its frozen
    # original as ``M.original_module.*``, which the fused model drops for the trained copy
    # (without the rename both would become ``M.*``, the same name twice).
    for module in copied:
        if name.startswith(module + "."):
            return f"{module}.original_module.{name[len(module) + 1:]}"
    return name


def with_base(source: ModelSource, layout: LoraLayout, base: Place | None) -> ModelSource:
    """``source`` itself when it holds every adapted module's base weight as weights; else
    the base model's tensors (from ``base``) joined to what ``source`` holds that was trained.

    Raises:
        NotACheckpointError: base weights are needed and ``base`` is None, or holds no
            safetensors weights.
        ExportMismatchError: the base model lacks an adapted module's weight, a tensor
            the checkpoint holds has another shape in the base model, or two tensors would
            get one name in the fused model.
    """
    packed = packed_weights(source, layout)
    if not layout.without_base and not packed:
        return source
    what = (f"holds LoRA adapters without base weights ({layout.without_base[0]}...)"
            if layout.without_base else f"holds its base weights packed to 4 bits "
            f"({packed[0]} is {list(source.shapes[packed[0]])})")
    if base is None:
        raise NotACheckpointError(f"{source.path}: {what}; pass base=... the full-precision "
                                  "Hugging Face folder the run started from to fuse into, or "
                                  "export the adapter with lora='adapter'")
    model = open_model_source(_weights_file(base))
    adapted = {f"{m.name}.{kind}": f"{m.stored}.base_layer.{kind}" for m in layout.modules
               for kind in ("weight", "bias")}
    copied = _copied_modules(layout)
    from_base = {n: adapted.get(n) or _peft_name(PEFT_PREFIX + n, copied) for n in model.names}
    stored_base = set(from_base.values())
    missing = [m for m in layout.modules if m.weight not in stored_base]
    if missing:
        raise ExportMismatchError(f"{base}: has no {missing[0].weight.removeprefix(PEFT_PREFIX)} "
                                  f"(the base weight of {missing[0].name}); pass base=... the "
                                  "model this adapter was trained on")
    shapes = {from_base[n]: model.shapes[n] for n in model.names}
    dtypes = {from_base[n]: model.dtypes[n] for n in model.names}
    # From the checkpoint only what was trained: an adapter-only save holds nothing else
    # (a modules_to_save copy is saved under the module's name); of a QLoRA save, whose
    # frozen base is packed, the adapter tensors and modules_to_save copies.
    trained = set(layout.adapter_keys)
    kept = [n for n in source.names if layout.without_base or n in trained]
    _check_shapes(source, layout, shapes, trained, base)
    taken = set(kept)
    from_base = {n: s for n, s in from_base.items() if s not in taken}
    shapes.update({n: source.shapes[n] for n in kept})
    dtypes.update({n: source.dtypes[n] for n in kept})
    names = (*from_base.values(), *kept)
    joined = JoinedSource(source.path, names, shapes, dtypes, {},
                          _parts=((model, from_base), (source, {n: n for n in kept})))
    _one_tensor_per_name(find_lora(joined.names), base)  # the joined names: one PEFT model's
    return joined


def _check_shapes(source: ModelSource, layout: LoraLayout, shapes: dict[str, Any],
                  trained: set[str], base: Place) -> None:
    # A --base of the same architecture but another size has every name: compare what the
    # checkpoint holds unpacked (embeddings, norms...) and what each adapter was trained on,
    # before the fuser meets the sizes in a matmul.
    for name in source.names:
        if name in trained or name not in shapes or source.shapes[name] == shapes[name]:
            continue
        # Every Linear the run quantized is packed, adapted or not: its size is checked
        # against the base's (the codes of its weights), not its shape.
        if not _holds_packed(source, name, math.prod(shapes[name])):
            raise ExportMismatchError(f"{source.path}: {name} is {list(source.shapes[name])} "
                                      f"but {list(shapes[name])} in {base}; pass base=... the "
                                      "model this run trained")
    for m in layout.modules:
        a, b, weight = source.shapes[m.lora_a], source.shapes[m.lora_b], shapes[m.weight]
        if not len(weight) == len(a) == len(b) == 2:
            continue  # a convolution's adapter: its kernel shapes are the fuser's to check
        # in x out weights whichever way the weight is laid out (fan_in_fan_out, embeddings)
        if sorted(weight) != sorted((a[1], b[0])):
            raise ExportMismatchError(f"{base}: {m.name}.weight is "
                                      f"{list(weight)}, but {m.name}'s adapter (lora_A "
                                      f"{list(a)}, lora_B {list(b)}) was trained on "
                                      f"{b[0]} x {a[1]} weights; pass base=... the model "
                                      "this run trained")


def _one_tensor_per_name(layout: LoraLayout, base: Place) -> None:
    # Two joined tensors that the fused model names alike would give a file naming a tensor
    # twice, which safetensors readers refuse: refuse it here, naming both.
    for adapter in layout.adapters:
        seen: dict[str, str] = {}
        for name in (*layout.base_keys, *layout.adapter_keys):
            plain = layout.plain_name(name, adapter)
            if plain is None:
                continue
            if plain in seen:
                raise ExportMismatchError(f"{base}: {seen[plain]} and {name} would both be "
                                          f"written as {plain}; pass base=... the model this "
                                          "run trained, as save_pretrained wrote it")
            seen[plain] = name
