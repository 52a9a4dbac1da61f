"""The 8-rank reproduction of the save_state gloo timeout.

Scale the deadline, not the mechanism. The reporter's peers waited 1,800 s in the plan
scatter for rank 0; 8 ranks cannot make rank 0 plan for 30 minutes. So `reproduce()` runs the
real training job (MOVA's own trainer, or the look-alike one) several times:

1. calibration, under a long deadline, saving twice: measure, from torch's own DCP events and
   timed gloo operations, how long the peers wait for rank 0 in the target save's plan
   scatter, and every other wait of the default group before it (in both saves: the
   calibration keeps the worst case of each);
2. the reproduction, with the default group's gloo deadline between the two (their geometric
   mean), so that the target save times out in the plan scatter, through torch's own work
   (no sleeps, nothing injected), while every earlier wait passes;
3. if an attempt failed in another wait, or did not fail, the bounds move past what it showed
   and the next attempt runs at the new deadline (`attempts` in all); every attempt is reported.

The target is what the report shows for full fine-tuning: the optimizer save (the model save
completed before it). In LoRA mode the optimizer is tiny and the model save, first, is the long
one. A job whose waits cannot be separated says so (NotSeparable) and what to change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

from ..diagnose import callpath
from .timeline import CollectiveCall, SaveWaits, StepEvent, longest_wait, phase_at, save_timeline, save_waits
from ..errors import CkptDoctorError
from ..fix.compat import installed_versions
from ..fix.index import METADATA_NAME
from ..ranks import format_ranks
from .config import CHECKPOINT_TIMEOUT_FACTOR, TrainingConfig
from .launcher import launch
from ..check.mova_shape import MovaShape
from .worker import WorkerSpec

MODEL_SAVE, OPTIMIZER_SAVE = "pytorch_model_fsdp_0", "optimizer_0"
CALL_OF_SAVE = {MODEL_SAVE: "save_fsdp_model", OPTIMIZER_SAVE: "save_fsdp_optimizer"}
MIN_RATIO = 1.5        # the target's wait over the longest wait that must pass, at the least
ADJUST = 1.25          # after a wrong attempt, a bound moves this far past the deadline that failed it
REPORTED_DEADLINE_S = 1800.0
DEFAULT_LAYERS = {"lookalike": 24, "mova": 24}  # separation measured in docs/evidence/repro_separation.txt
TRAINERS = ("auto", "mova", "lookalike")


class NotSeparable(CkptDoctorError):
    """The job's own waits leave no room for a deadline between them."""


