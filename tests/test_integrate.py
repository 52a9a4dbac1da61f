"""`ckptdoctor integrate` on small trainers of other shapes than MOVA's (tests/mova/test_local_edits.py
runs it on MOVA's own file): the save root read from the code or a note, the full patch refused."""

import ast
import re
import textwrap

import pytest

from ckptdoctor.integrate import CannotIntegrate, integrate

CLASS_TRAINER = '''
import os


class Trainer:
    def __init__(self, save_path):
        {before}
        self._setup()
        {after}

    def _setup(self):
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)

    def save(self, step):
        step_dir = os.path.join(self.save_path, f"step-{{step}}")
        self.accelerator.save_state(os.path.join(step_dir, "accelerator"))
'''


def write(tmp_path, text, name="trainer.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def install_call(path) -> str:
    calls = [ast.unparse(n) for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Call) and ast.unparse(n.func) == "ckptdoctor.install"]
    assert len(calls) == 1
    return calls[0]


def test_the_save_root_is_read_through_joins_and_local_names_when_set_before_the_prepare(tmp_path):
    path = write(tmp_path, CLASS_TRAINER.format(before="self.save_path = save_path", after="pass"))
    placed = integrate(path)
    assert placed.save_root == "self.save_path" and placed.notes == ()
    assert install_call(path) == "ckptdoctor.install(self.accelerator, save_root=self.save_path)"


def test_a_save_root_set_only_after_the_prepare_runs_is_not_passed_and_a_note_says_so(tmp_path):
    path = write(tmp_path, CLASS_TRAINER.format(before="pass", after="self.save_path = save_path"))
    placed = integrate(path)
    assert placed.save_root is None and install_call(path) == "ckptdoctor.install(self.accelerator)"
    assert len(placed.notes) == 1 and placed.notes[0].startswith("no save root could be read from trainer.py")


def test_a_script_without_a_class_gets_the_call_and_the_note(tmp_path):
    path = write(tmp_path, '''
    def main(args, accelerator, model):
        model = accelerator.prepare(model)
        accelerator.save_state(f"{args.output_dir}/checkpoint-1")
    ''')
    placed = integrate(path)
    assert install_call(path) == "ckptdoctor.install(accelerator)" and "no save root" in placed.notes[0]


def test_a_trainer_that_already_makes_a_scalablecheckpointing_is_refused_and_left_as_it_was(tmp_path):
    path = write(tmp_path, '''
    from ckptdoctor import ScalableCheckpointing

    def setup(self):
        self.model = self.accelerator.prepare(self.model)
        self.ckpt = ScalableCheckpointing(self.accelerator)
    ''')
    before = path.read_text()
    with pytest.raises(CannotIntegrate, match=r"trainer.py:6: this trainer already makes a ScalableCheckpointing"):
        integrate(path)
    assert path.read_text() == before


def test_the_subclass_scan_stays_inside_the_package(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    path = write(package, CLASS_TRAINER.format(before="self.save_path = save_path", after="pass"))
    (package / "npu.py").write_text("from .trainer import Trainer\nclass Npu(Trainer):\n    def _setup(self):\n"
                                    "        pass\n    def save(self, step):\n        pass\n")
    (tmp_path / "elsewhere.py").write_text("class Other(Trainer):\n    def _setup(self):\n        pass\n")
    placed = integrate(path)
    assert [n.split(": ", 1)[1] for n in placed.notes] == [
        "Npu subclasses Trainer and overrides _setup(): a trainer built from it never runs the inserted call; add it "
        "after that prepare too"]


@pytest.mark.parametrize("source, line", [
    ('''
    def setup(self):
        self.model = self.accelerator.prepare(self.model)
        self.critic_opt = self.critic_accelerator.prepare(self.critic_opt)
    ''', "2 accelerators prepare something (self.accelerator, self.critic_accelerator)"),
    ('''
    def setup(self):
        self.net = self.accelerator.prepare(self.net)
        self.ema.model = self.ema_accelerator.prepare(self.ema.model)

    def save(self):
        self.accelerator.save_state("out")
    ''', "2 accelerators prepare something"),
    ('''
    def setup(self):
        self.ema.model = self.ema_accelerator.prepare(self.ema.model)

    def save(self):
        self.accelerator.save_state("out")
    ''', "the model is prepared by self.ema_accelerator, but the trainer saves through self.accelerator"),
])
def test_a_second_accelerators_model_is_not_taken_for_the_main_one(tmp_path, source, line):
    path = write(tmp_path, source)
    before = path.read_text()
    with pytest.raises(CannotIntegrate, match=re.escape(line)):
        integrate(path)
    assert path.read_text() == before


def test_a_file_without_a_prepare_or_that_does_not_parse_is_one_line_and_unchanged(tmp_path):
    none = write(tmp_path, "def main(model):\n    return model\n", "plain.py")
    with pytest.raises(CannotIntegrate, match=r"^.*plain\.py: no `\.\.\. model \.\.\. = <accelerator>\.prepare\(\.\.\.\)` "
                                              r"statement found; add the two lines by hand"):
        integrate(none)
    broken = write(tmp_path, "def main(:\n", "broken.py")
    with pytest.raises(CannotIntegrate, match=r"broken\.py:1: not valid Python \(.*\); nothing changed$"):
        integrate(broken)
    assert none.read_text() == "def main(model):\n    return model\n" and broken.read_text() == "def main(:\n"


def test_check_only_says_where_and_changes_nothing(tmp_path):
    path = write(tmp_path, CLASS_TRAINER.format(before="self.save_path = save_path", after="pass"))
    before = path.read_bytes()
    placed = integrate(path, check_only=True)
    assert path.read_bytes() == before and placed.inserted_at == 14 and placed.prepare_lines == (12, 12)


def test_crlf_line_ends_and_the_file_mode_are_kept(tmp_path):
    import os
    import stat

    path = tmp_path / "trainer.py"
    path.write_bytes(textwrap.dedent(CLASS_TRAINER.format(before="self.save_path = save_path", after="pass"))
                     .replace("\n", "\r\n").encode())
    os.chmod(path, 0o750)
    integrate(path)
    data = path.read_bytes()
    assert data.count(b"\n") == data.count(b"\r\n")  # every line, the two inserted included
    assert b"ckptdoctor.install(self.accelerator, save_root=self.save_path)\r\n" in data
    assert stat.S_IMODE(path.stat().st_mode) == 0o750


def test_a_result_that_would_not_follow_the_prepare_is_refused(tmp_path, monkeypatch):
    """_verify: the inserted call must be the statement right after the prepare, by the syntax tree."""
    from ckptdoctor import integrate as integration

    path = write(tmp_path, CLASS_TRAINER.format(before="self.save_path = save_path", after="pass"))
    before = path.read_text()
    monkeypatch.setattr(integration, "_indent", lambda line: "    ")  # INJECTED: the call lands in the class body
    with pytest.raises(CannotIntegrate, match="the inserted call would not directly follow the prepare at line 12"):
        integrate(path)
    assert path.read_text() == before
