"""The 8-rank reproduction of the save_state gloo timeout.

Scale the deadline, not the mechanism. The reporter's peers waited 1,800 s in the plan
scatter for rank 0; 8 ranks cannot make rank 0 plan for 30 minutes. So one `reproduce()`
runs the real training job twice:

1. calibration, under a long deadline: measure, from torch's own DCP events, how long the
   peers wait for rank 0 in each save's plan exchange, and every other wait of the save;
2. the reproduction, with the default group's gloo deadline set between them, so that the
   save with the shorter wait completes and the one with the longer wait times out in the
   plan scatter, through torch's own work (no sleeps, nothing injected).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

from ..diagnose import callpath
from ..diagnose.timeline import CollectiveCall, SaveWaits, StepEvent, longest_wait, phase_at, save_timeline, save_waits
from ..errors import CkptDoctorError
from ..fix.compat import installed_versions
from ..ranks import format_ranks
from .config import TrainingConfig
from .launcher import launch
from .model import MovaShape
from .roundtrip import CHECKPOINT_TIMEOUT_FACTOR
from .worker import WorkerSpec

MODEL_SAVE, OPTIMIZER_SAVE = "pytorch_model_fsdp_0", "optimizer_0"
CALL_OF_SAVE = {MODEL_SAVE: "save_fsdp_model", OPTIMIZER_SAVE: "save_fsdp_optimizer"}
MIN_SEPARATION = 1.5  # the deadline needs this factor of room on each side
REPORTED_DEADLINE_S = 1800.0


@dataclasses.dataclass
class ReproOptions:
    world_size: int = 8
    mode: str = "sft"
    video_layers: int = 12
    output_dir: Path = Path("runs/repro")
    deadline_s: float | None = None  # None: chosen from the calibration run
    fix: bool = False
    offload_params: bool = True
    cp_size: int = 1
    job_timeout_s: float = 1200.0

    def training_config(self) -> TrainingConfig:
        return TrainingConfig(world_size=self.world_size, mode=self.mode, offload_params=self.offload_params,
                              cp_size=self.cp_size)

    def shape(self) -> MovaShape:
        return MovaShape().with_layers(self.video_layers)


@dataclasses.dataclass
class JobOutcome:
    ranks: list[dict]           # each rank's rank<N>.json
    events: list[StepEvent]
    calls: list[CollectiveCall]
    returncodes: list[int]
    log_path: Path
    checkpoint_dir: Path
    wall_s: float


@dataclasses.dataclass
class DeadlineChoice:
    deadline_s: float
    target_save: str      # the save whose plan scatter should time out
    below_s: float        # the longest wait that must pass
    above_s: float        # the target's plan-scatter wait


def run_job(opts: ReproOptions, name: str, deadline_s: float, progress=print, time_collectives=False,
            fix: bool = False) -> JobOutcome:
    """One real N-process training job whose default group has `deadline_s` (saves with the
    fix when `fix`; calibration always measures the stock save)."""
    root = Path(opts.output_dir) / name
    shutil.rmtree(root, ignore_errors=True)
    (root / "results").mkdir(parents=True)
    spec = WorkerSpec(opts.training_config(), opts.shape(), str(root / "checkpoints"), str(root / "results"),
                      checkpoint_deadline_s=deadline_s, fix=fix, time_collectives=time_collectives)
    spec_path = root / "spec.json"
    spec_path.write_text(spec.to_json())
    progress(f"  {name}: {opts.world_size} ranks, {opts.mode}, gloo deadline {deadline_s:.3f} s, log {root / 'job.log'}")
    job = launch(["-m", "ckptdoctor.repro.worker", str(spec_path)], opts.world_size, root / "job.log",
                 timeout_s=opts.job_timeout_s)
    ranks = []
    for rank in range(opts.world_size):
        path = root / "results" / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "status": "no report"})
    events = [StepEvent(**e) for r in ranks for e in r.get("events", [])]
    calls = [CollectiveCall(**c) for r in ranks for c in r.get("calls", [])]
    progress(f"  {name}: done in {job.wall_s:.0f} s, exit codes {job.returncodes}")
    steps = spec.config.max_steps
    return JobOutcome(ranks, events, calls, job.returncodes, job.log_path,
                      root / "checkpoints" / f"step-{steps}" / "accelerator", job.wall_s)


@dataclasses.dataclass
class Calibration:
    waits: dict[str, SaveWaits]
    barrier_wait_s: float  # the trainer's wait_for_everyone, also on the default group
    outcome: JobOutcome


def measure(outcome: JobOutcome, world_size: int) -> Calibration:
    failed = [r["rank"] for r in outcome.ranks if r.get("status") != "ok"]
    if failed:
        first = outcome.ranks[failed[0]]
        raise CkptDoctorError(f"calibration run failed on ranks {failed}: {first.get('error', first['status'])} "
                              f"(log: {outcome.log_path})")
    waits = {save: save_waits(outcome.events, outcome.calls, save, world_size) for save in (MODEL_SAVE, OPTIMIZER_SAVE)}
    return Calibration(waits, longest_wait(outcome.calls, "barrier"), outcome)


def choose_deadline(cal: Calibration) -> DeadlineChoice:
    """Put the deadline between the longest wait that must pass and the target's shortest
    plan-scatter wait (geometric mean), with MIN_SEPARATION of room on each side.

    The target is the optimizer's plan scatter (the report) when its wait stands out, as in
    full fine-tuning; otherwise (LoRA) the model save's, which comes first.
    """
    model, optim = cal.waits[MODEL_SAVE], cal.waits[OPTIMIZER_SAVE]
    must_pass = max(cal.barrier_wait_s, model.before_scatter_wait_s, model.plan_scatter_wait_s[1],
                    model.after_scatter_wait_s, optim.before_scatter_wait_s)
    if optim.plan_scatter_wait_s[0] >= MIN_SEPARATION * must_pass:
        below, above, target = must_pass, optim.plan_scatter_wait_s[0], OPTIMIZER_SAVE
    else:
        below = max(cal.barrier_wait_s, model.before_scatter_wait_s)
        above, target = model.plan_scatter_wait_s[0], MODEL_SAVE
        if above < MIN_SEPARATION * below:
            raise CkptDoctorError(
                f"cannot separate the waits (peers wait {model.plan_scatter_wait_s[0]:.2f} s in the model plan "
                f"scatter, {optim.plan_scatter_wait_s[0]:.2f} s in the optimizer's; other waits up to "
                f"{must_pass:.2f} s); use more layers (--layers) so planning dominates")
    return DeadlineChoice(math.sqrt(below * above), target, below, above)


def failing_rank_report(outcome: JobOutcome) -> dict | None:
    """The first rank (by rank number) whose failure was a gloo timeout."""
    for rank in outcome.ranks:
        if rank.get("status") == "failed" and callpath.gloo_timeout_ms(rank.get("error", "")) is not None:
            return rank
    return None


def save_completed(outcome: JobOutcome, save: str) -> bool:
    """All ranks finished writing and the metadata file exists."""
    metadata = outcome.checkpoint_dir / save / ".metadata"
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


def reproduce(opts: ReproOptions, progress=print) -> dict:
    """Run calibration (unless a deadline is given) and the reproduction; return the report."""
    torch_v, accelerate_v = installed_versions()
    costs = None
    if opts.deadline_s is None:
        progress("[1/2] calibration: the same job under a 1800 s deadline, to measure each wait of the save")
        costs = measure(run_job(opts, "calibration", REPORTED_DEADLINE_S, progress, time_collectives=True), opts.world_size)
        choice = choose_deadline(costs)
        progress(f"      peers waited in the plan scatter: model save {costs.waits[MODEL_SAVE].plan_scatter_wait_s[0]:.2f} s, "
                 f"optimizer save {costs.waits[OPTIMIZER_SAVE].plan_scatter_wait_s[0]:.2f} s; every other wait "
                 f"<= {choice.below_s:.2f} s -> deadline {choice.deadline_s:.2f} s (target: {CALL_OF_SAVE[choice.target_save]})")
    else:
        choice = DeadlineChoice(opts.deadline_s, OPTIMIZER_SAVE, float("nan"), float("nan"))
    progress("[2/2] " + ("the fixed save" if opts.fix else "reproduction") + f" under the {choice.deadline_s:.2f} s deadline")
    outcome = run_job(opts, "fixed" if opts.fix else "reproduction", choice.deadline_s, progress, fix=opts.fix)
    return build_report(opts, outcome, choice, costs, torch_v, accelerate_v)


def build_report(opts, outcome: JobOutcome, choice: DeadlineChoice, costs, torch_v, accelerate_v) -> dict:
    failing = failing_rank_report(outcome)
    frames = [f["function"] for f in failing["frames"]] if failing else []
    point = callpath.locate(frames)
    failed_save = next((s for s, call in CALL_OF_SAVE.items() if call == point.accelerate_call), None)
    timeout_at = min(r["error_time_s"] for r in outcome.ranks if r.get("error_time_s") and
                     callpath.gloo_timeout_ms(r.get("error", ""))) if failing else None
    # The fixed job also loads (same directory names): its events are not one save's timeline.
    timeline, where = ([], {}) if opts.fix else describe_timeline(outcome, failed_save or choice.target_save,
                                                                   opts.world_size, timeout_at)
    timed_out = [r["rank"] for r in outcome.ranks if callpath.gloo_timeout_ms(r.get("error", "")) is not None]
    model_ok, optim_ok = save_completed(outcome, MODEL_SAVE), save_completed(outcome, OPTIMIZER_SAVE)
    expected_call = CALL_OF_SAVE[choice.target_save]
    plan_s = {"model": costs.waits[MODEL_SAVE].coordinator_plan_s,
              "optimizer": costs.waits[OPTIMIZER_SAVE].coordinator_plan_s} if costs else None
    scatter_s = {"model": costs.waits[MODEL_SAVE].plan_scatter_wait_s[0],
                 "optimizer": costs.waits[OPTIMIZER_SAVE].plan_scatter_wait_s[0]} if costs else None
    reproduced = bool(failing) and point.phase == "plan-scatter" and point.waiting_call == "broadcast" \
        and point.accelerate_call == expected_call and model_ok == (expected_call == "save_fsdp_optimizer")
    report = {
        "reproduced": reproduced and not opts.fix,
        "fix": opts.fix,
        "checkpoint_group_timeout_ms": round(choice.deadline_s * 1000 * CHECKPOINT_TIMEOUT_FACTOR) if opts.fix else None,
        "save_ok": model_ok and optim_ok and all(r.get("status") == "ok" for r in outcome.ranks),
        "roundtrip_bitexact": all(r.get("roundtrip_differences") == [] for r in outcome.ranks) if opts.fix else None,
        "roundtrip_differences": {r["rank"]: r.get("roundtrip_differences") for r in outcome.ranks
                                  if r.get("roundtrip_differences")} if opts.fix else None,
        "mode": opts.mode, "world_size": opts.world_size, "torch": torch_v, "accelerate": accelerate_v,
        "failed_phase": point.phase, "failed_call": point.accelerate_call, "waiting_call": point.waiting_call,
        "expected_call": expected_call, "model_save_ok": model_ok, "optimizer_save_ok": optim_ok,
        "frames": frames, "frames_match_report": callpath.matches_report(frames),
        "frame_locations": [f"{f['file']}:{f['line']} in {f['function']}" for f in failing["frames"]] if failing else [],
        "gloo_error": failing.get("error") if failing else None,
        "ranks_timed_out": timed_out,
        "where_at_timeout": where,
        "deadline_ms": round(choice.deadline_s * 1000),
        "coordinator_plan_s": plan_s,
        "plan_scatter_wait_s": scatter_s,
        "planning_to_deadline_ratio": (scatter_s["optimizer" if expected_call == "save_fsdp_optimizer" else "model"]
                                       / choice.deadline_s) if scatter_s else None,
        "deadline_bounds_s": [choice.below_s, choice.above_s],
        "calibration": ({k: dataclasses.asdict(v) for k, v in costs.waits.items()}
                        | {"barrier_wait_s": costs.barrier_wait_s}) if costs else None,
        "timeline": timeline,
        "calibration_timeline": describe_timeline(costs.outcome, choice.target_save, opts.world_size, None)[0]
        if costs else None,
        "rank_status": {r["rank"]: r.get("status") for r in outcome.ranks},
        "log": str(outcome.log_path),
    }
    return report


def format_report(report: dict) -> str:
    """The human-readable summary printed by `ckptdoctor repro`."""
    lines = []
    if report["fix"]:
        lines.append(f"{'FIXED' if report['save_ok'] and report['roundtrip_bitexact'] else 'FIX FAILED'}: "
                     f"{report['world_size']} ranks, mode {report['mode']}, torch {report['torch']}, accelerate "
                     f"{report['accelerate']}, ScalableCheckpointing; the default group keeps the {report['deadline_ms']} ms "
                     f"deadline that made stock time out, saves run on a checkpoint group with "
                     f"{report['checkpoint_group_timeout_ms']} ms (x{CHECKPOINT_TIMEOUT_FACTOR:g}, as 3 h beside 30 min)")
        lines.append(f"  save completed on every rank: {report['save_ok']}; state after load_state bit-identical "
                     f"to before the save on every rank: {report['roundtrip_bitexact']}")
    else:
        verdict = "REPRODUCED" if report["reproduced"] else "NOT reproduced"
        lines.append(f"{verdict}: {report['world_size']} ranks, mode {report['mode']}, torch {report['torch']}, "
                     f"accelerate {report['accelerate']}, gloo deadline {report['deadline_ms']} ms")
    lines.append(f"  model save completed: {report['model_save_ok']}; optimizer save completed: {report['optimizer_save_ok']}")
    if report["gloo_error"]:
        lines.append(f"  ranks {format_ranks(report['ranks_timed_out'])} failed in {report['failed_call']} "
                     f"-> {report['failed_phase']} ({report['waiting_call']}):")
        lines.append(f"    RuntimeError: {report['gloo_error']}")
        lines.append("  frames (outermost first): " + " -> ".join(report["frames"]))
        lines.append(f"  same chain as the report (save_state ... scatter_object_list -> broadcast): {report['frames_match_report']}")
    if report["where_at_timeout"]:
        lines.append("  where every rank was when the peers timed out:")
        for rank, where in report["where_at_timeout"].items():
            state = "no DCP phase (between saves)" if where is None else f"{where['phase']} for {where['for_s']:.2f} s"
            lines.append(f"    rank {rank}: {state}")
    if report["coordinator_plan_s"]:
        plan, scatter = report["coordinator_plan_s"], report["plan_scatter_wait_s"]
        lines.append(f"  measured under a long deadline: rank 0 planning (last local plan -> its write) "
                     f"model {plan['model']:.2f} s, optimizer {plan['optimizer']:.2f} s; peers' wait in the plan "
                     f"scatter model {scatter['model']:.2f} s, optimizer {scatter['optimizer']:.2f} s")
        lines.append(f"  plan-scatter wait / deadline = {report['planning_to_deadline_ratio']:.2f}: the reporter's 1800 s "
                     f"deadline plays the role of our {report['deadline_ms'] / 1000:.2f} s")
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