@dataclasses.dataclass
class ReproOptions:
    world_size: int = 8
    mode: str = "sft"
    trainer: str = "auto"               # "lookalike" (repro/trainer.py), "mova" (MOVA's own, repro/mova) or "auto"
    video_layers: int | None = None     # None: DEFAULT_LAYERS[trainer]
    output_dir: Path = Path("runs/repro")
    deadline_s: float | None = None     # None: chosen from the calibration run
    fix: bool = False
    integration: str = "full"           # with fix, on MOVA's trainer: "full" (the patch) or "minimal" (integrate)
    async_save: bool = False            # with fix: saves in the background (CKPTDOCTOR_ASYNC=1, fix/background.py)
    roundtrip: bool = True              # with fix: load the checkpoint back in place and compare bit for bit
    offload_params: bool = True
    cp_size: int = 1
    attempts: int = 3
    extract: str | None = None          # MOVA extract (default: $CKPTDOCTOR_MOVA_EXTRACT or ../shared/mova-feat-npu)
    job_timeout_s: float = 1200.0

    def __post_init__(self):
        self.training_config()  # the layout first: its errors name the world size
        self._refuse_what_cannot_run()
        # Made absolute once, here: every job below crosses a process boundary, and MOVA's ranks chdir.
        self.output_dir = Path(self.output_dir).absolute()
        if self.extract is not None:
            self.extract = str(Path(self.extract).absolute())

    def _refuse_what_cannot_run(self) -> None:
        """One line for the first thing that makes these options unrunnable."""
        if self.world_size < 2:
            raise CkptDoctorError(f"a reproduction needs at least 2 ranks (a coordinator and a peer that waits for "
                                  f"it), got {self.world_size}")
        if self.video_layers is not None and self.video_layers < 1:
            raise CkptDoctorError(f"--layers must be at least 1, got {self.video_layers}")
        if self.attempts < 1:
            raise CkptDoctorError(f"--attempts must be at least 1, got {self.attempts}")
        if self.trainer not in TRAINERS:
            raise CkptDoctorError(f"unknown trainer {self.trainer!r}; expected 'auto', 'mova' or 'lookalike'")
        if self.trainer != "lookalike" and (self.cp_size > 1 or not self.offload_params or self.world_size != 8):
            raise CkptDoctorError("MOVA's trainer runs MOVA's own accelerate config (fsdp_8.yaml: 8 ranks, cp 4, "
                                  "offload): --ranks, --cp and --no-offload are the look-alike trainer's (add "
                                  "--trainer lookalike)")
        if self.integration not in ("full", "minimal"):
            raise CkptDoctorError(f"unknown integration {self.integration!r}; expected 'full' or 'minimal'")
        if self.integration != "full" and not self.fix:
            raise CkptDoctorError("--integration chooses how the fix reaches MOVA's trainer: it needs --fix")
        if self.async_save and not self.fix:
            raise CkptDoctorError("--async saves through the fix in the background: it needs --fix")
        if not self.roundtrip and not self.fix:
            raise CkptDoctorError("--no-roundtrip skips loading the fixed job's checkpoint back: it needs --fix")
        if self.cp_size > 1 and self.deadline_s is None:
            raise CkptDoctorError("--cp > 1 puts training on the default group, so it needs an explicit long --deadline")

    @property
    def layers(self) -> int:
        if self.trainer not in DEFAULT_LAYERS:
            raise CkptDoctorError("the trainer is chosen (trainer_for) before its layers are read")
        return self.video_layers or DEFAULT_LAYERS[self.trainer]

    def training_config(self, max_steps: int = 1) -> TrainingConfig:
        """The look-alike's job: one micro-step per optimizer step (MOVA accumulates 4): the saves
        are the same, each job three forward/backward passes shorter per step (as MovaTrainer's)."""
        return TrainingConfig(world_size=self.world_size, mode=self.mode, offload_params=self.offload_params,
                              cp_size=self.cp_size, max_steps=max_steps, gradient_accumulation_steps=1)

    def shape(self) -> MovaShape:
        return MovaShape().with_layers(self.layers)

    @property
    def target_save(self) -> str:
        return MODEL_SAVE if self.mode == "lora" else OPTIMIZER_SAVE


@dataclasses.dataclass
class JobOutcome:
    ranks: list[dict]           # each rank's rank<N>.json
    events: list[StepEvent]
    calls: list[CollectiveCall]
    returncodes: list[int]
    log_path: Path
    checkpoint_dir: Path        # the first save's Accelerate directory
    wall_s: float


def outcome_of(ranks: list[dict], returncodes, log_path: Path, checkpoint_dir: Path, wall_s: float) -> JobOutcome:
    events = [StepEvent(**e) for r in ranks for e in r.get("events", [])]
    calls = [CollectiveCall(**c) for r in ranks for c in r.get("calls", [])]
    return JobOutcome(ranks, events, calls, list(returncodes), log_path, checkpoint_dir, wall_s)


def run_job(opts: ReproOptions, name: str, deadline_s: float, progress=print, time_collectives=False,
            fix: bool = False, saves: int = 1) -> JobOutcome:
    """One real N-process job of the look-alike trainer whose default group has `deadline_s`
    (saving `saves` times; with the fix when `fix`)."""
    root = Path(opts.output_dir) / name
    shutil.rmtree(root, ignore_errors=True)
    (root / "results").mkdir(parents=True)
    spec = WorkerSpec(opts.training_config(max_steps=saves), opts.shape(), str(root / "checkpoints"),
                      str(root / "results"), checkpoint_deadline_s=deadline_s, fix=fix,
                      roundtrip=fix and opts.roundtrip,
                      time_collectives=time_collectives)
    spec_path = root / "spec.json"
    spec_path.write_text(spec.to_json())
    progress(f"  {name}: {opts.world_size} ranks, {opts.mode}, gloo deadline {deadline_s:.3f} s, log {root / 'job.log'}")
    job = launch(["-m", "ckptdoctor.repro.worker", str(spec_path)], opts.world_size, root / "job.log",
                 timeout_s=opts.job_timeout_s, env=async_env(opts, fix))
    ranks = []
    for rank in range(opts.world_size):
        path = root / "results" / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "status": "no report"})
    progress(f"  {name}: done in {job.wall_s:.0f} s, exit codes {job.returncodes}")
    return outcome_of(ranks, job.returncodes, job.log_path, root / "checkpoints" / "step-1" / "accelerator", job.wall_s)


