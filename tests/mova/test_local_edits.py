"""Both integration levels against copies of MOVA's trainer with the reporter's local lines.

The five placements of repro/mova/local_edits.py (43 local lines before `train()`, 14 between it
and the save, as the reporter's traceback says), and one more that makes the minimal level ambiguous (a local
method that prepares the model again). The documented procedures must either apply correctly, judged by the syntax
tree of the result, or stop with one line and change nothing; never misplace an edit.
Text only (no ranks): fast, on every stack."""

import ast
import os
import subprocess

import pytest

from ckptdoctor.integrate import CannotIntegrate, integrate
from ckptdoctor.repro.mova.job import PATCH, TRAINER
from ckptdoctor.repro.mova.local_edits import PLACEMENTS, with_local_lines

from support.commands import CKPTDOCTOR

SECOND_PREPARE = ("    def _reprepare(self):  # local: re-wrap the model after a config change\n"
                  "        self.model = self.accelerator.prepare(self.model)\n\n")


# Where `git apply --check` takes the full patch (docs/evidence/local_edits.txt, the guide: 2 of 5): the hunks'
# context lines are intact only when no local line sits inside or right beside them.
FULL_PATCH_APPLIES = {
    "43 at the top, 14 at the start of train()": True,
    "43 before _setup, 14 before the save_state call": False,
    "43 in _setup before the prepare, 14 in the train loop": True,
    "43 before _build_lr_scheduler, 14 in _save_checkpoint after step_dir": False,
    "43 right after the prepare, 14 at the start of train()": False,
}


@pytest.fixture(params=list(PLACEMENTS))
def placement(request) -> str:
    return request.param


@pytest.fixture
def local_copy(placement, extract, tmp_path):
    copy = extract.copy_to(tmp_path / "mova", integration=None)
    trainer = copy / TRAINER
    trainer.write_text(with_local_lines(trainer.read_text(), PLACEMENTS[placement]))
    compile(trainer.read_text(), str(trainer), "exec")  # the local lines themselves are valid Python
    source = trainer.read_text()
    assert source.count("def train(self):") == 1
    line = lambda text: source[:source.index(text)].count("\n") + 1  # noqa: E731
    assert line("def train(self):") == 370 + 43  # 43 lines lower, as in the reporter's traceback
    return copy


def function_body(tree: ast.Module, name: str) -> list[ast.stmt]:
    return next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name).body


def statements(tree, name) -> list[str]:
    return [ast.unparse(stmt) for stmt in function_body(tree, name)]


def test_the_minimal_integration_lands_right_after_the_prepare(local_copy):
    trainer = local_copy / TRAINER
    placed = integrate(trainer)
    body = statements(ast.parse(trainer.read_text()), "_setup")
    prepare = next(i for i, s in enumerate(body) if ".prepare(" in s and s.startswith("self.model"))
    assert body[prepare + 1:prepare + 3] == ["import ckptdoctor",
                                             "ckptdoctor.install(self.accelerator, save_root=self.save_path)"]
    assert placed.function == "_setup" and placed.accelerator == "self.accelerator"
    assert trainer.read_text().count("ckptdoctor.install(") == 1


def test_the_full_patch_applies_correctly_or_stops_and_changes_nothing(local_copy, placement):
    """`git apply --check` then `git apply`, as the guide says (run from MOVA's top directory,
    git discovering no other work tree): no fuzz, so a hunk whose context moved is refused."""
    trainer = local_copy / TRAINER
    before = trainer.read_text()
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(local_copy.parent)}
    check = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=local_copy, env=env,
                           capture_output=True, text=True)
    assert (check.returncode == 0) == FULL_PATCH_APPLIES[placement], check.stderr  # 2 of 5, as documented
    if check.returncode != 0:
        assert trainer.read_text() == before and "patch does not apply" in check.stderr
        return
    subprocess.run(["git", "apply", str(PATCH)], cwd=local_copy, env=env, check=True)
    tree = ast.parse(trainer.read_text())
    setup = statements(tree, "_setup")
    prepare = next(i for i, s in enumerate(setup) if ".prepare(" in s and s.startswith("self.model"))
    assert setup[prepare + 1] == "self.ckpt = ScalableCheckpointing(self.accelerator)"
    save = "\n".join(statements(tree, "_save_checkpoint"))
    assert "self.ckpt.begin(" in save and "self.ckpt.save_state(" in save and "self.ckpt.commit(" in save
    assert "self.ckpt.load_state(" in "\n".join(statements(tree, "_resume_checkpoint"))
    assert "self.ckpt.latest(" in "\n".join(statements(tree, "_find_latest_checkpoint"))
    assert "self.ckpt" not in "\n".join(statements(tree, "train") + statements(tree, "_build_lr_scheduler"))


def test_a_second_prepare_of_the_model_stops_the_minimal_integration_with_one_line(extract, tmp_path):
    copy = extract.copy_to(tmp_path / "mova", integration=None)
    trainer = copy / TRAINER
    text = trainer.read_text()
    at = text.index("    def _setup_lora(self):")
    trainer.write_text(text[:at] + SECOND_PREPARE + text[at:])
    before = trainer.read_text()
    with pytest.raises(CannotIntegrate) as stopped:
        integrate(trainer)
    assert "2 statements prepare a model (lines 243, 283)" in str(stopped.value) and "\n" not in str(stopped.value)
    assert trainer.read_text() == before


def test_the_cli_inserts_once_and_then_says_it_is_there(extract, tmp_path):
    copy = extract.copy_to(tmp_path / "mova", integration=None)
    run = lambda *args: subprocess.run([CKPTDOCTOR, "integrate", *args], cwd=copy,  # noqa: E731
                                       capture_output=True, text=True)
    first = run(str(TRAINER))
    assert first.returncode == 0 and \
        "inserted `ckptdoctor.install(self.accelerator, save_root=self.save_path)` at " in first.stdout
    assert "note:" not in first.stdout  # the save root was read from MOVA's code; no subclass overrides _setup
    again = run(str(TRAINER))
    assert again.returncode == 0 and "ckptdoctor.install is already there; nothing changed" in again.stdout
    missing = run("no/such/file.py")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "No such file" in missing.stderr


def test_integrate_refuses_a_trainer_that_already_has_the_full_patch(mova_copies):
    """The other direction (install, then the patch's ScalableCheckpointing at run time) is
    refused by the fix itself (tests/fix/test_checkpointing.py, on gloo ranks)."""
    trainer = mova_copies["patched"] / TRAINER
    before = trainer.read_bytes()
    run = subprocess.run([CKPTDOCTOR, "integrate", str(trainer)], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "this trainer already makes a ScalableCheckpointing (the full patch)" in run.stderr
    assert trainer.read_bytes() == before


def test_integrate_notes_a_subclass_that_overrides_the_method_it_edits(extract, tmp_path):
    copy = extract.copy_to(tmp_path / "mova", integration=None)
    sub = copy / "mova" / "engine" / "trainer" / "accelerate" / "npu_trainer.py"
    sub.write_text("from .accelerate_trainer import AccelerateTrainer\n\n\n"
                   "class NpuTrainer(AccelerateTrainer):\n    def _setup(self):\n        pass\n")
    run = subprocess.run([CKPTDOCTOR, "integrate", str(TRAINER)], cwd=copy, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "npu_trainer.py:4: NpuTrainer subclasses AccelerateTrainer and overrides _setup()" \
        in notes[0], run.stdout
