"""`check --from-checkpoint`: a DCP checkpoint's entries plan at N ranks exactly as the state
dict that wrote them, and bad input is one line."""

import pickle
import subprocess
import sys

import pytest

from ckptdoctor.check.layout import Layout
from ckptdoctor.check.mova_shape import MovaShape
from ckptdoctor.check.fake_world import init_fake_world
from ckptdoctor.check.save_phases import _default_metadata, local_plan, plan_signature, rank_plans
from ckptdoctor.check.state_dicts import find_checkpoints, mova_specs, read_checkpoint_entries
from ckptdoctor.errors import CkptDoctorError
from ckptdoctor.fix.compat import installed_versions

from support.fake_ranks import leave_fake_world
from support.metadata import describe_metadata

SHAPE = MovaShape().with_layers(3)  # tiny widths: many tensors narrower than the shard group (empty chunks)

# which torch's format a checkpoint saved here is in (torch 2.15 added strides), as check notes it
WRITTEN_HERE = "written by torch 2.15 or newer" if tuple(map(int, installed_versions()[0].split(".")[:2])) >= (2, 15) \
    else "written by torch 2.14 or older"


def write_stock_metadata(directory, save, specs, ranks, layout):
    """The .metadata a stock save of MOVA's `save` at `ranks` ranks writes: torch's own global
    plan over every rank's local plan (check/save_phases.py derives them in the fake world)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    _, metadata = _default_metadata(DefaultSavePlanner()._dedup_save_plans(list(rank_plans(save, specs, ranks,
                                                                                            layout, "stock"))))
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return metadata


@pytest.mark.parametrize("written,replanned", [("fsdp", "fsdp"), ("hsdp:4", "fsdp"), ("fsdp", "hsdp:8")])
@pytest.mark.parametrize("save", ["model", "optimizer"])
def test_a_checkpoints_entries_plan_as_the_state_dict_that_wrote_it(tmp_path, save, written, replanned):
    """Written by 8 ranks, re-planned as rank 3 of 16: the same items (keys, chunks, sizes) as
    MOVA's own state dict at 16, and the same global metadata as a save at 16 writes."""
    specs = mova_specs(SHAPE, "sft")
    try:
        write_stock_metadata(tmp_path / save, save, specs, 8, Layout.parse(written))
        entries, notes = read_checkpoint_entries(tmp_path / save)
        assert [n.split(": ", 1)[1].split(" (")[0] for n in notes] == [WRITTEN_HERE]  # only which torch reads it
        layout = Layout.parse(replanned)
        mesh = init_fake_world(3, 16, layout)
        from_checkpoint, _ = local_plan(entries.state_dict(save, layout, mesh))
        from_model, _ = local_plan(specs.state_dict(save, layout, mesh))
        assert sorted(plan_signature(from_checkpoint)) == sorted(plan_signature(from_model))
        assert entries.sharded_shapes(save) == specs.sharded_shapes(save)
        again = write_stock_metadata(tmp_path / "again", save, entries, 16, layout)
        expected = write_stock_metadata(tmp_path / "expected", save, specs, 16, layout)
        assert describe_metadata(again) == describe_metadata(expected)
    finally:
        leave_fake_world()


def test_a_checkpoint_saved_by_one_rank_is_taken_as_sharded_and_says_so(tmp_path):
    specs = mova_specs(SHAPE, "sft")
    try:
        write_stock_metadata(tmp_path / "model", "model", specs, 1, Layout.parse("fsdp"))
        entries, notes = read_checkpoint_entries(tmp_path / "model")
    finally:
        leave_fake_world()
    assert len(notes) == 2 and WRITTEN_HERE in notes[0] and "saved by one rank?" in notes[1]
    assert all(e.sharded == (e.size is not None and len(e.size) > 0) for e in entries)


def test_an_accelerate_directory_is_one_checkpoint_per_subdirectory(tmp_path):
    for name in ("optimizer_0", "pytorch_model_fsdp_0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"")
    (tmp_path / "random_states_0.pkl").write_bytes(b"")
    assert [name for name, _ in find_checkpoints(tmp_path)] == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert find_checkpoints(tmp_path / "optimizer_0") == [("optimizer_0", tmp_path / "optimizer_0")]


def corrupt(path):
    path.mkdir()
    (path / ".metadata").write_bytes(b"not a pickle")
    return path


def empty(path):
    """A DCP checkpoint of an empty state dict (a .metadata listing nothing)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({}, checkpoint_id=path, no_dist=True)
    return path


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: p, "no DCP checkpoint there (no .metadata in it or in its subdirectories)"),
    (lambda p: corrupt(p / "ckpt"), "cannot read"),
    (lambda p: empty(p / "ckpt"), "the checkpoint lists no entries"),
])
def test_check_from_a_bad_checkpoint_is_one_clear_line(tmp_path, make, message):
    target = make(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "check", "--ranks", "16", "--from-checkpoint",
                           str(target)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_reading_a_checkpoint_does_not_pass_errors_silently(tmp_path):
    with pytest.raises(CkptDoctorError, match="cannot read"):
        read_checkpoint_entries(corrupt(tmp_path / "ckpt"))


def test_check_load_predicts_the_resume_of_a_checkpoint_at_n_ranks(tmp_path):
    """`check --load --from-checkpoint`, through the CLI: the resume at 8 ranks of a checkpoint 4
    ranks wrote lists the chunks an 8-rank save of its entries writes, for stock and for the fix."""
    import json

    specs = mova_specs(SHAPE, "sft")
    try:
        write_stock_metadata(tmp_path / "ckpt" / "optimizer_0", "optimizer", specs, 4, Layout.parse("fsdp"))
        entries, _ = read_checkpoint_entries(tmp_path / "ckpt" / "optimizer_0")
        at_8 = write_stock_metadata(tmp_path / "at8", "optimizer", entries, 8, Layout.parse("fsdp"))
    finally:
        leave_fake_world()
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "check", "--ranks", "8", "--load",
                           "--from-checkpoint", "ckpt", "--json", "check.json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "check.json").read_text())
    (load,) = result["load_records"]
    chunks = sum(len(md.chunks) for md in at_8.state_dict_metadata.values() if hasattr(md, "chunks"))
    assert (load["save"], load["ranks"], load["chunks"]) == ("optimizer_0", 8, chunks)
    assert load["basis"]["stock metadata"] == "measured" and load["stock"]["metadata_bytes"] > 0
    assert load["ours"]["index_bytes"] > 0 and "rank0 xchg" in proc.stdout