FIRST_SAVE = "step-1"  # the reproduction's MOVA job: its interval save, before "final"


def background_stalls(log_path) -> list[float]:
    """How long training waited at each async save, from rank 0's INFO lines (summary.py)."""
    return [float(m) for m in re.findall(r"in the background: training waited (\d+(?:\.\d+)?) s",
                                         Path(log_path).read_text(errors="replace"))]


def async_env(opts: ReproOptions, fix: bool) -> dict:
    """The job's environment for --async: the fix reads CKPTDOCTOR_ASYNC on every rank."""
    return {"CKPTDOCTOR_ASYNC": "1"} if fix and opts.async_save else {}


class MovaTrainer:
    """MOVA's own trainer from the extract (repro/mova): unpatched for the reproduction,
    with patches/mova-feat-npu.patch applied for the fix."""

    def __init__(self, opts: ReproOptions):
        from .mova.job import Extract, check_dependencies

        self.opts = opts
        self.extract = Extract.find(opts.extract)
        check_dependencies()
        self.copies: dict[bool, Path] = {}

    def run(self, name: str, deadline_s: float, progress=print, time_collectives=False, fix=False,
            saves: int = 1) -> JobOutcome:
        from .mova.job import MovaRun, run_mova

        integration = self.opts.integration if fix else None
        if integration not in self.copies:
            copy = {None: "mova", "full": "mova-patched", "minimal": "mova-integrated"}[integration]
            self.copies[integration] = self.extract.copy_to(Path(self.opts.output_dir) / copy, integration)
        # One optimizer step, then MOVA saves at the interval ("step-1") and again at the end ("final"):
        # two saves. Without gradient accumulation (MOVA's config: 4) one micro-step is an optimizer
        # step; the saves are the same (parameters and optimizer state after one step), and each job
        # is three forward/backward passes shorter (about 25 s at 24 layers on 2 cores).
        run = MovaRun(mode=self.opts.mode, world_size=self.opts.world_size, video_layers=self.opts.layers,
                      max_steps=1, save_interval=1, gradient_accumulation_steps=1,
                      roundtrip=fix and self.opts.roundtrip,
                      job_timeout_s=self.opts.job_timeout_s, env=async_env(self.opts, fix))
        root = Path(self.opts.output_dir) / name
        out = run_mova(run, self.copies[integration], root, deadline_s, time_collectives=time_collectives, progress=progress)
        first = out.save_path / FIRST_SAVE
        staged = sorted(out.save_path.glob(f"{FIRST_SAVE}.incomplete-*")) if not first.exists() else []
        checkpoint = (staged[0] if staged else first) / "accelerator"
        codes = [0 if r.get("status") == "ok" else 1 for r in out.ranks]
        return outcome_of(out.ranks, codes, out.log_path, checkpoint, out.wall_s)


class LookAlikeTrainer:
    def __init__(self, opts: ReproOptions):
        self.opts = opts

    def run(self, name, deadline_s, progress=print, time_collectives=False, fix=False, saves: int = 1) -> JobOutcome:
        return run_job(self.opts, name, deadline_s, progress, time_collectives=time_collectives, fix=fix, saves=saves)


