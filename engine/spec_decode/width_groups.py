"""Rows of a pass grouped by width, so that no row computes much more than its own tokens.

A batched forward pads every row to the widest. When a prompt prefills beside rows that decode, or prompts of
different lengths prefill together, one padded pass computes the short rows at the long one's width (on a CPU
a batch of 32 prompts of 63..165 tokens padded to 165 costs over twice their passes one by one). The rows are
grouped by width instead, each group one pass at its own width.
"""

from __future__ import annotations


def width_groups(widths: list[int], min_pad: int = 4, slack: float = 0.125) -> list[list[int]]:
    """Row indices grouped for passes of their own, widest first: a row joins the current group while the
    group's width exceeds its own by at most ``min_pad`` tokens or ``slack`` of the group's width (a pass's
    overhead is worth that much padding); every row is in one group."""
    order = sorted(range(len(widths)), key=lambda b: -widths[b])
    groups: list[list[int]] = []
    for b in order:
        if groups:
            top = widths[groups[-1][0]]
            if top - widths[b] <= max(min_pad, slack * top):
                groups[-1].append(b)
                continue
        groups.append([b])
    return groups
