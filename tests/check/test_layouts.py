"""Meshes `check` measures on (check/layout.py): what it refuses, in words."""

import pytest

from ckptdoctor.check.layout import Layout
from ckptdoctor.errors import BadLayout


@pytest.mark.parametrize("text", ["ddp", "hsdp:", "hsdp:0", "hsdp:x", "fsdp:8"])
def test_unknown_layouts_are_rejected(text):
    with pytest.raises(BadLayout, match="unknown layout"):
        Layout.parse(text)


def test_rank_counts_that_cannot_hold_the_layout_are_rejected():
    with pytest.raises(BadLayout, match="1144 ranks are not divisible by the shard group of 48"):
        Layout.parse("hsdp:48").check(1144)
    with pytest.raises(BadLayout, match="at least 1"):
        Layout.parse("fsdp").check(0)
