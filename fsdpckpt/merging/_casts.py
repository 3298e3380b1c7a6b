"""The common export casts without importing torch: fp32 -> bf16, fp32 -> fp16, bf16 -> fp32.

``import torch`` takes 1.5-3 s here, longer than merging a 1.6 GB model, so a
``--dtype bf16`` export that imported torch could never be close to a plain merge.
When numpy is installed (it is wherever transformers or accelerate are), these
casts are done with its integer arithmetic instead, exactly as torch's own CPU
kernels do them: round to nearest, ties to even, overflow to infinity, subnormals
kept. NaN is the one value whose bits differ between torch's own code paths
(0xFFFF from its vector kernel, 0x7FC0 from its scalar one), so a block holding
any NaN is left to torch itself (the fast cast returns False). A test checks
all 2^32 float32 bit patterns against torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from fsdpckpt import _torch
from fsdpckpt._io.rawio import release_scratch, scratch
from fsdpckpt.dcp.dtypes import DTYPES

__all__ = ["fast_cast", "cast_block", "import_torch"]

_Cast = Callable[[memoryview, memoryview], bool]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # an optional speed-up: torch does the work without it
        return None
    return numpy


def _work(np: Any, count: int, slot: str, dtype: Any) -> Any:
    # In-place arithmetic in pooled buffers: numpy's own temporaries would be fresh
    # 16 MiB allocations per block, each paid for again in page faults.
    return np.frombuffer(scratch(count * np.dtype(dtype).itemsize, slot), dtype=dtype)


def _nan_free_magnitudes(np: Any, bits: Any) -> Any:
    """``bits & 0x7FFFFFFF`` in a pooled buffer, or None when a float32 in ``bits`` is NaN."""
    magnitude = _work(np, len(bits), "cast-work", np.uint32)
    np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=magnitude)
    return None if len(bits) and magnitude.max() > 0x7F800000 else magnitude


def _fp32_to_bf16(np: Any) -> _Cast:
    u32 = np.uint32

    def cast(src: memoryview, dst: memoryview) -> bool:
        bits = np.frombuffer(src, dtype=u32)
        work = _nan_free_magnitudes(np, bits)
        if work is None:
            return False
        # c10's round_to_nearest_even: add 0x7FFF plus the lowest kept bit, keep the top half.
        np.right_shift(bits, u32(16), out=work)
        np.bitwise_and(work, u32(1), out=work)
        np.add(work, u32(0x7FFF), out=work)
        np.add(work, bits, out=work)
        np.right_shift(work, u32(16), out=work)
        np.copyto(np.frombuffer(dst, dtype=np.uint16), work, casting="unsafe")
        return True

    return cast


def _bf16_to_fp32(np: Any) -> _Cast:
    def cast(src: memoryview, dst: memoryview) -> bool:
        bits = np.frombuffer(src, dtype=np.uint16)
        work = _work(np, len(bits), "cast-work", np.uint16)
        np.bitwise_and(bits, np.uint16(0x7FFF), out=work)
        if len(bits) and work.max() > 0x7F80:
            return False
        out = np.frombuffer(dst, dtype=np.uint32)
        np.copyto(out, bits, casting="unsafe")
        np.left_shift(out, np.uint32(16), out=out)  # bf16 is a float32's top half: exact
        return True

    return cast


#: float32 magnitudes numpy converts to float16 at full speed: zero, and those whose half is
#: normal and finite (below 2**-14 or past 65504's rounding its loop is 40x slower).
_HALF_NORMAL = (0x38800000, 0x477FEFFF)


def _fp32_to_fp16(np: Any) -> _Cast:
    # numpy's own conversion rounds to nearest even, as c10's does, overflow to infinity and
    # subnormals included (tests/test_casts.py compares every float32 bit pattern); NaN, whose
    # payload numpy keeps and torch does not, is left to torch. 10% faster than the integer
    # passes below where every value's half is normal; where one is not (a half subnormal,
    # zero's neighbours, an overflow: Adam's second moments, all of them), numpy spends 60 ns
    # on each, and F. Giesen's float_to_half_fast3_rtne in integer passes takes over.
    u32 = np.uint32

    def cast(src: memoryview, dst: memoryview) -> bool:
        bits = np.frombuffer(src, dtype=np.uint32)
        magnitude = _nan_free_magnitudes(np, bits)
        if magnitude is None:
            return False
        out = np.frombuffer(dst, dtype=np.uint16)
        if not len(bits):
            return True
        low, high = _HALF_NORMAL
        odd = _work(np, len(bits), "cast-odd", np.bool_)
        np.less(magnitude - u32(1), u32(low - 1), out=odd)  # nonzero and below: wraps 0 away
        if not odd.any() and magnitude.max() <= high:
            with np.errstate(all="ignore"):
                np.copyto(out.view(np.float16), bits.view(np.float32), casting="unsafe")
            return True
        _half_bits(np, bits, magnitude, out)
        return True

    return cast


def _half_bits(np: Any, bits: Any, magnitude: Any, out: Any) -> None:
    """float32 ``bits`` (no NaN) to float16 bits, rounded to nearest even, in integer passes:
    F. Giesen's float_to_half_fast3_rtne."""
    u32, f32 = np.uint32, np.float32
    count = len(bits)
    work = _work(np, count, "cast-half", np.uint32)
    small = _work(np, count, "cast-small", np.bool_)
    # Normal halves: rebias the exponent, round the 13 dropped bits to nearest even.
    np.right_shift(magnitude, u32(13), out=work)
    np.bitwise_and(work, u32(1), out=work)  # the kept mantissa's last bit: ties go even
    np.add(work, magnitude, out=work)
    np.add(work, u32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF), out=work)  # wraps, as in C
    np.right_shift(work, u32(13), out=work)
    # Subnormal halves and zero: added to 0.5 as floats, the FPU rounds them for us.
    denorm_magic = u32(((127 - 15) + (23 - 10) + 1) << 23)
    np.less(magnitude, u32(113 << 23), out=small)
    if small.any():
        tiny = magnitude[small].view(f32) + denorm_magic.view(f32)
        work[small] = tiny.view(u32) - denorm_magic
    # Past the largest half (its rounding included): infinity.
    np.greater_equal(magnitude, u32((127 + 16) << 23), out=small)
    work[small] = 0x7C00
    np.right_shift(bits, u32(16), out=magnitude)  # the sign, in the half's top bit
    np.bitwise_and(magnitude, u32(0x8000), out=magnitude)
    np.bitwise_or(work, magnitude, out=work)
    np.copyto(out, work, casting="unsafe")


