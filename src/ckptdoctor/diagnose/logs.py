"""`ckptdoctor diagnose`: explain a failed checkpoint from torchrun / Accelerate logs.

Logs are streamed (plain or gzip, any size): each physical line is split at `[rankN]:`
markers, so tracebacks collapsed onto one line (as in the user's report) and interleaved
ranks read the same as clean multi-line logs. Per rank only the last traceback's frames and
the error lines are kept. The frames are classified by callpath.py (which save or load,
which phase, which wait); the causes are ranked from what the logs show.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import CkptDoctorError
from ..ranks import format_ranks
from . import callpath

RANK_MARK = re.compile(r"\[rank(\d+)\]:")
FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([\w<>]+)')
MAX_FRAMES = 200  # per rank; a checkpoint traceback has ~20

# Error patterns -> kind. Order matters: the first match on a segment wins.
ERRORS = (
    ("gloo-timeout", callpath.GLOO_TIMEOUT),
    ("peer-closed", re.compile(r"Connection closed by peer|Connection reset by peer|ECONNRESET", re.I)),
    ("collective-watchdog", re.compile(r"Watchdog caught collective operation timeout|(NCCL|HCCL)[^\n]{0,80}time(d)? ?out",
                                       re.I)),
    ("oom", re.compile(r"out of memory|OutOfMemoryError|oom-kill|Killed process|Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9",
                       re.I)),
)
TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)|timeout(?:_ms)?[=: ]+(\d+)\s*ms", re.I)

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
    ("accelerate", "1.13.0"): {("accelerator.py", "save_state"): 3662, ("fsdp_utils.py", "save_fsdp_optimizer"): 273,
                               ("fsdp_utils.py", "save_fsdp_model"): 153, ("accelerator.py", "load_state"): 3825},
    ("accelerate", "1.15.0"): {("accelerator.py", "save_state"): 3720, ("fsdp_utils.py", "save_fsdp_optimizer"): 347,
                               ("fsdp_utils.py", "save_fsdp_model"): 180, ("accelerator.py", "load_state"): 3883},
}
COORDINATOR_PHASES = {"plan-scatter", "plan-gather", "finish-gather", "finish-scatter"}
DOCS = "docs/root-cause.md"


@dataclasses.dataclass
class Frame:
    file: str
    line: int
    function: str


@dataclasses.dataclass
class RankLog:
    rank: int
    frames: list[Frame] = dataclasses.field(default_factory=list)
    errors: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (kind, text)


# -- reading -----------------------------------------------------------------------------

def open_log(path: str | Path) -> Iterator[str]:
    """Lines of a plain or gzip log, decoded leniently, streamed."""
    path = Path(path)
    if not path.is_file():
        raise CkptDoctorError(f"no such log file: {path}")
    with open(path, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        yield from f


def segments(lines: Iterable[str]) -> Iterator[tuple[int | None, str]]:
    """(rank or None, text) pieces: a line split at every `[rankN]:` marker."""
    for line in lines:
        marks = list(RANK_MARK.finditer(line))
        if not marks:
            yield None, line
            continue
        if marks[0].start() > 0:
            yield None, line[:marks[0].start()]
        for mark, after in zip(marks, marks[1:] + [None]):
            yield int(mark.group(1)), line[mark.end():after.start() if after else len(line)]


def read_logs(paths: Iterable[str | Path]) -> dict[int | None, RankLog]:
    ranks: dict[int | None, RankLog] = {}
    for path in paths:
        for rank, text in segments(open_log(path)):
            log = ranks.setdefault(rank, RankLog(-1 if rank is None else rank))
            if "Traceback (most recent call last)" in text:
                log.frames = []
            for match in FRAME.finditer(text):
                if len(log.frames) < MAX_FRAMES:
                    log.frames.append(Frame(match.group(1), int(match.group(2)), match.group(3)))
            for kind, pattern in ERRORS:
                found = pattern.search(text)
                if found and len(log.errors) < 20:
                    log.errors.append((kind, text[max(0, found.start() - 200):found.end() + 300].strip()))
                    break
    return ranks


# -- analysis ----------------------------------------------------------------------------

def implied_versions(frames: list[Frame]) -> dict[str, str | None]:
    """The pinned version each package's frame line numbers agree with (None: unknown)."""
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
            if conflicts == 0 and hits > best_hits:
                best, best_hits = version, hits
        out[package] = best
    return out


