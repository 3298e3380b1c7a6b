"""Scratch buffers: private memory, large ones in 2 MiB pages where the system grants them."""

from __future__ import annotations

import ctypes
import mmap
import re
import sys

import pytest

from fsdpckpt._io import rawio

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads the mapping's flags from /proc/self/smaps")


def _mapping_flags(view: memoryview) -> tuple[str, set[str]]:
    """The first line and the VmFlags of the mapping that holds ``view``."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    with open("/proc/self/smaps") as smaps:
        text = smaps.read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        start, end = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
        if start <= address < end:
            flags = re.search(r"^VmFlags:(.*)$", block, re.M)
            return block.splitlines()[0], set(flags.group(1).split()) if flags else set()
    raise AssertionError(f"no mapping holds {address:#x}")


def _huge_pages_offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[never]" not in setting.read()
    except OSError:  # a kernel without them: madvise refuses, and the buffer is plain
        return False


@linux_only
def test_a_large_scratch_buffer_is_private_memory():
    line, flags = _mapping_flags(rawio.scratch(rawio._LARGE_PAGES))
    assert "sh" not in flags and "/dev/zero" not in line  # not shared memory (shmem)


@linux_only
@pytest.mark.skipif(not _huge_pages_offered(), reason="this kernel offers no huge pages")
def test_a_large_scratch_buffer_asks_for_2_mib_pages():
    line, flags = _mapping_flags(rawio.scratch(rawio._LARGE_PAGES))
    assert "hg" in flags  # MADV_HUGEPAGE


@linux_only
def test_a_scratch_buffer_under_2_mib_keeps_4_kib_pages():
    view = rawio.scratch(rawio._LARGE_PAGES - 4096)
    line, flags = _mapping_flags(view)
    assert "sh" not in flags and "hg" not in flags


def test_a_small_scratch_buffer_comes_from_the_heap():
    assert isinstance(rawio.scratch(4096).obj, bytearray)


def test_a_system_that_refuses_large_pages_still_gives_a_buffer(monkeypatch):
    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(rawio.mmap, "mmap", Refusing)
    view = rawio.scratch(2 * rawio._LARGE_PAGES)
    view[-1] = 7
    assert len(view) == 2 * rawio._LARGE_PAGES and view[-1] == 7
