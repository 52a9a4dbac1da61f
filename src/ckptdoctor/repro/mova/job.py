"""MOVA's real trainer, run here: a scratch copy of the extract (patched or not), a config file
in MOVA's format, and `accelerate launch` with MOVA's own accelerate config.

    extract = Extract.find()                              # ../shared/mova-feat-npu, checked
    copy = extract.copy_to(workdir / "mova", integration="full")
    outcome = run_mova(MovaRun(mode="sft"), copy, workdir / "run", deadline_s=1800)

`accelerate launch` starts the ranks through torchrun, as the reporter's job does: torchrun's
agent hosts the job's TCP store and tears the job down when a rank fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ...errors import CkptDoctorError
from ..patching import PatchNotApplied, apply_diff
from ..launcher import wait_for_torchrun
from .rank import FROZEN_PID, MovaRankSpec

EXTRACT_ENV = "CKPTDOCTOR_MOVA_EXTRACT"
COMMIT = "056ea5dad743378806294303d19798041b4322ca"  # MOVA feat/npu, the extract's ORIGIN.md
REPO = Path(__file__).resolve().parents[4]
PATCH = REPO / "patches" / "mova-feat-npu.patch"
CONTEXT_PARALLEL = 4  # fsdp_8.yaml: parallelism_config_cp_size
ACCELERATE_CONFIG = Path("configs") / "training" / "accelerate" / "fsdp_8.yaml"
TRAINER = Path("mova") / "engine" / "trainer" / "accelerate" / "accelerate_trainer.py"
# sha256 of the files the fix and the harness read, at COMMIT (so that another commit is caught)
CHECKED_FILES = {
    "mova/engine/trainer/accelerate/accelerate_trainer.py": "584a928be427658f9beff35ac51d60d1e5939626d9e24e5b2ad5a69b9fe0c6db",
    "mova/engine/trainer/accelerate/lora_utils.py": "c7718bee1ca073940a0f8f7ceb2bdd82bdc24f14f4fa9da5463917d757cede0f",
    "scripts/training_scripts/accelerate_train.py": "d622b46385d2c4e1af06e3ebd80bf8a7b11c92ee92bb9fd3965c0191ee7c4ed7",
    "configs/training/accelerate/fsdp_8.yaml": "b937c3a53bfa009e432c15b52818dde346b9872dd5b52615b66b198877e398d6",
}
# sha256 of what patches/mova-feat-npu.patch makes of them: a copy counts as patched when it holds these
PATCHED_FILES = {
    "mova/engine/trainer/accelerate/accelerate_trainer.py": "34e66956bcbd24804471e2aa69842310612900da2164e251b88b7008ccbdc2ef",
}
# sha256 of what `ckptdoctor integrate` (the minimal integration) makes of MOVA's trainer
INTEGRATED_FILES = {
    "mova/engine/trainer/accelerate/accelerate_trainer.py": "07dbe0b4aead302ea99fe3007de6f98103efce32b6b13745960b77861e4a3b1c",
}
INTEGRATIONS = (None, "full", "minimal")  # stock; patches/mova-feat-npu.patch; ckptdoctor integrate


class ExtractProblem(CkptDoctorError):
    """The MOVA extract is missing, at another commit, or the patch does not apply."""


@dataclasses.dataclass(frozen=True)
class Extract:
    path: Path

    @classmethod
    def find(cls, path: str | os.PathLike | None = None) -> "Extract":
        """The extract at `path`, $CKPTDOCTOR_MOVA_EXTRACT or ../shared/mova-feat-npu, checked."""
        where = Path(path or os.environ.get(EXTRACT_ENV) or REPO.parent / "shared" / "mova-feat-npu").absolute()
        origin = where / "ORIGIN.md"
        if not origin.is_file():
            raise ExtractProblem(f"no MOVA extract at {where} (set {EXTRACT_ENV} to MOVA's feat/npu branch)")
        if COMMIT not in origin.read_text():
            raise ExtractProblem(f"the MOVA extract at {where} is not at commit {COMMIT[:7]} (its ORIGIN.md names "
                                 f"another); ckptdoctor's patch and harness are checked on that commit only")
        for name, digest in CHECKED_FILES.items():
            if not (where / name).is_file():
                raise ExtractProblem(f"the MOVA extract at {where} has no {name}")
            if hashlib.sha256((where / name).read_bytes()).hexdigest() != digest:
                raise ExtractProblem(f"{where / name} differs from MOVA {COMMIT[:7]}'s")
        return cls(where)

    def copy_to(self, dest: Path, integration: str | None) -> Path:
        """A writable copy of MOVA's code and configs, with the fix integrated: None (stock MOVA),
        "full" (patches/mova-feat-npu.patch) or "minimal" (`ckptdoctor integrate`)."""
        if integration not in INTEGRATIONS:
            raise ExtractProblem(f"unknown integration {integration!r}; expected 'full' or 'minimal'")
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(self.path, dest, ignore=shutil.ignore_patterns("__pycache__", "ORIGIN.md"))
        for path in [dest, *dest.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
        if integration == "full":
            apply_patch(dest)
        elif integration == "minimal":
            integrate_minimal(dest)
        return dest


MOVA_IMPORTS = ("mmengine", "diffusers", "transformers", "einops", "yunchang", "ftfy", "torchvision")


def check_dependencies() -> None:
    """MOVA's own imports, installed in this stack (scripts/setup.sh does it)."""
    import importlib.util

    missing = [name for name in MOVA_IMPORTS if importlib.util.find_spec(name) is None]
    if missing:
        raise ExtractProblem(f"MOVA's trainer needs {', '.join(missing)} in this environment (scripts/setup.sh "
                             f"installs them from requirements/)")


