"""Rows of different lengths, grouped so that padding each group to its longest stays small.

The trainer's micro-batches and the engine's prefill forwards both pad every row of a group
to the group's longest row, and compute the padding only to throw it away.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_PADDING_SHARE = 0.25
"""A row shorter than ``1 - MAX_PADDING_SHARE`` of its group's longest starts a new group."""


def length_groups(lengths: Sequence[int], max_tokens: int | None = None) -> list[list[int]]:
    """Indices into ``lengths``, longest first (ties in input order), in groups where every
    row is at least ``1 - MAX_PADDING_SHARE`` of the group's longest and, with ``max_tokens``,
    rows × longest stays within it (a row longer than that gets a group of its own)."""
    groups: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            group = groups[-1]
            longest = lengths[group[0]]
            fits = max_tokens is None or (len(group) + 1) * longest <= max_tokens
            if fits and lengths[index] >= (1 - MAX_PADDING_SHARE) * longest:
                group.append(index)
                continue
        groups.append([index])
    return groups