def trainer_for(opts: ReproOptions, progress=print):
    """The trainer to run: "auto" takes MOVA's own when its extract is here, else the look-alike."""
    from .mova.job import Extract, ExtractProblem

    if opts.trainer == "auto":
        try:
            Extract.find(opts.extract)
            opts.trainer = "mova"
        except ExtractProblem as problem:
            progress(f"[trainer] the look-alike trainer: MOVA's own is not available ({problem})")
            opts.trainer = "lookalike"
        else:
            progress("[trainer] MOVA's own trainer (accelerate_train.py -> AccelerateTrainer), from its extract")
    if opts.trainer == "mova":
        return MovaTrainer(opts)
    if opts.fix and opts.integration != "full":
        raise CkptDoctorError("--integration minimal runs on MOVA's trainer (its extract is needed); the look-alike "
                              "saves through ScalableCheckpointing directly")
    return LookAlikeTrainer(opts)


# -- calibration: the waits, worst case over the calibration run's saves ---------------------

@dataclasses.dataclass
class Calibration:
    waits: dict[str, list[SaveWaits]]  # per save name, one per save of it in the run
    barrier_wait_s: float              # the longest wait of the trainer's own default-group calls before
                                       # the first save (wait_for_everyone, the data loader's RNG broadcast)
    outcome: JobOutcome

    def first(self, save: str) -> SaveWaits:
        return self.waits[save][0]


def measure(outcome: JobOutcome, world_size: int) -> Calibration:
    failed = [r["rank"] for r in outcome.ranks if r.get("status") != "ok"]
    if failed:
        first = outcome.ranks[failed[0]]
        raise CkptDoctorError(f"calibration run failed on ranks {failed}: {first.get('error', first['status'])} "
                              f"(log: {outcome.log_path})")
    keys = sorted({e.save for e in outcome.events if e.step == "save"})
    waits = {save: [save_waits(outcome.events, outcome.calls, key, world_size) for key in keys
                    if key.split("@")[0] == save] for save in (MODEL_SAVE, OPTIMIZER_SAVE)}
    # The trainer's default-group calls an attempt meets before its first save; later ones follow
    # a save whose metadata broadcast the peers unpickle and rank 0 does not, which no attempt gets to.
    first_save = min(e.time_s for e in outcome.events if e.step == "save")
    trainers = [c for c in outcome.calls if c.name in ("barrier", "broadcast") and c.start_s < first_save
                and c.default_group]
    return Calibration(waits, max(longest_wait(trainers, "barrier"), longest_wait(trainers, "broadcast")), outcome)


@dataclasses.dataclass
class DeadlineChoice:
    deadline_s: float
    target_save: str      # the save whose plan scatter should time out
    below_s: float        # the longest wait that must pass
    above_s: float        # the target's shortest plan-scatter wait

    @property
    def ratio(self) -> float:
        return self.above_s / self.below_s if self.below_s > 0 else math.inf

    def margins(self) -> dict:
        return {"must_pass_s": round(self.below_s, 3), "target_wait_s": round(self.above_s, 3),
                "deadline_s": round(self.deadline_s, 3), "ratio": round(self.ratio, 2),
                "room_below": round(self.deadline_s / self.below_s, 2) if self.below_s else None,
                "room_above": round(self.above_s / self.deadline_s, 2)}


def choose_deadline(cal: Calibration, target: str) -> DeadlineChoice:
    """The deadline at the geometric mean of the longest wait that must pass and the target's
    shortest plan-scatter wait, over every save of the calibration run."""
    model, optim = cal.waits[MODEL_SAVE], cal.waits[OPTIMIZER_SAVE]
    earlier = [cal.barrier_wait_s] + [w.before_scatter_wait_s for w in model]
    if target == OPTIMIZER_SAVE:  # the model save must complete first, as in the report
        earlier += [w.plan_scatter_wait_s[1] for w in model] + [w.after_scatter_wait_s for w in model]
        earlier += [w.before_scatter_wait_s for w in optim]
    above = min(w.plan_scatter_wait_s[0] for w in cal.waits[target])
    return bounded(target, max(earlier), above)


