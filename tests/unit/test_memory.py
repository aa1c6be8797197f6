"""pdserve/memory.py: the KV cache's allocation in transparent huge pages."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from pdserve import memory


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def test_large_tensor_is_zeroed_and_aligned_to_a_huge_page():
    shape = (3, 1024, 1024, 16)  # 96 MiB of bf16
    t = memory.zeros_huge_pages(shape, torch.bfloat16, torch.device("cpu"))
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    assert not t.any()
    t[1, 2, 3, 4] = 7  # an ordinary tensor: writable, views work
    assert t[1].sum().item() == 7


def test_small_tensor_is_a_plain_allocation():
    t = memory.zeros_huge_pages((4, 8), torch.float32, torch.device("cpu"))
    assert t.shape == (4, 8) and not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                    reason="no transparent huge pages on this host")
def test_madvise_is_accepted_where_the_os_has_huge_pages():
    raw = torch.empty(4 * memory.HUGE_PAGE, dtype=torch.uint8)
    base = raw.data_ptr() + (-raw.data_ptr() % memory.HUGE_PAGE)
    assert memory._madvise_huge(base, 2 * memory.HUGE_PAGE)
    assert not memory._madvise_huge(base + 1, memory.HUGE_PAGE) or os.uname().sysname != "Linux"  # unaligned: EINVAL
