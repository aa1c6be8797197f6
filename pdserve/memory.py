"""Host memory for the big, long-lived tensors (the KV cache): backed by 2 MiB transparent huge pages
where the OS allows it.

Decode attention reads each sequence's K/V blocks scattered over a cache of gigabytes; with 4 KiB pages
nearly every 2 KiB block read is a TLB miss and a page walk, and the reads reach a third of the DRAM
bandwidth. Linux hands out huge pages for an anonymous mapping only where it is told to
(`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise` is the common default), so the cache asks with
madvise(MADV_HUGEPAGE) before its pages are first touched. Elsewhere (another OS, THP `never`, a GPU)
this is a plain allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MIN_BYTES = 64 << 20  # below this the TLB is not the bottleneck; a plain allocation


def _madvise_huge(ptr: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(length), ctypes.c_int(_MADV_HUGEPAGE)) == 0


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros(shape, dtype, device)`, in huge pages on a Linux host for large CPU tensors."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: glibc maps it fresh
    base = raw.data_ptr()
    offset = -base % HUGE_PAGE
    if not _madvise_huge(base + offset, nbytes - nbytes % HUGE_PAGE):
        logger.debug("madvise(MADV_HUGEPAGE) refused; the cache uses the OS's default pages")
    out = raw[offset : offset + nbytes].view(dtype).view(shape)
    out.zero_()
    return out
