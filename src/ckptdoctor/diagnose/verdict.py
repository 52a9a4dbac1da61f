"""One verdict, rendered twice: the diagnosis's findings, each with its confidence and evidence.

A finding is a value, how sure the diagnoser is of it, and the log lines it rests on:

* "certain": read from the log as such (an error line, a frame, a rank prefix, a host line);
* "likely": inferred by a stated rule from what the log shows (the coordinator is awaited in a
  coordinator phase; versions matched by several frames; a save named by a progress line);
* "unknown": the log does not say. The value is then None, never a guess.

`render_text` and `Verdict.to_dict` (the JSON) both read the same findings, so the two cannot say
different things.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..ranks import format_ranks

CERTAIN, LIKELY, UNKNOWN = "certain", "likely", "unknown"


@dataclasses.dataclass
class Finding:
    value: Any = None
    confidence: str = UNKNOWN
    evidence: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, value, confidence: str, *evidence: str) -> "Finding":
        if value is None or value == [] or value == {}:
            return cls()
        return cls(value, confidence, [e.strip()[:300] for e in evidence if e and e.strip()][:3])


@dataclasses.dataclass
class Cause:
    id: str
    cause: str
    confidence: str
    evidence: list[str]
    action: str


FIELDS = ("error", "operation", "target", "phase", "waiting_call", "ranks", "local_ranks", "exitcodes", "waiting_on",
          "timeout_ms", "collectives", "desync", "nodes", "torch", "accelerate", "frames")


@dataclasses.dataclass
class Verdict:
    findings: dict[str, Finding]
    causes: list[Cause]
    files: list[str]
    truncated: list[str]

    @property
    def known(self) -> bool:
        return self.findings["error"].value is not None

    def __getitem__(self, name: str):
        """The value of a finding (None when unknown), or the causes as dicts."""
        if name == "causes":
            return [dataclasses.asdict(c) for c in self.causes]
        if name == "known":
            return self.known
        return self.findings[name].value

    def finding(self, name: str) -> Finding:
        return self.findings[name]

    def to_dict(self) -> dict:
        return {"known": self.known, **{name: dataclasses.asdict(f) for name, f in self.findings.items()},
                "causes": self["causes"], "files": self.files, "truncated": self.truncated}


def render_text(verdict: Verdict) -> str:
    f = verdict.findings
    lines = []
    for note in verdict.truncated:
        lines.append(f"note: truncated input: {note}")
    if not verdict.known:
        lines.append("unknown failure pattern: no timeout, watchdog, checkpoint error, kill, closed connection or "
                     "exception recognised")
    else:
        what = " ".join(str(x) for x in (f["operation"].value, f["target"].value) if x) or "operation unknown"
        where = f["phase"].value or "phase unknown"
        wait = f"waiting in {f['waiting_call'].value}" if f["waiting_call"].value else "wait unknown"
        lines.append(f"failure: {f['error'].value} during {what} ({where}, {wait})")
    for name, label in (("operation", "operation"), ("phase", "phase"), ("waiting_call", "waiting in"),
                        ("ranks", "reported by ranks"), ("local_ranks", "local ranks (torchrun)"),
                        ("exitcodes", "exit codes"), ("waiting_on", "waiting on rank"), ("timeout_ms", "timeout"),
                        ("nodes", "nodes"), ("desync", "ranks in different collectives"),
                        ("collectives", "collective per rank"), ("torch", "torch"), ("accelerate", "accelerate")):
        if f[name].value is not None:
            why = f" ({f[name].evidence[0]})" if f[name].confidence == LIKELY and f[name].evidence else ""
            lines.append(f"{label}: {_show(name, f[name].value)}  [{f[name].confidence}]{why}")
    unknown = [name for name in ("operation", "ranks", "timeout_ms", "torch") if f[name].value is None]
    if unknown:
        lines.append(f"not in the log: {', '.join(unknown)}")
    if verdict.causes:
        lines.append("likely causes, most likely first:")
        for i, cause in enumerate(verdict.causes, 1):
            lines.append(f"  {i}. {cause.cause}  [{cause.confidence}]")
            lines += [f"     - {e}" for e in cause.evidence]
            lines.append(f"     what to do: {cause.action}")
    if f["frames"].value:
        lines.append("frames (outermost first):")
        lines += [f"  {frame}" for frame in f["frames"].value]
    return "\n".join(lines)


def _show(name: str, value) -> str:
    if name in ("ranks", "local_ranks", "waiting_on"):
        return format_ranks(value)
    if name == "timeout_ms":
        return f"{value} ms"
    if name == "nodes":
        return "; ".join(f"{host}: ranks {format_ranks(ranks)}" for host, ranks in value.items())
    if name == "collectives":
        return ", ".join(f"rank {r}: SeqNum {seq} {op}" for r, (seq, op) in sorted(value.items(), key=lambda x: int(x[0])))
    return str(value)
