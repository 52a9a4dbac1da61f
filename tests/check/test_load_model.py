"""The load simulator: what a stock `.metadata` costs grows on a straight line in the chunks it
lists (the basis of every extrapolated figure), and ours' index costs a rank what its loads need."""

import dataclasses
import sys

import pytest

from ckptdoctor.check.layout import Layout
from ckptdoctor.check.load_model import LoadOptions, build_records, measure_cell, on_the_chunk_line
from ckptdoctor.check.mova_shape import MovaShape
from ckptdoctor.repro.stacks import current_stack

SHAPE = MovaShape.real().with_layers(4)  # real widths: a tensor has a chunk on every one of N ranks


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    opts = LoadOptions(ranks=[8, 16, 32], layouts=[Layout.parse("fsdp")], shape=SHAPE, saves=("optimizer",),
                       stacks=[current_stack().name])
    return opts, {n: measure_cell(opts, sys.executable, Layout.parse("fsdp"), "optimizer", n,
                                  tmp_path_factory.mktemp(f"load{n}")) for n in (8, 16, 32)}


@pytest.mark.slow
def test_stock_metadata_bytes_and_memory_on_the_chunk_line_predict_an_unfitted_point(cells):
    _, measured = cells
    fitted = {n: measured[n] for n in (8, 16)}
    for value in (lambda m: m["metadata_bytes"], lambda m: m["held_bytes"]):
        predicted, basis = on_the_chunk_line(fitted, "stock_metadata", value, measured[32]["chunks"])
        actual = value(measured[32]["stock_metadata"])
        assert basis.startswith("extrapolated (linear in chunks, fit from N=8,16)")
        assert abs(predicted - actual) <= 0.15 * actual, (predicted, actual)


@pytest.mark.slow
def test_every_rank_holds_the_stock_metadata_but_only_a_skeleton_of_ours(cells):
    opts, measured = cells
    records = {r["ranks"]: r for r in build_records(dataclasses.replace(opts, ranks=[8, 16, 32]),
                                                    {(opts.stacks[0], "fsdp", "optimizer", n): c
                                                     for n, c in measured.items()})}
    for n in (8, 16, 32):
        assert measured[n]["ours_read"]["chunks_listed"] == measured[n]["chunks"]  # the skeleton lists every chunk
    assert measured[32]["chunks"] > 3 * measured[8]["chunks"]  # FSDP over N: chunks grow with N
    stock, ours = records[32]["stock"], records[32]["ours"]
    assert stock["held_bytes"] > 10 * ours["held_bytes"]
    assert stock["bytes_to_rank0"] > 100 * ours["bytes_to_rank0"]  # N read plans vs N markers
    assert records[32]["items_per_rank"] == records[8]["items_per_rank"]  # one chunk per tensor per rank
