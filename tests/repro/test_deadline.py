"""The deadline a reproduction chooses, and the record `repro --fix` reuses it from (fast)."""

import datetime

from ckptdoctor.repro.reproduce import (DEADLINES_FILE, ReproOptions, bounded, breaking_deadline,
                                        remember_breaking_deadline)


def test_the_chosen_deadline_is_whole_milliseconds_as_gloo_counts_them():
    """gloo truncates its timeout to milliseconds: a chosen 2.98456 s was reported as 2985 ms
    while gloo said "Timed out waiting 2984ms" (CI, MOVA sft)."""
    for below, above in [(2.07, 4.303), (1.3, 5.22), (0.8123, 3.3331)]:
        choice = bounded("optimizer_0", below, above)
        gloo_ms = datetime.timedelta(seconds=choice.deadline_s) // datetime.timedelta(milliseconds=1)
        assert gloo_ms == choice.margins()["deadline_s"] * 1000 == round(choice.deadline_s * 1000)


def test_repro_fix_finds_the_deadline_of_the_same_job_only(tmp_path):
    sft = ReproOptions(trainer="mova", mode="sft", output_dir=tmp_path)
    report = {"deadline_ms": 3286, "margins": bounded("optimizer_0", 2.069, 5.22).margins(), "log": "job.log"}
    remember_breaking_deadline(sft, report)
    assert (tmp_path / DEADLINES_FILE).is_file()
    assert breaking_deadline(ReproOptions(trainer="mova", mode="sft", output_dir=tmp_path))["deadline_s"] == 3.286
    assert breaking_deadline(ReproOptions(trainer="mova", mode="lora", output_dir=tmp_path)) is None
    assert breaking_deadline(ReproOptions(trainer="lookalike", mode="sft", output_dir=tmp_path)) is None
    assert breaking_deadline(ReproOptions(trainer="mova", mode="sft", output_dir=tmp_path / "elsewhere")) is None
