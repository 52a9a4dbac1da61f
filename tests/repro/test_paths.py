"""Paths that cross a chdir or a process boundary are made absolute where they enter."""

from pathlib import Path

from ckptdoctor.repro.mova.rank import MovaRankSpec
from ckptdoctor.repro.reproduce import ReproOptions


def test_repro_options_resolve_against_the_directory_they_were_given_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opts = ReproOptions(output_dir=Path("runs/repro"), extract="../mova")
    assert opts.output_dir == tmp_path / "runs" / "repro"
    assert opts.extract == str(tmp_path / ".." / "mova")


def test_a_rank_spec_keeps_pointing_where_it_pointed_after_the_rank_changes_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = MovaRankSpec("runs/repro/mova", "runs/repro/calibration/mova_config.py", "runs/repro/calibration/results",
                        1.0).to_json()
    monkeypatch.chdir("/")  # the rank reads its spec from JSON: it must not depend on the cwd then
    spec = MovaRankSpec.from_json(text)
    assert (spec.extract, spec.results_dir) == (str(tmp_path / "runs/repro/mova"),
                                                str(tmp_path / "runs/repro/calibration/results"))
