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