def diagnose(paths: Iterable[str | Path], ranks_per_node: int = 8) -> dict:
    ranks = read_logs(paths)
    failing = {r: log for r, log in ranks.items() if log.errors}
    kinds = collections.Counter(kind for log in failing.values() for kind, _ in log.errors[:1])
    kind = kinds.most_common(1)[0][0] if kinds else None
    reporters = sorted(r for r, log in failing.items() if r is not None and log.errors[0][0] == kind)
    with_frames = [log for r, log in ranks.items() if log.frames and (r in reporters or not reporters)]
    frames = max(with_frames, key=lambda log: len(log.frames)).frames if with_frames else []
    point = callpath.locate([f.function for f in frames])
    error_text = next((log.errors[0][1] for r, log in failing.items() if log.errors[0][0] == kind), None)
    timeout_ms = _timeout_ms(error_text)
    versions = implied_versions(frames)
    waiting_on = [0] if point.phase in COORDINATOR_PHASES and 0 not in reporters else []
    report = {
        "operation": point.operation, "target": point.target, "phase": point.phase,
        "waiting_call": point.waiting_call, "error_kind": kind, "error": error_text,
        "ranks": reporters, "nodes": sorted({r // ranks_per_node for r in reporters}),
        "waiting_on": waiting_on, "timeout_ms": timeout_ms,
        "torch": versions["torch"], "accelerate": versions["accelerate"],
        "frames": [f"{f.file}:{f.line} in {f.function}" for f in frames],
        "rank0_reported": 0 in failing, "known": bool(kind and (point.operation or kind in ("oom", "peer-closed"))),
    }
    report["causes"] = rank_causes(report, ranks)
    return report


def _timeout_ms(text: str | None) -> int | None:
    if not text:
        return None
    gloo = callpath.gloo_timeout_ms(text)
    if gloo is not None:
        return gloo
    match = TIMEOUT_MS.search(text)
    return int(next(g for g in match.groups() if g)) if match else None


def rank_causes(report: dict, ranks: dict) -> list[dict]:
    """Most likely causes first, each with the evidence for it."""
    causes = []
    kind, phase = report["error_kind"], report["phase"]
    if kind == "gloo-timeout" and phase in COORDINATOR_PHASES:
        evidence = [f"{len(report['ranks'])} rank(s) timed out in {phase} ({report['waiting_call']}), where every "
                    f"rank waits for the coordinator, rank 0"]
        if report["timeout_ms"] == 1_800_000:
            evidence.append("the timeout is gloo's default 30 minutes: the group was created without timeout=")
        world = max(report["ranks"], default=0) + 1
        if world >= 256:
            evidence.append(f"the job has at least {world} ranks: rank 0's planning work grows with N "
                            f"(measured: see {DOCS}, `ckptdoctor simulate` / `ckptdoctor check`)")
        if report["target"] == "optimizer":
            evidence.append("the optimizer save has ~3 items per parameter (two sharded moments and a replicated step)"
                            ", so its plan is the largest")
        causes.append({"cause": "rank 0 (the DCP coordinator) was still planning when the peers' deadline passed",
                       "score": 0.8, "evidence": evidence,
                       "action": f"use ckptdoctor's ScalableSavePlanner and a checkpoint group with a longer timeout "
                                 f"(docs/fix-for-mova.md); check the layout with `ckptdoctor check`"})
        dead = ["rank 0 did not report an error in these logs" if not report["rank0_reported"]
                else "rank 0 reported an error too: see its frames"]
        causes.append({"cause": "rank 0 died or hung (e.g. killed for memory) before answering",
                       "score": 0.3 if not report["rank0_reported"] else 0.5, "evidence": dead,
                       "action": "check rank 0's host for OOM kills (dmesg) and its own log lines"})
        causes.append({"cause": "a collective mismatch: rank 0 entered a different collective",
                       "score": 0.1, "evidence": ["no rank-0-only collective exists in Accelerate's save_state path "
                                                  f"(checked for 1.13.0 and 1.15.0, {DOCS})"],
                       "action": "compare rank 0's py-spy dump with a peer's during the next save"})
    elif kind == "gloo-timeout":
        causes.append({"cause": f"a gloo collective ({report['waiting_call']}) timed out", "score": 0.5,
                       "evidence": [report["error"] or ""], "action": "find the rank that did not arrive"})
    elif kind == "peer-closed":
        causes.append({"cause": "another rank died: its gloo connection closed", "score": 0.8,
                       "evidence": [f"ranks {format_ranks(report['ranks'])} saw their peer close the connection"],
                       "action": "find the first rank that exited (its own error, or an OOM kill on its host)"})
    elif kind == "collective-watchdog":
        causes.append({"cause": "an NCCL/HCCL collective timed out (the device group, not the gloo plan exchange)",
                       "score": 0.7, "evidence": [report["error"] or ""],
                       "action": "ranks diverged around the save: one rank in a device collective, others not"})
    elif kind == "oom":
        causes.append({"cause": "a process was killed for memory", "score": 0.8, "evidence": [report["error"] or ""],
                       "action": f"rank 0 gathers every rank's plan: its memory grows with N ({DOCS})"})
    return causes


# -- output ------------------------------------------------------------------------------

def format_report(report: dict) -> str:
    if not report["known"]:
        lines = ["unknown failure pattern: no checkpoint timeout, closed connection, watchdog or OOM recognised"]
        if report["frames"]:
            lines.append("frames found (outermost first):")
            lines += [f"  {f}" for f in report["frames"]]
        return "\n".join(lines)
    what = " ".join(x for x in (report["operation"], report["target"]) if x) or "unknown operation"
    lines = [f"failure: {report['error_kind']} during the {what} "
             f"({report['phase'] or 'phase unknown'}, waiting in {report['waiting_call'] or '?'})"]
    if report["ranks"]:
        lines.append(f"reported by ranks {format_ranks(report['ranks'])} on node(s) "
                     f"{format_ranks(report['nodes'])} (8 ranks per node assumed)")
    if report["waiting_on"]:
        lines.append(f"waiting on: rank {format_ranks(report['waiting_on'])} (the DCP coordinator)")
    if report["timeout_ms"] is not None:
        lines.append(f"timeout: {report['timeout_ms']} ms")
    lines.append(f"versions implied by the frames: torch {report['torch'] or 'unknown'}, "
                 f"accelerate {report['accelerate'] or 'unknown'}")
    lines.append("likely causes, most likely first:")
    for i, cause in enumerate(report["causes"], 1):
        lines.append(f"  {i}. {cause['cause']}")
        lines += [f"     - {e}" for e in cause["evidence"]]
        lines.append(f"     what to do: {cause['action']}")
    return "\n".join(lines)