_warmed: set[str] = set()


def warm_first_imports(python: str, env: dict) -> None:
    """Import mmengine once, in one process, before eight ranks of MOVA do it at once.

    On a fresh environment the first `import mmengine` makes yapf write its grammar cache
    (`~/.cache/YAPF/.../*.pickle`, not atomically), and a rank that reads it while another writes
    fails with `EOFError: Ran out of input` (seen on a fresh clone's first reproduction). Done
    once per interpreter; a failure here is left for the launch to report."""
    if python in _warmed:
        return
    subprocess.run([python, "-c", "import mmengine.config"], env=env,
                   capture_output=True, timeout=900)
    _warmed.add(python)


def apply_patch(tree: Path, check_only: bool = False) -> None:
    """Apply the fix's patch to a copy of the extract; it counts as applied when the patched
    files hash to PATCHED_FILES (one clear line otherwise)."""
    try:
        apply_diff(tree, PATCH, expected=PATCHED_FILES, check_only=check_only)
    except PatchNotApplied as problem:
        raise ExtractProblem(str(problem)) from None


def integrate_minimal(tree: Path) -> None:
    """`ckptdoctor integrate` on the copy's trainer, as the guide says to run it; it counts as
    done when the file hashes to INTEGRATED_FILES."""
    from ...integrate import integrate

    integrate(tree / TRAINER)
    digest = hashlib.sha256((tree / TRAINER).read_bytes()).hexdigest()
    if digest != INTEGRATED_FILES[str(TRAINER)]:
        raise ExtractProblem(f"`ckptdoctor integrate` left {tree / TRAINER} other than expected (sha256 {digest[:12]})")