def bounded(target: str, below: float, above: float) -> DeadlineChoice:
    if above < MIN_RATIO * below:
        raise NotSeparable(
            f"cannot separate the waits: the peers wait {above:.2f} s for rank 0 in the {CALL_OF_SAVE[target]} plan "
            f"scatter, and waits that must pass reach {below:.2f} s (ratio {above / below:.2f}, needs {MIN_RATIO}); "
            f"more layers (--layers) make planning dominate, a quieter machine shrinks the other waits")
    # gloo counts whole milliseconds (truncated): a deadline of whole milliseconds makes the report's
    # deadline_ms, gloo's "Timed out waiting <ms>ms" and a rerun at deadline_ms / 1000 the same deadline
    return DeadlineChoice(round(math.sqrt(below * above), 3), target, below, above)


def recalibrate(choice: DeadlineChoice, report: dict) -> DeadlineChoice:
    """After an attempt that did not reproduce, move one bound past the deadline and choose
    again: if the target save completed, its wait can be that short; if it did not, an earlier
    wait lasted the deadline, so waits that must pass can be that long. Raises NotSeparable
    when no room is left."""
    target_done = report["optimizer_save_ok"] if choice.target_save == OPTIMIZER_SAVE else report["model_save_ok"]
    if target_done:  # the target's wait passed the deadline: it can be that short
        below, above = choice.below_s, min(choice.above_s, choice.deadline_s / ADJUST)
    else:            # an earlier wait lasted the deadline: waits that must pass can be that long
        below, above = max(choice.below_s, choice.deadline_s * ADJUST), choice.above_s
    return bounded(choice.target_save, below, above)


# -- reading an attempt ---------------------------------------------------------------------

def failing_rank_report(outcome: JobOutcome) -> dict | None:
    """The first rank (by time) whose failure was a gloo timeout."""
    timed_out = [r for r in outcome.ranks if r.get("status") == "failed" and callpath.gloo_timeout_ms(r.get("error", ""))]
    return min(timed_out, key=lambda r: (r.get("error_time_s", math.inf), r["rank"]), default=None)


def save_completed(outcome: JobOutcome, save: str) -> bool:
    """All ranks finished writing the first such save, and its metadata file exists."""
    metadata = outcome.checkpoint_dir / save / METADATA_NAME
    writers = {e.rank for e in outcome.events if e.save == save and e.step == "write_data" and e.event == "end"}
    return metadata.exists() and len(writers) == len(outcome.ranks)


def describe_timeline(outcome: JobOutcome, save: str, world_size: int, at_s: float | None) -> tuple[list[dict], dict]:
    """Rows of the save's per-rank phases, and where each rank was at `at_s`."""
    spans = save_timeline(outcome.events, save, world_size, calls=outcome.calls)
    t0 = min((s.start_s for s in spans), default=0.0)
    rows = [{"rank": s.rank, "phase": s.phase, "start_s": round(s.start_s - t0, 3),
             "duration_s": None if s.duration_s is None else round(s.duration_s, 3)} for s in spans]
    where = {}
    if at_s is not None:
        for rank in range(world_size):
            span = phase_at(spans, rank, at_s)
            where[rank] = None if span is None else {"phase": span.phase, "for_s": round(at_s - span.start_s, 3)}
    return rows, where


