"""Comparing whole state dicts byte for byte, tensors inside tuples and lists included.

``conftest.assert_same_state`` compares tensors it finds in dicts; a non-tensor entry may
hold tensors too (an optimizer's ``betas=(tensor, tensor)``), and NaN payloads and
complex NaNs must count as equal when their bits are.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, as bytes (works for every dtype)."""
    flat = tensor.contiguous().reshape(-1)
    if flat.element_size() > 1:
        flat = flat.unsqueeze(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def assert_same_deep(got: Any, expected: Any, where: str = "") -> None:
    """Same nesting and types; tensors equal in dtype, shape and bytes; NaNs equal to NaNs."""
    assert type(got) is type(expected), (where, type(got), type(expected))
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_same_deep(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same_deep(g, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert tensor_bytes(got) == tensor_bytes(expected), where
    elif isinstance(expected, (float, complex)):
        parts = [(expected.real, got.real), (expected.imag, got.imag)] \
            if isinstance(expected, complex) else [(expected, got)]
        for e, g in parts:
            assert (math.isnan(e) and math.isnan(g)) or e == g, (where, got, expected)
    else:
        assert got == expected, (where, got, expected)
