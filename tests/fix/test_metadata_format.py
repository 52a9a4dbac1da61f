"""Which torch can read a checkpoint: torch 2.15 pickles TensorProperties with strides (six
fields), which torch 2.8-2.14 cannot unpickle. A load across that boundary is refused in one line
naming both versions, never a ValueError from inside pickle."""

import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorProperties

from ckptdoctor.fix.compat import installed_versions
from ckptdoctor.fix.index import CorruptCheckpoint, read_metadata_file
from ckptdoctor.fix.metadata_format import describe_format, field_counts

from support.paths import REPO

BEFORE_STRIDES = tuple(map(int, installed_versions()[0].split(".")[:2])) < (2, 15)


def save(path: Path, monkeypatch=None, with_strides=False) -> Path:
    if with_strides and BEFORE_STRIDES:  # INJECTED: the six fields torch 2.15 pickles, same class path
        getstate = TensorProperties.__getstate__
        monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*getstate(self), (4, 1)))
    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "step": 3}, checkpoint_id=path, no_dist=True)
    monkeypatch and monkeypatch.undo()
    return path


def test_the_format_is_told_by_the_pickled_tensor_properties(tmp_path, monkeypatch):
    old = save(tmp_path / "old")
    new = save(tmp_path / "new", monkeypatch, with_strides=True)
    assert field_counts((new / ".metadata").read_bytes()) == {6}
    assert field_counts((old / ".metadata").read_bytes()) == ({5} if BEFORE_STRIDES else {6})
    assert field_counts(b"not a pickle") == set()
    said = describe_format(read_metadata_file(old))  # what check --from-checkpoint notes
    assert said.startswith("written by torch 2.14 or older" if BEFORE_STRIDES else "written by torch 2.15 or newer")


@pytest.mark.skipif(not BEFORE_STRIDES, reason="torch 2.15 and newer read both formats")
def test_a_newer_format_is_refused_in_one_line_naming_both_versions_where_stock_raises_valueerror(tmp_path,
                                                                                                     monkeypatch):
    path = save(tmp_path / "new", monkeypatch, with_strides=True)
    with pytest.raises(ValueError, match="too many values to unpack"):  # stock's symptom
        dcp.FileSystemReader(str(path)).read_metadata()
    with pytest.raises(CorruptCheckpoint) as refused:
        read_metadata_file(path)
    line = str(refused.value)
    assert "\n" not in line and f"torch {installed_versions()[0]} cannot read it" in line
    assert "written by torch 2.15 or newer" in line and "corrupt" not in line


def test_a_damaged_metadata_is_still_called_damaged(tmp_path):
    path = save(tmp_path / "ckpt")
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[:len(data) // 2])
    with pytest.raises(CorruptCheckpoint, match="truncated or corrupt"):
        read_metadata_file(path)


OLDER = REPO / ".venv" / "user" / "bin" / "python"


def older_torch() -> str | None:
    if not OLDER.exists():
        return None
    return subprocess.run([str(OLDER), "-c", "import torch; print(torch.__version__.split('+')[0])"],
                          capture_output=True, text=True).stdout.strip() or None


@pytest.mark.slow
@pytest.mark.skipif(BEFORE_STRIDES or not OLDER.exists(), reason="needs torch 2.15+ here and the user stack's venv")
def test_a_checkpoint_saved_on_torch_2_15_is_refused_by_every_rank_of_a_torch_2_8_job_in_one_line(tmp_path):
    """Real processes on both sides: 4 ranks of this stack save one step; 4 ranks of the user
    stack's interpreter (torch 2.8.0) load it with load_state."""
    from test_checkpointing import checkpoint_job

    saved, _, out = checkpoint_job(tmp_path, "none")
    assert saved.returncodes == [0] * 4
    older = older_torch()
    result, reports, _ = checkpoint_job(tmp_path, "load-only", python=str(OLDER), env={
        "CKPTDOCTOR_TEST_CKPT_ROOT": str(out / "ckpt")})
    assert result.returncodes == [0] * 4 and result.torn_down == []
    errors = {r["error"] for r in reports.values()}
    assert {r["error_type"] for r in reports.values()} == {"CheckpointAborted"} and len(errors) == 1, reports
    (line,) = errors
    assert "\n" not in line and "written by torch 2.15 or newer" in line and f"torch {older} cannot read it" in line