@dataclasses.dataclass
class MovaRun:
    """One job of MOVA's trainer, with the values of MOVA's own configs where they matter."""

    mode: str = "sft"                  # "sft" (use_lora False) or "lora"
    world_size: int = 8                # fsdp_8.yaml: num_processes 8 (cp 4 x dp_shard 2)
    context_parallel: int = CONTEXT_PARALLEL  # folded into the FSDP mesh; the data-parallel size is the rest
    video_layers: int = 12
    max_steps: int = 4                 # micro-steps, as MOVA counts global_step
    save_interval: int = 4             # a multiple of gradient accumulation: saves fall on optimizer steps
    gradient_accumulation_steps: int = 4  # mova_train_accelerate_8.py
    # Default: an epoch ends at every save. MOVA's resume restarts the data iterator, whose creation
    # draws the sampler's seed from torch's global RNG; an uninterrupted run makes the same draw
    # only where an epoch ends, so only there can the two continue bit for bit.
    dataset_length: int | None = None
    resume_from: str | None = None
    fault: dict | None = None
    roundtrip: bool = False            # after training: resume from "final" in place and compare bit for bit
    env: dict = dataclasses.field(default_factory=dict)  # more environment for the ranks (e.g. CKPTDOCTOR_ASYNC)
    job_timeout_s: float = 1200.0

    @property
    def data_parallel_size(self) -> int:
        """The ranks the dataloader is split over: fsdp_8.yaml folds context parallelism (4) into
        the mesh, so 8 ranks hold 2 data-parallel shards."""
        return max(1, self.world_size // self.context_parallel)

    def config_text(self, save_path: Path) -> str:
        """A config file in the format of MOVA's configs/training/mova_train_accelerate_8.py."""
        length = self.dataset_length or self.save_interval * self.data_parallel_size
        trainer = dict(max_steps=self.max_steps, num_train_timesteps=1000,
                       gradient_accumulation_steps=self.gradient_accumulation_steps, gradient_clip_norm=1.0,
                       mixed_precision="bf16", use_fsdp=True, warmup_steps=2, lr_scheduler_type="cosine",
                       min_lr=1e-6, log_interval=1, logger_type="none", save_interval=self.save_interval,
                       save_path=str(save_path), resume_from=self.resume_from,
                       train_modules=["video_dit", "video_dit_2", "audio_dit", "dual_tower_bridge"],
                       use_lora=self.mode == "lora", enable_cp=False)
        sections = {
            "diffusion_pipeline": dict(type="TinyMOVATrain", video_layers=self.video_layers),
            "data": dict(dataset=dict(type="TinyVideoAudioDataset", length=length), transform=None, batch_size=1,
                         num_workers=0),
            "optimizer": dict(type="AdamW", lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8),
            "lora": dict(rank=16, alpha=16.0, dropout=0.0,
                         target_modules=["q", "k", "v", "o", "to_q", "to_k", "to_v", "proj"]),
            "fsdp": dict(sharding_strategy="FULL_SHARD", cpu_offload=True, backward_prefetch="BACKWARD_PRE",
                         reshard_after_forward=True),
            "trainer": trainer,
        }
        head = "# Written by ckptdoctor's MOVA harness, after configs/training/mova_train_accelerate_8.py\n"
        return head + "".join(f"{name} = {value!r}\n" for name, value in sections.items())


@dataclasses.dataclass
class MovaOutcome:
    ranks: list[dict]
    returncode: int
    log_path: Path
    save_path: Path
    wall_s: float


def run_mova(run: MovaRun, extract_copy: Path, root: Path, deadline_s: float, *, save_path: Path | None = None,
             time_collectives: bool = False, python: str | None = None, progress=None) -> MovaOutcome:
    """Launch MOVA's `accelerate_train.py` on `run.world_size` ranks with `accelerate launch`.
    Without `save_path`, the run saves into a fresh `root/checkpoints` (MOVA resumes from any
    checkpoint it finds there); with one, it finds what is there, as MOVA does.
    Every path is made absolute here: each rank changes into the copy before it reads them."""
    root, extract_copy = Path(root).absolute(), Path(extract_copy).absolute()
    save_path = None if save_path is None else Path(save_path).absolute()
    root.mkdir(parents=True, exist_ok=True)
    if save_path is None:
        shutil.rmtree(root / "checkpoints", ignore_errors=True)
    results = root / "results"
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir()
    save_path = save_path or root / "checkpoints"
    config = root / "mova_config.py"
    config.write_text(run.config_text(save_path))
    spec = root / "rank_spec.json"
    spec.write_text(MovaRankSpec(str(extract_copy), str(config), str(results), deadline_s,
                                 time_collectives=time_collectives, fault=run.fault,
                                 roundtrip=run.roundtrip).to_json())
    args = [python or sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(extract_copy / ACCELERATE_CONFIG), "--main_process_port", "0",
            "-m", "ckptdoctor.repro.mova.rank", str(spec)]
    if (run.world_size, run.context_parallel) != (8, CONTEXT_PARALLEL):  # accelerate launch's own flags
        args[5:5] = ["--num_processes", str(run.world_size), "--parallelism_config_cp_size", str(run.context_parallel),
                     "--parallelism_config_dp_shard_size", str(run.data_parallel_size)]
    log_path = root / "job.log"
    if progress:
        progress(f"  MOVA {run.mode}: {run.world_size} ranks, gloo deadline {deadline_s:.3f} s, log {log_path}")
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                              os.environ.get("PYTHONPATH")])),
           **run.env}
    warm_first_imports(args[0], env)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        code = wait_for_torchrun(proc, results / FROZEN_PID, start + run.job_timeout_s)
    ranks = []
    for rank in range(run.world_size):
        path = results / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "status": "no report"})
    if progress:
        progress(f"  MOVA {run.mode}: done in {time.time() - start:.0f} s, exit code {code}")
    return MovaOutcome(ranks, code, log_path, save_path, time.time() - start)