def build_report(opts: ReproOptions, outcome: JobOutcome, choice: DeadlineChoice, costs: Calibration | None) -> dict:
    torch_v, accelerate_v = installed_versions()
    failing = failing_rank_report(outcome)
    frames = [f["function"] for f in failing["frames"]] if failing else []
    point = callpath.locate(frames)
    failed_save = next((s for s, call in CALL_OF_SAVE.items() if call == point.accelerate_call), None)
    timeout_at = failing.get("error_time_s") if failing else None
    # A fixed job also loads (same directory names): its events are not one save's timeline.
    timeline, where = ([], {}) if opts.fix else describe_timeline(outcome, failed_save or choice.target_save,
                                                                   opts.world_size, timeout_at)
    timed_out = [r["rank"] for r in outcome.ranks if callpath.gloo_timeout_ms(r.get("error", "")) is not None]
    model_ok, optim_ok = save_completed(outcome, MODEL_SAVE), save_completed(outcome, OPTIMIZER_SAVE)
    expected_call = CALL_OF_SAVE[choice.target_save]
    save_ok = model_ok and optim_ok and all(r.get("status") == "ok" for r in outcome.ranks)
    checked = opts.fix and opts.roundtrip
    bitexact = all(r.get("roundtrip_differences") == [] for r in outcome.ranks) if checked else None
    reproduced = bool(failing) and point.phase == "plan-scatter" and point.waiting_call == "broadcast" \
        and point.accelerate_call == expected_call and model_ok == (expected_call == "save_fsdp_optimizer")
    return {
        "reproduced": reproduced and not opts.fix,
        "fix": opts.fix, "trainer": opts.trainer, "layers": opts.layers,
        "integration": opts.integration if opts.fix and opts.trainer == "mova" else None,
        "checkpoint_group_timeout_ms": round(choice.deadline_s * 1000 * CHECKPOINT_TIMEOUT_FACTOR) if opts.fix else None,
        "save_ok": save_ok,
        "fixed": opts.fix and save_ok and bitexact is not False,
        "async_save": opts.async_save,
        "background_stalls_s": background_stalls(outcome.log_path) if opts.async_save else None,
        "roundtrip_bitexact": bitexact,
        "roundtrip_differences": {r["rank"]: r.get("roundtrip_differences") for r in outcome.ranks
                                  if r.get("roundtrip_differences")} if checked else None,
        "mode": opts.mode, "world_size": opts.world_size, "torch": torch_v, "accelerate": accelerate_v,
        "failed_phase": point.phase, "failed_call": point.accelerate_call, "waiting_call": point.waiting_call,
        "failed_rank": failing["rank"] if failing else None,
        "expected_call": expected_call, "model_save_ok": model_ok, "optimizer_save_ok": optim_ok,
        "frames": frames, "frames_match_report": callpath.matches_report(frames),
        "frame_locations": [f"{f['file']}:{f['line']} in {f['function']}" for f in failing["frames"]] if failing else [],
        "gloo_error": failing.get("error") if failing else None,
        "ranks_timed_out": timed_out,
        "where_at_timeout": where,
        "deadline_ms": round(choice.deadline_s * 1000),
        "margins": choice.margins(),
        "calibration": ({k: [dataclasses.asdict(w) for w in v] for k, v in costs.waits.items()}
                        | {"barrier_wait_s": costs.barrier_wait_s}) if costs else None,
        "timeline": timeline,
        "calibration_timeline": describe_timeline(costs.outcome, choice.target_save, opts.world_size, None)[0]
        if costs else None,
        "rank_status": {r["rank"]: r.get("status") for r in outcome.ranks},
        "log": str(outcome.log_path),
        "checkpoint_dir": str(outcome.checkpoint_dir),
    }


def attempt_summary(number: int, report: dict) -> dict:
    return {"attempt": number, "deadline_ms": report["deadline_ms"], "reproduced": report["reproduced"],
            "failed_call": report["failed_call"], "failed_phase": report["failed_phase"],
            "failed_rank": report["failed_rank"], "saves_completed": report["save_ok"]}


# -- the deadline that broke stock, kept for the fixed run in the same output directory ---------

DEADLINES_FILE = "breaking-deadlines.json"


def job_key(opts: ReproOptions) -> str:
    """What a deadline was measured on: the same job on the same stack times out at the same one."""
    torch_v, accelerate_v = installed_versions()
    return (f"{opts.trainer} {opts.mode}, {opts.world_size} ranks, {opts.layers} layers, cp {opts.cp_size}, "
            f"offload {opts.offload_params}, torch {torch_v}, accelerate {accelerate_v}")


def remember_breaking_deadline(opts: ReproOptions, report: dict) -> None:
    path = opts.output_dir / DEADLINES_FILE
    known = json.loads(path.read_text()) if path.is_file() else {}
    known[job_key(opts)] = {"deadline_s": report["deadline_ms"] / 1000, "margins": report["margins"],
                            "log": report["log"]}
    path.write_text(json.dumps(known, indent=1))


def breaking_deadline(opts: ReproOptions) -> dict | None:
    """The deadline at which a reproduction in this output directory timed out, for this job."""
    path = opts.output_dir / DEADLINES_FILE
    try:
        return json.loads(path.read_text()).get(job_key(opts))
    except (OSError, ValueError):
        return None