_MAKERS = {("float32", "bfloat16"): _fp32_to_bf16, ("bfloat16", "float32"): _bf16_to_fp32,
           ("float32", "float16"): _fp32_to_fp16}


def fast_cast(source: str, target: str) -> _Cast | None:
    """A torch-free cast from dtype ``source`` to ``target`` (torch names), or None.

    The cast takes the source bytes and a destination buffer of the right size,
    fills it and returns True, or returns False (destination untouched) when the
    block holds a NaN and torch must cast it.
    """
    maker = _MAKERS.get((source, target))
    numpy = _numpy() if maker else None
    return maker(numpy) if maker and numpy is not None else None


def cast_block(source: str, target: str, src: memoryview, dst: memoryview, *,
               with_torch: bool = True) -> bool:
    """Cast a contiguous block, torch-free where :func:`fast_cast` can, else with torch.

    The fast cast runs over cache-sized pieces (its several passes then stay in the CPU
    cache: 40% faster than over a 16 MiB block); a piece holding NaN goes to torch.

    Args:
        with_torch: False on a thread beside the main one: a piece torch must cast is left,
            and the block is for the caller to cast again on its own thread (torch's first
            import gives that thread's kept buffers back first; see :func:`import_torch`).

    Returns:
        Whether the whole block was cast (always, ``with_torch``).
    """
    fast = fast_cast(source, target)
    in_size, out_size = DTYPES[source].itemsize, DTYPES[target].itemsize
    count = len(src) // in_size
    for first in range(0, count, _PIECE if fast is not None else max(count, 1)):
        end = min(count, first + _PIECE) if fast is not None else count
        piece_in = src[first * in_size:end * in_size]
        piece_out = dst[first * out_size:end * out_size]
        if fast is None or not fast(piece_in, piece_out):
            if not with_torch:
                return False
            _torch_cast(source, target, piece_in, piece_out)
    return True


_PIECE = 65536  # elements: 256 KiB of float32, the size of a core's L2 cache here


def import_torch() -> Any:
    """torch, for the work numpy does not do; the first time, after this thread's kept
    scratch buffers went back to the system (a merge that kept 64 MiB of them would
    otherwise hold them and torch's 220 MB together)."""
    if "torch" not in sys.modules:
        release_scratch()
    import torch

    return torch


def _torch_cast(source: str, target: str, src: memoryview, dst: memoryview) -> None:
    torch = import_torch()

    out = torch.frombuffer(dst, dtype=_torch.dtype(target))
    out.copy_(torch.frombuffer(src, dtype=_torch.dtype(source)))
