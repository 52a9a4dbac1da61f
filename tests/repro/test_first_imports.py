"""The first import of MOVA's dependencies in a fresh environment writes caches; one process
does it before eight ranks do it at once (a fresh clone's first reproduction once failed with
yapf's half-written grammar pickle: `EOFError: Ran out of input`)."""

import os
import sys

import pytest

from ckptdoctor.repro.mova import job


@pytest.mark.skipif(__import__("importlib").util.find_spec("mmengine") is None, reason="MOVA's dependencies absent")
def test_the_grammar_cache_yapf_writes_on_first_import_is_complete_before_the_ranks_start(tmp_path, monkeypatch):
    import pickle

    monkeypatch.setattr(job, "_warmed", set())
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path)}  # a fresh cache
    job.warm_first_imports(sys.executable, env)
    grammars = sorted((tmp_path / "cache").rglob("*.pickle"))
    assert grammars, list((tmp_path / "cache").rglob("*"))  # yapf's grammar pickles, written by the warm-up
    for path in grammars:
        assert pickle.loads(path.read_bytes())  # whole: what a rank then reads
    job.warm_first_imports(sys.executable, env)  # once per interpreter
    assert sys.executable in job._warmed
