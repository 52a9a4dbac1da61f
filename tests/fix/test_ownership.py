"""Ownership (fix/ownership.py): every plain item has exactly one writer, balanced by bytes."""

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptdoctor.fix.ownership import assign_plain_items


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=5), st.integers(0, 10**6), max_size=40), st.integers(1, 50))
def test_every_plain_item_has_exactly_one_owner_and_loads_are_balanced(sizes, world):
    owners = assign_plain_items(sizes, world, lowest_rank=False)
    assert set(owners) == set(sizes) and all(0 <= r < world for r in owners.values())
    loads = collections.Counter()
    for key, owner in owners.items():
        loads[owner] += sizes[key]
    if sizes and world > 1:  # greedy largest-first: no rank above the mean by more than the largest item
        assert max(loads.values()) <= sum(sizes.values()) / min(world, len(sizes)) + max(sizes.values())
    assert set(assign_plain_items(sizes, world, lowest_rank=True).values()) <= {0}  # stock's lowest-rank option