def reproduce(opts: ReproOptions, progress=print, trainer=None) -> dict:
    """Calibrate (unless a deadline is given), then attempt the reproduction (or the fixed save).
    The fixed save runs at the deadline a reproduction in the same output directory timed out
    at, when there is one for this job. `trainer`: another trainer to run
    (benchmarks/mova_pr68.py passes MOVA with a PR applied)."""
    trainer = trainer or trainer_for(opts, progress)
    costs, source = None, "given (--deadline)"
    recorded = breaking_deadline(opts) if opts.fix and opts.deadline_s is None else None
    if recorded:
        m = recorded["margins"]
        choice = DeadlineChoice(recorded["deadline_s"], opts.target_save, m["must_pass_s"], m["target_wait_s"])
        source = (f"{choice.deadline_s:.3f} s, at which the reproduction in {opts.output_dir} timed out "
                  f"(log {recorded['log']})")
        progress(f"[deadline] {source}")
    elif opts.deadline_s is None:
        source = "chosen by this run's calibration" + (
            f" (no reproduction of this job recorded in {opts.output_dir}; run it without --fix first to test the "
            f"fix at the deadline that broke stock)" if opts.fix else "")
        progress(f"[calibration] the same job under a {REPORTED_DEADLINE_S:.0f} s deadline, saving twice, to measure "
                 f"each wait of the save")
        costs = measure(trainer.run("calibration", REPORTED_DEADLINE_S, progress, time_collectives=True, saves=2),
                        opts.world_size)
        choice = choose_deadline(costs, opts.target_save)
        progress(f"      the peers waited {choice.above_s:.2f} s (at the least) for rank 0 in the "
                 f"{CALL_OF_SAVE[choice.target_save]} plan scatter; every wait before it <= {choice.below_s:.2f} s "
                 f"-> deadline {choice.deadline_s:.2f} s (ratio {choice.ratio:.2f})")
    else:
        choice = DeadlineChoice(opts.deadline_s, opts.target_save, float("nan"), float("nan"))
    attempts, report = [], None
    for number in range(1, (1 if opts.fix or opts.deadline_s is not None else opts.attempts) + 1):
        what = "the fixed save" if opts.fix else "reproduction"
        progress(f"[attempt {number}] {what} under the {choice.deadline_s:.2f} s deadline")
        outcome = trainer.run("fixed" if opts.fix else f"reproduction-{number}", choice.deadline_s, progress,
                              fix=opts.fix)
        report = build_report(opts, outcome, choice, costs)
        attempts.append(attempt_summary(number, report))
        if opts.fix or report["reproduced"] or number == opts.attempts or opts.deadline_s is not None:
            break
        wrong = f"{report['failed_call']} -> {report['failed_phase']}" if report["gloo_error"] else "nothing timed out"
        try:
            choice = recalibrate(choice, report)
        except NotSeparable as error:
            report["not_separable"] = str(error)
            break
        progress(f"      not the reported wait ({wrong}); bounds now {choice.below_s:.2f} s / {choice.above_s:.2f} s")
    report["attempts"] = attempts
    report["deadline_source"] = source
    if report["reproduced"]:
        remember_breaking_deadline(opts, report)
    return report


# -- the report as text -------------------------------------------------------------------------

INTEGRATION_NAMES = {"full": " (MOVA patched: patches/mova-feat-npu.patch)",
                     "minimal": " (MOVA integrated: ckptdoctor integrate, one call after accelerator.prepare)"}

