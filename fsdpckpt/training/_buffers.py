"""Non-persistent buffers after ``load_pretrained``: what the model's own initialization gives.

A weight file holds no non-persistent buffer (a rotary embedding's ``inv_freq``, Gemma's
``embed_scale``): ``from_pretrained`` recomputes them (transformers' ``_init_weights``), but
a model built on the meta device and ``to_empty()``d holds whatever memory held, and a
load that left them so gave a silently different model (issue 33: loss 4.925900 against
4.925730). So each such buffer is recomputed the way transformers does it, by the
``_init_weights`` of the Hugging Face model that holds it, or the load is refused, naming
the buffer and the fix.

Whether ``_init_weights`` recomputes a buffer is found on two stand-ins of its module, never
on the model: one with the buffer filled with zeros, one with ones, parameters on the meta
device (nothing allocated, nothing loaded changed). A buffer both stand-ins end with the
same bytes of is recomputed from the config alone; that value is what the load puts in the
model's buffer, after the weights, on every rank alike (buffers are not sharded).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from fsdpckpt.errors import OptionError, StateMismatchError

__all__ = ["BUFFER_MODES", "Recomputed", "recompute_buffers"]

#: ``init``: each non-persistent buffer as the model's initialization gives it (refused
#: where none can be recomputed); ``keep``: left as the model holds it.
BUFFER_MODES = ("init", "keep")


@dataclass(frozen=True)
class Recomputed:
    """The non-persistent buffers to set after a load: ``(the model's buffer, its value)``."""

    values: tuple[tuple[Any, Any], ...] = ()

    def apply(self) -> None:
        import torch

        with torch.no_grad():
            for buffer, value in self.values:
                buffer.copy_(value)


def recompute_buffers(model: Any, mode: str, shapes: dict[str, tuple[int, ...]]) -> Recomputed:
    """The value of every non-persistent buffer of ``model``, as its initialization gives it.

    ``shapes``: each parameter's whole shape by its state-dict name (an FSDP1 rank's own
    view of a parameter it holds no shard of is empty; the stand-ins need the real shape).

    Raises:
        OptionError: ``mode`` is not one of :data:`BUFFER_MODES`.
        StateMismatchError: with ``init``, a buffer no ``_init_weights`` recomputes; the
            message names each and says how to load anyway.
    """
    if mode not in BUFFER_MODES:
        raise OptionError(f"buffers={mode!r}: use 'init' (each non-persistent buffer as the "
                          "model's initialization gives it) or 'keep' (left as it is)")
    if mode == "keep":
        return Recomputed()
    values, lost = [], []
    for name, module, owner in _holders(model):
        names = [n for n in module._non_persistent_buffers_set
                 if module._buffers.get(n) is not None]
        got = _recomputed(owner, module, names, name, shapes) if owner is not None else {}
        for buffer_name in names:
            value = got.get(buffer_name)
            if value is None:
                lost.append((f"{name}.{buffer_name}" if name else buffer_name, module))
            else:
                values.append((module._buffers[buffer_name], value))
    if lost:
        listed = ", ".join(f"'{n}' ({type(m).__name__})" for n, m in lost[:8])
        more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
        raise StateMismatchError(
            f"the model's non-persistent buffers {listed}{more} are in no weight file, and no "
            "Hugging Face initialization recomputes them: after to_empty() they hold whatever "
            "memory held. Nothing was loaded. Build the model with its buffers (not on the meta "
            "device, or set them yourself) and pass buffers='keep'.")
    return Recomputed(tuple(values))


def _holders(model: Any) -> list[tuple[str, Any, Any]]:
    """``(name, module, the Hugging Face model over it or None)`` for each module holding a
    non-persistent buffer; the Hugging Face model is the nearest one at or above it."""
    owners: dict[str, Any] = {}
    found = []
    for name, module in model.named_modules():
        parent = owners.get(name.rpartition(".")[0]) if name else None
        owner = module if _is_hf_model(module) else parent
        owners[name] = owner
        if any(module._buffers.get(n) is not None for n in module._non_persistent_buffers_set):
            found.append((name, module, owner))
    return found


def _is_hf_model(module: Any) -> bool:
    return callable(getattr(module, "_init_weights", None)) and \
        getattr(module, "config", None) is not None


def _recomputed(owner: Any, module: Any, names: list[str], where: str,
                shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The buffers ``names`` of ``module`` that ``owner._init_weights`` sets from the config
    alone: equal after it on a stand-in filled with zeros and one filled with ones."""
    import torch

    outcomes = []
    for fill in (0, 1):
        stand_in = _stand_in(module, names, fill, where, shapes)
        try:
            with torch.no_grad():
                owner._init_weights(stand_in)
        except Exception:  # noqa: BLE001 - an init that cannot run here recomputes nothing
            return {}
        outcomes.append(stand_in._buffers)
    got = {}
    for name in names:
        zero, one = outcomes[0].get(name), outcomes[1].get(name)
        buffer = module._buffers[name]
        if isinstance(zero, torch.Tensor) and isinstance(one, torch.Tensor) and \
                zero.device.type != "meta" and tuple(zero.shape) == tuple(buffer.shape) and \
                tuple(one.shape) == tuple(buffer.shape) and _same_bytes(zero, one):
            got[name] = zero
    return got


def _stand_in(module: Any, names: list[str], fill: int, where: str,
              shapes: dict[str, tuple[int, ...]]) -> Any:
    """A shallow copy of ``module`` (named ``where`` in the model) whose parameters (their
    whole shapes) and other buffers are on the meta device and whose buffers ``names`` are
    new tensors on the CPU filled with ``fill``."""
    import torch

    from fsdpckpt.merging._keys import clean_key

    stand_in = copy.copy(module)
    stand_in._parameters = {
        k: None if p is None else torch.nn.Parameter(torch.empty(
            shapes.get(clean_key(f"{where}.{k}"), tuple(p.shape)), dtype=p.dtype,
            device="meta"), p.requires_grad)
        for k, p in module._parameters.items()}
    stand_in._buffers = {
        k: None if b is None else
        torch.full(tuple(b.shape), fill, dtype=b.dtype) if k in names else
        torch.empty(tuple(b.shape), dtype=b.dtype, device="meta")
        for k, b in module._buffers.items()}
    return stand_in


def _same_bytes(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype:
        return False
    flat_a, flat_b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.dtype == torch.bool:
        return bool(torch.equal(flat_a, flat_b))
    return bool(torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8)))
