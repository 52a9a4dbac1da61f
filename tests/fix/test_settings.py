"""The fix's knobs: keyword over environment over default, and one line for a value that cannot be used."""

import logging

import pytest

from ckptdoctor.fix.heartbeat import LOST_RANK_S
from ckptdoctor.fix.settings import GROUP_TIMEOUT_S, BadSetting, Settings


def test_defaults_when_neither_keyword_nor_environment_sets_a_knob():
    settings = Settings.resolve(environ={})
    assert (settings.timeout_s, settings.lost_rank_s, settings.on_lost_rank, settings.heartbeat, settings.log_level) \
        == (GROUP_TIMEOUT_S, LOST_RANK_S, "exit", "process", None) == (10800.0, 300.0, "exit", "process", None)
    assert settings.publish == "rename"
    assert settings.describe().endswith("(all defaults)")


def test_the_environment_sets_what_no_keyword_gives_and_a_keyword_wins():
    environ = {"CKPTDOCTOR_GROUP_TIMEOUT_S": " 7200 ", "CKPTDOCTOR_LOST_RANK_S": "900",
               "CKPTDOCTOR_ON_LOST_RANK": "log", "CKPTDOCTOR_HEARTBEAT": "thread", "CKPTDOCTOR_LOG_LEVEL": "debug",
               "CKPTDOCTOR_PUBLISH": "in_place"}
    settings = Settings.resolve(environ=environ, lost_rank_s=60)
    assert settings.publish == "in_place" and "publish by in_place" in settings.describe()
    assert (settings.timeout_s, settings.lost_rank_s, settings.on_lost_rank, settings.heartbeat, settings.log_level) \
        == (7200.0, 60.0, "log", "thread", "DEBUG")
    assert dict(settings.sources) == {"timeout_s": "CKPTDOCTOR_GROUP_TIMEOUT_S", "lost_rank_s": "keyword",
                                      "on_lost_rank": "CKPTDOCTOR_ON_LOST_RANK", "heartbeat": "CKPTDOCTOR_HEARTBEAT",
                                      "log_level": "CKPTDOCTOR_LOG_LEVEL", "publish": "CKPTDOCTOR_PUBLISH"}
    assert "lost rank after 60 s -> log" in settings.describe()


@pytest.mark.parametrize("environ, keywords, line", [
    ({"CKPTDOCTOR_GROUP_TIMEOUT_S": "3h"}, {}, "CKPTDOCTOR_GROUP_TIMEOUT_S='3h': expected seconds, a positive number"),
    ({"CKPTDOCTOR_LOST_RANK_S": "-5"}, {}, "CKPTDOCTOR_LOST_RANK_S='-5': expected seconds, a positive number"),
    ({"CKPTDOCTOR_LOST_RANK_S": "nan"}, {}, "CKPTDOCTOR_LOST_RANK_S='nan': expected seconds, a positive number"),
    ({"CKPTDOCTOR_ON_LOST_RANK": "kill"}, {}, "CKPTDOCTOR_ON_LOST_RANK='kill': expected one of exit, log"),
    ({"CKPTDOCTOR_HEARTBEAT": "native"}, {}, "CKPTDOCTOR_HEARTBEAT='native': expected one of process, thread"),
    ({"CKPTDOCTOR_PUBLISH": "s3"}, {}, "CKPTDOCTOR_PUBLISH='s3': expected one of rename, in_place"),
    ({}, {"on_lost_rank": "ignore"}, "keyword on_lost_rank='ignore': expected one of exit, log"),
    ({"CKPTDOCTOR_LOG_LEVEL": "loud"}, {}, "CKPTDOCTOR_LOG_LEVEL='loud': expected DEBUG, INFO, WARNING, ERROR or CRITICAL"),
])
def test_a_value_that_cannot_be_used_is_refused_in_one_line_naming_it(environ, keywords, line):
    with pytest.raises(BadSetting) as refused:
        Settings.resolve(environ=environ, **keywords)
    assert str(refused.value) == line


def test_the_log_level_applies_to_every_ckptdoctor_logger():
    logger = logging.getLogger("ckptdoctor")
    before = logger.level
    try:
        Settings.resolve(environ={"CKPTDOCTOR_LOG_LEVEL": "INFO"}).apply_log_level()
        assert logging.getLogger("ckptdoctor.fix.checkpointing").getEffectiveLevel() == logging.INFO
    finally:
        logger.setLevel(before)


def test_the_save_root_is_an_absolute_path_and_every_knob_but_the_log_level_must_match_rank_0s(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = Settings.resolve(environ={"CKPTDOCTOR_SAVE_ROOT": "checkpoints", "CKPTDOCTOR_LOG_LEVEL": "debug"})
    assert settings.save_root == str(tmp_path / "checkpoints") and "save root " + str(tmp_path) in settings.describe()
    rank0 = Settings.resolve(environ={"CKPTDOCTOR_SAVE_ROOT": str(tmp_path / "checkpoints")}).values()
    assert settings.differences(rank0) == []  # the same root, and a log level of its own
    other = Settings.resolve(environ={"CKPTDOCTOR_PUBLISH": "in_place", "CKPTDOCTOR_LOST_RANK_S": "60"})
    assert other.differences(rank0) == ["lost_rank_s=60.0 (rank 0: 300.0)", "publish='in_place' (rank 0: 'rename')",
                                        f"save_root=None (rank 0: {str(tmp_path / 'checkpoints')!r})"]
