"""Huge pages for packed CPU weights: which memory is advised, and that values survive."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from chassis.platforms import cpu_huge_pages
from chassis.platforms.cpu_huge_pages import (
    HUGE_PAGE_BYTES,
    collapse_into_huge_pages,
    huge_page_spans,
)

H = HUGE_PAGE_BYTES


def test_spans_are_the_whole_huge_pages_inside_merged_ranges():
    # two ranges 1 KB apart merge; the partial pages at the ends are left out
    assert huge_page_spans([(H + 10, 3 * H), (3 * H + 1024, 5 * H + 7)]) == [(2 * H, 5 * H)]
    # ranges a huge page or more apart stay separate; one inside a single page gives nothing
    assert huge_page_spans([(0, 2 * H), (4 * H, 6 * H), (7 * H + 1, 7 * H + 9)]) == [
        (0, 2 * H),
        (4 * H, 6 * H),
    ]
    assert huge_page_spans([(5, 5), (H, H + 100)]) == []


def _anon_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end), from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux")
def test_collapse_keeps_values_and_uses_huge_pages_where_the_kernel_allows():
    weights = [torch.randn(3 * H // 4) for _ in range(4)]  # 6 MB each, float32
    expected = [w.clone() for w in weights]
    collapsed = collapse_into_huge_pages(weights)
    assert all(torch.equal(w, e) for w, e in zip(weights, expected, strict=True))
    assert collapsed % H == 0
    if collapsed == 0:
        pytest.skip("this kernel or its THP setting refused huge pages")
    start = min(w.data_ptr() for w in weights)
    end = max(w.data_ptr() + w.numel() * 4 for w in weights)
    assert _anon_huge_bytes(start, end) >= collapsed // 2


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_huge_pages.ENV_SWITCH, "0")
    assert collapse_into_huge_pages([torch.randn(H)]) == 0


def test_opaque_onednn_weights_are_skipped_and_the_model_still_prepares(monkeypatch):
    from torch import nn

    from chassis.platforms.cpu import CpuPlatform
    from chassis.platforms.cpu_packed_linear import PackedLinear, can_pack

    if not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)):
        pytest.skip("this torch build has no oneDNN linear packing")
    # 8,192 inputs: beyond the chassis kernel, so oneDNN packs it (an opaque tensor)
    model = nn.Sequential(nn.Linear(8192, 128), nn.Linear(96, 128)).to(torch.bfloat16)
    CpuPlatform().prepare_model(model)
    assert isinstance(model[0], PackedLinear) and model[0].kernel == "oneDNN"
    assert collapse_into_huge_pages([model[0].packed_weight]) == 0
    # and with the compiled kernels off, every layer is oneDNN's
    monkeypatch.setattr("chassis.platforms.cpu_packed_linear._chassis_linear_ops", lambda: None)
    other = nn.Sequential(nn.Linear(64, 128)).to(torch.bfloat16)
    CpuPlatform().prepare_model(other)
    assert other[0].kernel == "oneDNN"
