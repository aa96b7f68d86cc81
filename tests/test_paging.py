"""Page allocation for a batch from prompt lengths + max_new_tokens."""

import numpy as np
import pytest

from snapmla_jax.paging import allocate_pages


def test_each_row_gets_enough_distinct_pages():
    lengths, max_new, page_size = [1, 64, 65, 200, 3], 30, 64
    table = allocate_pages(lengths, max_new, page_size=page_size)
    need = [-(-(n + max_new) // page_size) for n in lengths]  # [1, 2, 2, 4, 1]
    assert table.block_table.dtype == np.int32
    assert table.block_table.shape == (len(lengths), max(need))
    assert table.num_pages == sum(need)
    np.testing.assert_array_equal(table.capacity, np.asarray(lengths) + max_new)
    owned = [table.block_table[b, :n] for b, n in enumerate(need)]
    flat = np.concatenate(owned)
    assert sorted(flat.tolist()) == list(range(table.num_pages))  # every page used once
    for b, n in enumerate(need):  # padding entries are page 0, never read
        assert (table.block_table[b, n:] == 0).all()


def test_capacity_boundary_takes_a_new_page():
    assert allocate_pages([60], 4, page_size=64).num_pages == 1
    assert allocate_pages([60], 5, page_size=64).num_pages == 2


@pytest.mark.parametrize("kwargs,name", [
    (dict(lengths=[], max_new_tokens=4), "lengths"),
    (dict(lengths=[3, 0], max_new_tokens=4), "lengths"),
    (dict(lengths=[3], max_new_tokens=-1), "max_new_tokens"),
    (dict(lengths=[3], max_new_tokens=4, page_size=0), "page_size"),
])
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        allocate_pages(**kwargs)