def format_report(report: dict) -> str:
    """The human-readable summary printed by `ckptdoctor repro`."""
    lines = []
    who = f"{'MOVA' if report['trainer'] == 'mova' else 'look-alike'} trainer"
    if report["fix"]:
        verdict = 'FIXED' if report['fixed'] else 'FIX FAILED'
        lines.append(f"{verdict}: {report['world_size']} ranks, {who}, mode {report['mode']}, "
                     f"torch {report['torch']}, accelerate {report['accelerate']}, ScalableCheckpointing"
                     f"{INTEGRATION_NAMES.get(report.get('integration'), '')}; the default "
                     f"group keeps the {report['deadline_ms']} ms deadline that made stock time out, saves run on a "
                     f"checkpoint group with its own timeout")
        if report.get("async_save"):
            stalls = ", ".join(f"{s:.1f} s" for s in report["background_stalls_s"] or []) or "none logged"
            lines.append(f"  async: each save published in the background; training waited {stalls} "
                         f"(rank 0's INFO lines)")
        lines.append(f"  saves completed on every rank: {report['save_ok']}" + (
            "; not loaded back (--no-roundtrip)" if report["roundtrip_bitexact"] is None else
            f"; state loaded back bit-identical to the state saved, on every rank: {report['roundtrip_bitexact']}"))
        if report.get("deadline_source"):
            lines.append(f"  deadline: {report['deadline_source']}")
    else:
        attempts = report.get("attempts") or []
        verdict = "REPRODUCED" if report["reproduced"] else ("NOT SEPARABLE" if report.get("not_separable")
                                                             else "NOT reproduced")
        lines.append(f"{verdict}: {report['world_size']} ranks, {who}, mode {report['mode']}, torch {report['torch']}, "
                     f"accelerate {report['accelerate']}, gloo deadline {report['deadline_ms']} ms"
                     + (f", attempt {len(attempts)} of {len(attempts)}" if len(attempts) > 1 else ""))
        for a in attempts[:-1]:
            lines.append(f"  attempt {a['attempt']} at {a['deadline_ms']} ms: "
                         + (f"failed in {a['failed_call']} -> {a['failed_phase']} (rank {a['failed_rank']})"
                            if a["failed_call"] else "nothing timed out"))
        if report.get("not_separable"):
            lines.append(f"  {report['not_separable']}")
    m = report.get("margins") or {}
    if m.get("ratio") is not None and not math.isnan(m.get("must_pass_s") or math.nan):
        lines.append(f"  margins: waits that must pass <= {m['must_pass_s']:.2f} s, the target's wait >= "
                     f"{m['target_wait_s']:.2f} s (ratio {m['ratio']:.2f}); deadline {m['deadline_s']:.2f} s, "
                     f"x{m['room_below']:.2f} above the one and x{m['room_above']:.2f} below the other")
    lines.append(f"  model save completed: {report['model_save_ok']}; optimizer save completed: {report['optimizer_save_ok']}")
    if report["gloo_error"]:
        lines.append(f"  ranks {format_ranks(report['ranks_timed_out'])} failed in {report['failed_call']} "
                     f"-> {report['failed_phase']} ({report['waiting_call']}):")
        lines.append(f"    RuntimeError: {report['gloo_error']}")
        lines.append("  frames (outermost first): " + " -> ".join(report["frames"]))
        lines.append("  same chain as the report (save_state ... scatter_object_list -> broadcast): "
                     f"{report['frames_match_report']}")
        if report["trainer"] == "mova":
            lines += ["  MOVA's own frames:"] + [f"    {loc}" for loc in report["frame_locations"]
                                                 if "/mova/" in loc or "accelerate_train" in loc]
    if report["where_at_timeout"]:
        lines.append("  where every rank was when the peers timed out:")
        for rank, where in report["where_at_timeout"].items():
            state = "no DCP phase (between saves)" if where is None else f"{where['phase']} for {where['for_s']:.2f} s"
            lines.append(f"    rank {rank}: {state}")
    if report["timeline"]:
        lines.append("  timeline of the failing save (seconds from its first event):")
        for row in report["timeline"]:
            dur = "still running" if row["duration_s"] is None else f"{row['duration_s']:.3f} s"
            lines.append(f"    rank {row['rank']:>3}  {row['start_s']:8.3f}  {row['phase']:<40} {dur}")
    if report.get("calibration_timeline"):
        lines.append("  where rank 0's time went in the same save under the long deadline (calibration):")
        for row in report["calibration_timeline"]:
            if row["rank"] == 0 and row["duration_s"] is not None:
                lines.append(f"    rank   0  {row['start_s']:8.3f}  {row['phase']:<44} {row['duration_s']:.3f} s")
    lines.append(f"  full log: {report['log']}")
    return "\n".join(lines)
