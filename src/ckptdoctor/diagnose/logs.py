"""`ckptdoctor diagnose`: explain a failed save or load from torchrun / Accelerate logs.

scan.py reads the logs (streamed, bounded memory); this module turns what it kept into one
`Verdict` (verdict.py): the error, the operation and phase from the frames (callpath.py), who
reported it, whom they waited for, the timeout, each rank's collective, the nodes and versions the
log shows, and the causes those findings support, each with its confidence and its evidence. What
the log does not show stays unknown.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from ..ranks import format_ranks
from . import callpath
from .scan import Evidence, Sighting, Traceback, scan
from .verdict import CERTAIN, LIKELY, Cause, Finding, Verdict, render_text

# Line numbers of call sites in the frames, per pinned version (from the report and our runs).
FRAME_LINES = {
    ("torch", "2.8.0"): {("distributed_c10d.py", "broadcast"): 2830, ("distributed_c10d.py", "scatter_object_list"): 3762,
                         ("checkpoint/utils.py", "reduce_scatter"): 217, ("checkpoint/utils.py", "scatter_object"): 162,
                         ("checkpoint/utils.py", "inner_func"): 475, ("state_dict_saver.py", "save"): 176,
                         ("state_dict_saver.py", "_save_state_dict"): 362, ("checkpoint/logger.py", "wrapper"): 87,
                         ("c10d_logger.py", "wrapper"): 81},
    ("torch", "2.14.1"): {("distributed_c10d.py", "broadcast"): 3787, ("distributed_c10d.py", "scatter_object_list"): 4903,
                          ("checkpoint/utils.py", "reduce_scatter"): 220, ("checkpoint/utils.py", "scatter_object"): 163,
                          ("checkpoint/utils.py", "inner_func"): 488, ("state_dict_saver.py", "save"): 196,
                          ("state_dict_saver.py", "_save_state_dict"): 487, ("checkpoint/logger.py", "wrapper"): 90,
                          ("c10d_logger.py", "wrapper"): 83},
    ("torch", "2.15.0"): {("distributed_c10d.py", "broadcast"): 4055, ("distributed_c10d.py", "scatter_object_list"): 5163,
                          ("checkpoint/utils.py", "reduce_scatter"): 220, ("checkpoint/utils.py", "scatter_object"): 163,
                          ("checkpoint/utils.py", "inner_func"): 488, ("state_dict_saver.py", "save"): 196,
                          ("state_dict_saver.py", "_save_state_dict"): 487, ("checkpoint/logger.py", "wrapper"): 90,
                          ("c10d_logger.py", "wrapper"): 83},
    ("accelerate", "1.13.0"): {("accelerator.py", "save_state"): 3662, ("fsdp_utils.py", "save_fsdp_optimizer"): 273,
                               ("fsdp_utils.py", "save_fsdp_model"): 153, ("accelerator.py", "load_state"): 3825},
    ("accelerate", "1.15.0"): {("accelerator.py", "save_state"): 3720, ("fsdp_utils.py", "save_fsdp_optimizer"): 347,
                               ("fsdp_utils.py", "save_fsdp_model"): 180, ("accelerator.py", "load_state"): 3883},
    ("accelerate", "1.16.0"): {("accelerator.py", "save_state"): 3625, ("fsdp_utils.py", "save_fsdp_optimizer"): 360,
                               ("fsdp_utils.py", "save_fsdp_model"): 180, ("accelerator.py", "load_state"): 3775},
}
MIN_VERSION_FRAMES = 2  # a version is named only when this many frames agree with it and none disagrees
COORDINATOR_PHASES = {"plan-scatter", "plan-gather", "finish-gather", "finish-scatter"}
LAUNCHER_FILES = ("torch/distributed/run.py", "torch/distributed/elastic/", "torch/distributed/launcher/", "/torchrun")
DOCS = "`ckptdoctor docs root-cause`"
WATCHDOG_KINDS = ("watchdog", "watchdog_summary", "nccl_down", "hccl_timeout", "watchdog_note")

# The error a log shows, by the kinds of sightings, most specific first.
ERROR_KINDS = (
    ("gloo-timeout", ("gloo_timeout",)),
    ("collective-watchdog", WATCHDOG_KINDS),
    ("checkpoint-metadata-missing", ("metadata_missing",)),
    ("checkpoint-keys-mismatch", ("missing_key",)),
    ("out-of-memory", ("oom",)),
    ("killed", ("torchrun_failure", "torchrun_failed")),
    ("peer-closed", ("peer_closed",)),
    ("checkpoint-exception", ("checkpoint_exception",)),
    ("python-exception", ("exception",)),
)


def diagnose(paths: Iterable[str | Path], ranks_per_node: int | None = None) -> Verdict:
    return judge(scan(paths), ranks_per_node)


def format_report(verdict: Verdict) -> str:
    return render_text(verdict)


def judge(evidence: Evidence, ranks_per_node: int | None = None) -> Verdict:
    kind, sightings = error_of(evidence)
    tb = main_traceback(evidence, {s.rank for s in sightings})
    frames = list(tb.frames) if tb else []
    point = callpath.locate([f.function for f in frames])
    operation = Finding.of(point.operation or operation_from_files(frames), CERTAIN, *_frame_lines(frames, 2))
    if operation.value is None:
        progress = evidence.of("save_progress")
        operation = Finding.of(_operation_of_progress(progress), LIKELY, *(s.text for s in progress[:1]))
    ranks = sorted({s.rank for s in sightings if s.rank is not None} | _failed_ranks(sightings, kind, tb))
    findings = {
        "error": Finding.of(kind, CERTAIN, *(s.text for s in sightings[:2])),
        "operation": operation,
        "target": Finding.of(point.target, CERTAIN, *_frame_lines(frames, 1)),
        "phase": Finding.of(point.phase or ("plan-local" if "local_step" in [f.function for f in frames] else None),
                            CERTAIN, *_frame_lines(frames, 1)),
        "waiting_call": Finding.of(point.waiting_call, CERTAIN, *_frame_lines(frames[-1:], 1)),
        "ranks": Finding.of(ranks, CERTAIN, *(s.text for s in sightings[:2])),
        "local_ranks": _local_ranks(evidence),
        "exitcodes": _exitcodes(evidence),
        "timeout_ms": _timeout(sightings),
        "collectives": _collectives(evidence),
        "nodes": _nodes(evidence, ranks, ranks_per_node),
        "frames": Finding.of([f"{f.file}:{f.line} in {f.function}" for f in frames], CERTAIN),
    }
    findings["desync"] = _desync(findings["collectives"])
    findings["waiting_on"] = _waiting_on(kind, point.phase, ranks, sightings)
    versions = implied_versions(frames)
    for package in ("torch", "accelerate"):
        version, hits = versions[package]
        findings[package] = Finding.of(version, LIKELY, f"{hits} frame line numbers match {package} {version}")
    verdict = Verdict(findings, [], evidence.files, evidence.truncated)
    verdict.causes = rank_causes(verdict, evidence)
    return verdict


def error_of(evidence: Evidence) -> tuple[str | None, list[Sighting]]:
    for kind, sighting_kinds in ERROR_KINDS:
        found = [s for s in evidence.of(*sighting_kinds) if _counts_as(kind, s)]
        if found:
            return kind, found
    exceptions = [s for s in evidence.of("exception") if s.data.get("exc", "").endswith("CheckpointException")]
    if exceptions:
        return "checkpoint-exception", exceptions
    dumps = [Sighting("stack_dump", t.printed_by, f"{t.frames[-1].file}:{t.frames[-1].line} in {t.frames[-1].function}",
                      {}) for t in evidence.tracebacks if t.faulthandler]
    return ("stack-dump", dumps) if dumps else (None, [])


def _counts_as(kind: str, s: Sighting) -> bool:
    if kind == "killed":  # a kill, not any failure torchrun reports
        return str(s.data.get("tr_exit", s.data.get("exitcode"))) == "-9" or s.data.get("signal") == "SIGKILL"
    if kind == "python-exception":
        return not s.data.get("exc", "").endswith(("ChildFailedError", "CheckpointException"))
    return True


def main_traceback(evidence: Evidence, ranks: set) -> Traceback | None:
    """The traceback of a failing rank (the longest, launcher's own excluded)."""
    own = [t for t in evidence.tracebacks if not all(any(m in f.file for m in LAUNCHER_FILES) for f in t.frames)]
    preferred = [t for t in own if t.rank in ranks or t.printed_by in ranks] or own
    return max(preferred, key=lambda t: (not t.faulthandler or _in_collective(t), len(t.frames)), default=None)


def _in_collective(tb: Traceback) -> bool:
    return callpath.locate([f.function for f in tb.frames]).waiting_call is not None


def operation_from_files(frames) -> str | None:
    files = " ".join(f.file for f in frames)
    return "load" if "state_dict_loader.py" in files else "save" if "state_dict_saver.py" in files else None


def _operation_of_progress(progress: list[Sighting]) -> str | None:
    if not progress:
        return None
    return "load" if progress[-1].text.startswith("Loading") else "save"


def _frame_lines(frames, n: int) -> list[str]:
    return [f"{f.file}:{f.line} in {f.function}" for f in frames[-n:]]


def _failed_ranks(sightings, kind, tb) -> set:
    """Ranks a DCP exception names as failed, and the rank whose traceback it is."""
    out = set()
    for s in sightings:
        if s.data.get("ce_ranks"):
            out |= {int(r) for r in s.data["ce_ranks"].replace(" ", "").split(",") if r}
        text = s.data.get("exc_text", "")
        match = re.search(r"ranks:dict_keys\(\[([\d, ]*)\]\)", text)
        if match:
            out |= {int(r) for r in match.group(1).replace(" ", "").split(",") if r}
    if tb is not None and kind in (None, "checkpoint-exception", "checkpoint-metadata-missing",
                                   "checkpoint-keys-mismatch", "python-exception"):
        out |= {r for r in (tb.rank, tb.printed_by) if r is not None}
    return out


def _local_ranks(evidence: Evidence) -> Finding:
    rows = [s for s in evidence.of("torchrun_failed", "torchrun_failure")]
    local = sorted({int(s.data.get("tr_local", s.data.get("local_rank", -1))) for s in rows} - {-1})
    return Finding.of(local, CERTAIN, *(s.text for s in rows[:2]))


def _exitcodes(evidence: Evidence) -> Finding:
    rows = evidence.of("torchrun_failed", "torchrun_failure")
    codes = sorted({int(s.data.get("tr_exit", s.data.get("exitcode"))) for s in rows})
    return Finding.of(codes, CERTAIN, *(s.text for s in rows[:2]))


def _timeout(sightings) -> Finding:
    for s in sightings:
        for key in ("gloo_ms", "wd_ms"):
            if key in s.data:
                return Finding.of(int(s.data[key]), CERTAIN, s.text)
    return Finding()


def _collectives(evidence: Evidence) -> Finding:
    """Per rank, the first collective the watchdog caught: (SeqNum, OpType)."""
    per_rank: dict[str, tuple[int, str]] = {}
    lines = []
    for s in evidence.of("watchdog"):
        rank = str(s.rank if s.rank is not None else s.data.get("wd_rank"))
        seq = (int(s.data["seq"]), s.data["op"])
        if rank not in per_rank or seq[0] < per_rank[rank][0]:
            per_rank[rank] = seq
            lines.append(s.text)
    return Finding.of(per_rank, CERTAIN, *lines[:3])


def _desync(collectives: Finding) -> Finding:
    """Ranks whose watchdogs caught different collectives are out of step: likely, since the log
    lines do not always say which process group each collective belongs to."""
    if not collectives.value or len(collectives.value) < 2:
        return Finding()
    distinct = set(collectives.value.values())
    evidence = [f"rank {r}: SeqNum {seq} {op}" for r, (seq, op) in sorted(collectives.value.items(),
                                                                           key=lambda x: int(x[0]))]
    return Finding(len(distinct) > 1, LIKELY, evidence[:4])


def _nodes(evidence: Evidence, ranks: list[int], ranks_per_node: int | None) -> Finding:
    """Hosts from the log's own host lines; by arithmetic only when asked (--ranks-per-node)."""
    hosts: dict[str, list[int]] = {}
    lines = []
    for s in evidence.of("torchrun_failure"):
        if s.data.get("host") and s.data.get("rank") is not None:
            hosts.setdefault(s.data["host"], []).append(int(s.data["rank"]))
            lines.append(f"host {s.data['host']}: rank {s.data['rank']}")
    if hosts:
        return Finding.of({h: sorted(set(r)) for h, r in hosts.items()}, CERTAIN, *lines)
    if ranks_per_node and ranks:
        computed: dict[str, list[int]] = {}
        for r in ranks:
            computed.setdefault(f"node {r // ranks_per_node}", []).append(r)
        return Finding(computed, LIKELY, [f"computed as rank // {ranks_per_node} (--ranks-per-node): the log names "
                                          f"no hosts"])
    return Finding()


def _waiting_on(kind, phase, ranks, sightings) -> Finding:
    """Rank 0 is awaited when ranks time out in a phase where every rank waits for DCP's coordinator."""
    if kind not in ("gloo-timeout", "collective-watchdog") or phase not in COORDINATOR_PHASES or 0 in ranks:
        return Finding()
    return Finding([0], LIKELY, [f"{len(ranks)} rank(s) timed out in {phase}, where every rank waits for the "
                                f"coordinator (rank 0), which did not report the timeout"])


def implied_versions(frames) -> dict[str, tuple[str | None, int]]:
    """Per package, the pinned version that at least MIN_VERSION_FRAMES frames match exactly and no
    frame contradicts, and how many frames matched."""
    out = {}
    for package in ("torch", "accelerate"):
        best, best_hits = None, 0
        for (pkg, version), table in FRAME_LINES.items():
            if pkg != package:
                continue
            hits = conflicts = 0
            for f in frames:
                for (suffix, function), line in table.items():
                    if f.function == function and f.file.replace("\\", "/").endswith(suffix) and f"/{package}/" in f.file:
                        hits, conflicts = hits + (f.line == line), conflicts + (f.line != line)
            if conflicts == 0 and hits >= MIN_VERSION_FRAMES and hits > best_hits:
                best, best_hits = version, hits
        out[package] = (best, best_hits)
    return out


# -- causes ------------------------------------------------------------------------------------

def rank_causes(verdict: Verdict, evidence: Evidence) -> list[Cause]:
    f = verdict.findings
    kind, phase, ranks = f["error"].value, f["phase"].value, f["ranks"].value or []
    causes = []
    if f["desync"].value:
        causes.append(Cause("collective-desync", "the ranks are in different collectives: one of them took another "
                            "code path (a save, an evaluation or a rank-local branch on some ranks only)", LIKELY,
                            f["desync"].evidence, "compare the ranks' stacks (py-spy dump) or the NCCL flight recorder "
                            "(TORCH_NCCL_TRACE_BUFFER_SIZE) to find the rank that diverged, and what it called"))
    if kind == "gloo-timeout" and phase in COORDINATOR_PHASES:
        causes += _coordinator_causes(f)
    elif kind == "gloo-timeout":
        causes.append(Cause("collective-timeout", f"a gloo collective ({f['waiting_call'].value or 'unknown'}) timed "
                            f"out: a rank did not arrive", CERTAIN, f["error"].evidence,
                            "find the rank that did not arrive (its own log lines, or a py-spy dump during the hang)"))
    elif kind == "collective-watchdog" and not f["desync"].value:
        seqs = sorted({seq for seq, _ in (f["collectives"].value or {}).values()})
        what = f" (SeqNum {seqs[0]})" if len(seqs) == 1 else ""
        causes.append(Cause("rank-did-not-arrive", f"the reporting ranks waited in the same collective{what} for a "
                            f"rank that did not arrive: stuck, slow, dead, or elsewhere", LIKELY, f["error"].evidence,
                            "the ranks missing from the reports are the suspects: look at their own logs and stacks"))
        if f["operation"].value == "save":
            causes.append(Cause("save-on-some-ranks", "during a save: the save may have run on some ranks only, or "
                                "outlasted the collective timeout on others", LIKELY, f["operation"].evidence,
                                "call save_state on every rank; run saves on a group whose timeout covers them"))
    elif kind == "checkpoint-metadata-missing":
        causes.append(Cause("checkpoint-incomplete", "the checkpoint's .metadata could not be read on the failing "
                            "rank(s): the save that wrote it did not finish, or this host does not see the directory "
                            "rank 0 wrote (not a shared filesystem)", CERTAIN, f["error"].evidence,
                            "check that <checkpoint>/.metadata exists as every rank sees it; load only checkpoints "
                            "whose save completed"))
    elif kind == "checkpoint-keys-mismatch":
        causes.append(Cause("keys-mismatch", "the state dict being loaded holds keys the checkpoint does not", CERTAIN,
                            f["error"].evidence, "load into the model the checkpoint was saved from (same wrapping, "
                            "same LoRA/adapter setup), or load with allow_partial_load"))
    elif kind == "out-of-memory":
        causes.append(Cause("out-of-memory", "a process ran out of memory", CERTAIN, f["error"].evidence,
                            "see which rank and where; rank 0 holds every rank's plan in a DCP save or load"))
    elif kind == "killed":
        causes.append(Cause("killed", "a process was killed with SIGKILL (exit -9): the kernel's OOM killer sends it "
                            "when the host runs out of memory, a scheduler or a person can too", LIKELY,
                            f["exitcodes"].evidence, "check the host's kernel log (dmesg) for an OOM kill at that time"))
    elif kind == "peer-closed":
        killed = [s for s in evidence.of("torchrun_failure", "torchrun_failed") if _counts_as("killed", s)]
        who = f" (rank {killed[0].data.get('rank', '?')} was killed)" if killed else ""
        causes.append(Cause("peer-died", f"another rank died: its gloo connection closed{who}", LIKELY,
                            f"ranks {format_ranks(ranks)} saw a peer close the connection" if ranks else "",
                            "find the first rank that exited and why (its own error, or a kill on its host)"))
    elif kind == "stack-dump":
        where = f["waiting_call"].value
        causes.append(Cause("hang", f"a stack dump of a hanging process (faulthandler){f': waiting in {where}' if where else ''}"
                            f"; no error was logged", CERTAIN, f["error"].evidence,
                            "dump every rank at the same moment (py-spy dump, or faulthandler on SIGUSR1) and find the "
                            "rank that is not in the same call"))
    elif kind in ("checkpoint-exception", "python-exception"):
        causes.append(Cause("exception", "an exception on a rank ended the run", CERTAIN, f["error"].evidence,
                            "read the failing rank's traceback above"))
    return causes


def _coordinator_causes(f) -> list[Cause]:
    evidence = [f"{len(f['ranks'].value or [])} rank(s) timed out in {f['phase'].value} "
                f"({f['waiting_call'].value}), where every rank waits for the coordinator, rank 0"]
    if f["timeout_ms"].value == 1_800_000:
        evidence.append("the timeout is gloo's default 30 minutes: the group was created without timeout=")
    world = max(f["ranks"].value or [0]) + 1
    if world >= 256:
        evidence.append(f"the job has at least {world} ranks: rank 0's planning work grows with N (measured: see "
                        f"{DOCS}, `ckptdoctor simulate` / `ckptdoctor check`)")
    if f["target"].value == "optimizer":
        evidence.append("the optimizer save has ~3 items per parameter (two sharded moments and a replicated step), "
                        "so its plan is the largest")
    return [
        Cause("dcp-coordinator-slow", "rank 0 (the DCP coordinator) was still planning when the peers' deadline passed",
              LIKELY, evidence, "use ckptdoctor's ScalableSavePlanner and a checkpoint group with a longer timeout "
                                "(`ckptdoctor docs fix-for-mova`); check the layout with `ckptdoctor check`"),
        Cause("coordinator-died", "rank 0 died or hung before answering", LIKELY,
              ["rank 0 did not report the timeout in these logs"],
              "check rank 0's own log lines and its host (dmesg) at that time"),
    ]
