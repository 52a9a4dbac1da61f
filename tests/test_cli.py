"""Bad input gives one clear line on stderr and exit status 2, never a traceback."""

import subprocess
import sys

import pytest

from ckptdoctor.cli import main
from ckptdoctor.repro import stacks

from support.faults import read_only_bind


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ckptdoctor.cli", *args], capture_output=True, text=True, timeout=120)


def _one_clear_line(result, fragment):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptdoctor: error:"), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_help_lists_the_commands():
    result = _run("--help")
    assert result.returncode == 0 and "repro" in result.stdout
    assert "--ranks" in _run("repro", "--help").stdout


def test_world_size_that_cannot_hold_the_job():
    _one_clear_line(_run("repro", "--ranks", "1"), "at least 2 ranks")


def test_output_directory_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    _one_clear_line(_run("repro", "--out", str(blocker / "sub")), "cannot create output directory")


def test_unsupported_versions_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(stacks, "installed_versions", lambda: ("2.7.1", "1.12.0"))
    assert main(["repro"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unsupported versions torch 2.7.1 + accelerate 1.12.0" in err
    assert "torch 2.8.0 + accelerate 1.13.0" in err


def test_unknown_stack_name():
    with pytest.raises(stacks.UnsupportedVersion, match="unknown stack 'nightly'"):
        stacks.stack_by_name("nightly")


@pytest.fixture
def read_only_dir(tmp_path):
    with read_only_bind(tmp_path / "ro") as target:
        yield target


@pytest.mark.parametrize("inside", [False, True])
def test_output_directory_on_a_read_only_filesystem(read_only_dir, inside):
    out = read_only_dir / "runs" if inside else read_only_dir
    result = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "repro", "--out", "ro/runs" if inside else "ro"],
                            capture_output=True, text=True, timeout=120, cwd=read_only_dir.parent)
    _one_clear_line(result, "Read-only file system" if inside else "is not writable")
    assert not out.exists() or not any(out.iterdir())


def test_building_the_parser_imports_no_torch():
    code = ("import sys; from ckptdoctor.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("command,flag,options,field", [
    ("repro", "trainer", "ckptdoctor.repro.reproduce:ReproOptions", "trainer"),
    ("repro", "ranks", "ckptdoctor.repro.reproduce:ReproOptions", "world_size"),
    ("repro", "out", "ckptdoctor.repro.reproduce:ReproOptions", "output_dir"),
    ("check", "layout", "ckptdoctor.check.preflight:CheckOptions", "layout"),
    ("check", "deadline", "ckptdoctor.check.preflight:CheckOptions", "deadline_s"),
    ("check", "warn_fraction", "ckptdoctor.check.preflight:CheckOptions", "warn_fraction"),
    ("selftest", "width", "ckptdoctor.selftest.run:Options", "width"),
    ("selftest", "timeout", "ckptdoctor.selftest.run:Options", "timeout_s"),
    ("selftest", "visibility", "ckptdoctor.selftest.run:Options", "visibility_s"),
])
def test_a_flag_takes_its_default_from_the_options_the_command_builds(command, flag, options, field):
    import dataclasses
    import importlib

    from ckptdoctor.cli import build_parser

    required = {"check": ["--ranks", "8"], "selftest": ["--dir", "d"]}.get(command, [])
    args = build_parser().parse_args([command, *required])
    module, name = options.split(":")
    default = {f.name: f.default for f in dataclasses.fields(getattr(importlib.import_module(module), name))}[field]
    assert str(getattr(args, flag)) == str(default)


@pytest.mark.parametrize("args,fragment", [
    (("repro", "--attempts", "0"), "--attempts must be at least 1"),
    (("repro", "--ranks", "4"), "add --trainer lookalike"),
    (("repro", "--trainer", "lookalike", "--integration", "minimal"), "it needs --fix"),
    (("repro", "--trainer", "lookalike", "--async"), "--async saves through the fix in the background: it needs --fix"),
    (("repro", "--trainer", "lookalike", "--no-roundtrip"), "--no-roundtrip skips loading the fixed job's checkpoint "
                                                            "back: it needs --fix"),
    (("check", "--ranks", "8", "--warn-fraction", "2"), "--warn-fraction must be in (0, 1]"),
    (("check", "--ranks", "12", "--layout", "hsdp:8"), "not divisible by the shard group"),
    (("selftest", "--dir", "d", "--width", "3"), "--width must be even"),
    (("selftest", "--dir", "d", "--steps", "0"), "--steps must be positive"),
])
def test_a_value_the_options_refuse_is_one_line(args, fragment):
    _one_clear_line(_run(*args), fragment)


@pytest.mark.parametrize("args,message", [
    (["--layout", "tp:2"], "unknown layout 'tp:2'"),
    (["--ranks", "1144", "--layout", "hsdp:48"], "not divisible by the shard group"),
    (["--ranks", "0"], "at least 1"),
    (["--ranks", "8,x"], "comma-separated integers"),
])
def test_simulate_cli_bad_input_is_one_clear_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "simulate", *args], capture_output=True, text=True)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--ranks", "1144", "--torch", "2.9.0"], "--torch 2.9.0: this interpreter has torch"),
    (["--ranks", "1144", "--layout", "hsdp:48"], "not divisible by the shard group"),
    (["--ranks", "8", "--warn-fraction", "2"], "--warn-fraction must be in (0, 1]"),
])
def test_check_bad_input_is_one_clear_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.cli", "check", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
