"""Every state-equality check the tests make, in one place.

Each function keeps the strictness its callers were written with, and says it: tensors
compared bit for bit (dtype, shape and bytes; NaN payloads and -0.0 count) or by value
(``torch.equal``: NaN is never equal, -0.0 equals 0.0); nesting compared by type all the way
down, or by dicts only; dict keys as a set or in order. A test picks the strictness by the
function and its keywords, not by writing its own copy.

- :func:`same_tensor`, :func:`assert_same_tensors`: tensors, and flat ``{name: tensor}`` maps.
- :func:`assert_same_state`: nested state dicts, flattened to key paths (merges, loads).
- :func:`assert_same_deep`: nested values whose non-dict entries may hold tensors too (an
  optimizer's ``betas=(tensor, tensor)``), NaNs and complex NaNs equal when their bits are.
- :func:`same_value`: plain values (the object codec), type-exact, signed zeros apart.
- :func:`assert_same_numpy_state`, :func:`assert_same_rng`: random-number generator states.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

# --- tensors --------------------------------------------------------------------------------


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in row-major order, as a flat uint8 tensor (any dtype)."""
    flat = tensor.contiguous().reshape(-1)
    if flat.element_size() > 1:
        flat = flat.unsqueeze(-1)
    return flat.view(torch.uint8).reshape(-1)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, as bytes (works for every dtype)."""
    return _as_bytes(tensor).numpy().tobytes()


def same_tensor(got: Any, want: torch.Tensor, *, bitwise: bool = True,
                shape: bool = True) -> bool:
    """``got`` is a tensor equal to ``want``.

    ``bitwise``: the same dtype, the same shape (unless ``shape=False``: only the elements in
    row-major order count) and the same bytes. Otherwise ``torch.equal``: the same size and
    equal values.
    """
    if not isinstance(got, torch.Tensor):
        return False
    if not bitwise:
        return torch.equal(got, want)
    return got.dtype == want.dtype and (not shape or got.shape == want.shape) \
        and torch.equal(_as_bytes(got), _as_bytes(want))


def assert_same_tensors(got: Mapping[str, Any], want: Mapping[str, torch.Tensor], *,
                        keys: str = "same", bitwise: bool = True, shape: bool = True) -> None:
    """Flat ``{name: tensor}`` maps: each of ``want``'s tensors equal (:func:`same_tensor`)
    to ``got``'s of the same name. ``keys="same"``: the same names, in any order;
    ``keys="expected"``: ``got`` may hold more."""
    if keys == "same":
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
    else:
        assert keys == "expected", keys
    for name, tensor in want.items():
        assert same_tensor(got[name], tensor, bitwise=bitwise, shape=shape), name


# --- nested state dicts ---------------------------------------------------------------------


def flatten(tree, prefix=()) -> dict:
    """``{key_path: leaf}`` of a nested dict/list state dict (tensors and plain values)."""
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in tree) \
        else None
    if items is None:
        return {prefix: tree}
    for key, value in items:
        out.update(flatten(value, prefix + (key,)))
    return out


def assert_same_state(got, expected) -> None:
    """Equal nesting (as key paths: :func:`flatten`), every tensor equal byte for byte
    (dtype and shape included), every other leaf equal and of the same type."""
    got_flat, expected_flat = flatten(got), flatten(expected)
    assert got_flat.keys() == expected_flat.keys()
    for key, value in expected_flat.items():
        if isinstance(value, torch.Tensor):
            assert same_tensor(got_flat[key], value), key
        else:
            assert got_flat[key] == value and type(got_flat[key]) is type(value), key


def assert_same_deep(got: Any, expected: Any, where: str = "", *,
                     dicts_only: bool = False, ordered: bool = False) -> None:
    """Same nesting and types; tensors equal in dtype, shape and bytes; NaNs equal to NaNs.

    ``dicts_only``: look inside dicts and tensors only (``got`` need only be a dict where
    ``expected`` is one), and compare every other value with ``==`` (so NaN is not equal).
    ``ordered``: each dict's keys in the same order.
    """
    if dicts_only:
        if isinstance(expected, dict):
            assert isinstance(got, dict), where
        elif isinstance(expected, torch.Tensor):
            assert same_tensor(got, expected), where
            return
        else:
            assert got == expected, where
            return
    else:
        assert type(got) is type(expected), (where, type(got), type(expected))
    if isinstance(expected, dict):
        assert (list(got) == list(expected)) if ordered else got.keys() == expected.keys(), where
        for key in expected:
            assert_same_deep(got[key], expected[key], f"{where}.{key}", dicts_only=dicts_only,
                             ordered=ordered)
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same_deep(g, e, f"{where}[{i}]", ordered=ordered)
    elif isinstance(expected, torch.Tensor):
        assert same_tensor(got, expected), where
    elif isinstance(expected, (float, complex)):
        parts = [(expected.real, got.real), (expected.imag, got.imag)] \
            if isinstance(expected, complex) else [(expected, got)]
        for e, g in parts:
            assert (math.isnan(e) and math.isnan(g)) or e == g, (where, got, expected)
    else:
        assert got == expected, (where, got, expected)


# --- plain values ---------------------------------------------------------------------------


def same_value(got, expected) -> bool:
    """Equal, of the same type all the way down (1 is not True, a tuple is not a list), dict
    keys in the same order, -0.0 apart from 0.0, with NaN equal to itself."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, float):
        return got == expected and math.copysign(1, got) == math.copysign(1, expected) \
            or (math.isnan(got) and math.isnan(expected))
    if isinstance(expected, complex):
        return same_value(got.real, expected.real) and same_value(got.imag, expected.imag)
    if isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(map(same_value, got, expected))
    if isinstance(expected, dict):
        return list(got) == list(expected) and all(
            type(a) is type(b) and same_value(got[a], expected[b])
            for a, b in zip(got, expected))
    return got == expected


# --- random-number generator states ---------------------------------------------------------


def assert_same_numpy_state(got, expected, *, bitwise: bool = True) -> None:
    """numpy's legacy ``get_state()`` tuples. ``bitwise``: the key array a uint32 array of
    624 with the same bytes, every other field equal. Otherwise field by field, arrays with
    ``np.array_equal`` (values)."""
    import numpy as np

    if bitwise:
        assert got[0] == expected[0] and got[2:] == expected[2:]
        assert got[1].dtype == np.uint32 and got[1].shape == (624,)
        assert got[1].tobytes() == expected[1].tobytes()
    else:
        assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                   for a, b in zip(got, expected))


def assert_same_rng(got, expected) -> None:
    """``(random.getstate(), np.random.get_state(), torch.get_rng_state())`` triples, by value."""
    assert got[0] == expected[0]
    assert_same_numpy_state(got[1], expected[1], bitwise=False)
    assert same_tensor(got[2], expected[2], bitwise=False)
