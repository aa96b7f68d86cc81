"""Page allocation for a batch of requests.

Each row of a batch receives the pages its prompt plus its new tokens need,
consecutive in the page pool and in row order; the ``block_table`` lists them.
With ``groups`` > 1 (data-parallel serving, ``snapmla_jax.data_parallel``) the rows
form that many consecutive groups of equal size, one a device, and each group
numbers its pages in its own pool from 0.
Entries past a row's pages are 0: a valid page id, which the kernels never read
because they stop at the row's ``seq_len``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PageTable:
    """Pages handed to a batch.

    block_table [B, max_pages] int32 (numpy): row b's pages in token order (in its
    group's pool).
    num_pages: size of the page pool to create (pages 0..num_pages-1 used), a group's
    (the largest group's) with ``groups`` > 1.
    page_size: tokens per page.  capacity [B] int: tokens row b may hold.
    """

    block_table: np.ndarray
    num_pages: int
    page_size: int
    capacity: np.ndarray
    groups: int = 1


def allocate_pages(lengths: Sequence[int], max_new_tokens: int, *, page_size: int = 64,
                   groups: int = 1) -> PageTable:
    """Pages for rows holding ``lengths[b] + max_new_tokens`` tokens each.

    lengths: prompt lengths (ints >= 1); max_new_tokens: int >= 0; page_size: int >= 1;
    groups: int >= 1 dividing the number of rows (module docstring).
    Raises ValueError naming the argument for an empty batch or a bad value.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths: expected a non-empty 1-D sequence of ints, got {lengths!r}")
    if (lengths < 1).any():
        raise ValueError(f"lengths: expected every length >= 1, got {int(lengths.min())}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or lengths.size % groups:
        raise ValueError(f"groups: expected a positive int dividing the {lengths.size} rows, got {groups!r}")
    capacity = lengths.astype(np.int64) + max_new_tokens
    pages = (-(-capacity // page_size)).reshape(groups, -1)
    first = np.cumsum(pages, axis=1) - pages  # each group's pool from page 0
    width = int(pages.max())
    columns = np.arange(width)[None, :]
    block_table = np.where(columns < pages.reshape(-1, 1), first.reshape(-1, 1) + columns, 0).astype(np.int32)
    return PageTable(block_table=block_table, num_pages=int(pages.sum(axis=1).max()), page_size=page_size,
                     capacity=capacity, groups=groups)

