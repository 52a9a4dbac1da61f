"""Reading failure logs in one streaming pass, with memory bounded whatever the line length.

A log is read in blocks of 1 MB (plain or gzip; a directory: every file in it). In each block a
regular expression of literal words (`ANCHORS`) finds the few lines that can matter, at C speed;
the detailed patterns then run on those lines only, and find everything the diagnosis uses.
Nothing else is kept:

* rank prefixes (`[rank3]:`, torchrun's and Accelerate's): a line's later sightings belong to that
  rank, also when a whole traceback was collapsed onto one line;
* tracebacks (`Traceback (most recent call last):`, with DCP's `(RANK n)`) and their frames, in
  Python's format and faulthandler's (`File "...", line N in f`, no comma);
* error lines: gloo timeouts and closed connections, the NCCL/HCCL watchdog (with each rank's
  SeqNum, OpType and timeout), the watchdog's failure summaries, DCP metadata and key errors,
  CheckpointException, Python's exception lines, out-of-memory messages;
* torchrun's failure reports (exit codes, local and global ranks, hosts) and library progress lines
  that name a save or load ("Saving FSDP model").

Each sighting is attributed to the rank that printed it: the prefix of its line, else a rank the
sighting names itself (`[Rank 3]`, `rank : 3`), else none. Frame lists are interned (ranks that
fail alike share one list), so thousands of ranks cost little.
"""

from __future__ import annotations

import codecs
import dataclasses
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import CkptDoctorError

BLOCK = 1 << 20
OVERLAP = 4096          # a sighting is never longer than this: it is found whole in one block
MAX_FRAMES = 200        # per traceback; a checkpoint traceback has ~20
MAX_ERRORS = 20         # kept per rank
LOG_SUFFIXES = {".log", ".txt", ".out", ".err", ".gz", ""}

GLOO_TIMEOUT = r"\[[^\]\n]*gloo[^\]\n]*\] Timed out waiting (?P<gloo_ms>\d+)ms for (?:recv|send)(?:/send)? operation"
RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")
# Literal words at least one of which every sighting contains: found at C speed, so that the detailed
# patterns below run only on the few lines around them.
ANCHORS = re.compile("|".join(map(re.escape, (
    "Traceback", 'File "', "most recent call first", "Timed out waiting", "Connection closed", "Connection reset",
    "ECONNRESET", "Watchdog caught", "detected by watchdog", "failed collective", "dump debug info", "NCCL operations",
    "data inconsistency", "HCCL", "metadata", "Missing key", "CheckpointException", "out of memory", "OutOfMemory",
    "oom-kill", "Killed process", "exitcode", "local_rank", "host", "ignal ", "Saving", "Loading", "Error",
    "Exception", "Interrupt"))))
WINDOW = 2048           # a sighting is looked for within this many characters of its anchor, on its line
PATTERNS = {
    "traceback": r"Traceback \(most recent call last\):(?: \(RANK (?P<tb_rank>\d+)\))?",
    "fault_thread": r"(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):",
    "frame": r'File "(?P<file>[^"\n]+)", line (?P<line>\d+)(?P<comma>,?) in (?P<func>[\w<>.]+)',
    "gloo_timeout": GLOO_TIMEOUT,
    "peer_closed": r"Connection (?:closed|reset) by peer|ECONNRESET",
    "watchdog": r"\[Rank (?P<wd_rank>\d+)\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), "
                r"OpType=(?P<op>\w+)[^)\n]*?Timeout\(ms\)=(?P<wd_ms>\d+)\)(?: ran for (?P<ran_ms>\d+) milliseconds)?",
    "watchdog_summary": r"Rank (?P<ws_rank>\d+)\]\s+(?:failure detected by watchdog at work sequence id: (?P<ws_seq>\d+)|"
                        r"Exception \(either an error or timeout\) detected by watchdog at work: (?P<ws_seq2>\d+))",
    "hccl_timeout": r"HCCL[^\n]{0,80}?time(?:d)? ?out",
    "watchdog_note": r"Stack trace of the failed collective not found|ProcessGroupNCCL preparing to dump debug info",
    "nccl_down": r"\[Rank (?P<down_rank>\d+)\] (?:Some NCCL operations have failed or timed out|To avoid data "
                 r"inconsistency, we are taking the entire process down)",
    "metadata_missing": r"assert metadata is not None|metadata is None|No such file or directory: '[^'\n]*\.metadata'",
    "missing_key": r"Missing key in checkpoint state_dict: (?P<missing_key>[^\s.]+(?:\.[^\s.]+)*)",
    "checkpoint_exception": r"CheckpointException ranks:dict_keys\(\[(?P<ce_ranks>[\d, ]*)\]\)",
    "oom": r"CUDA out of memory|OutOfMemoryError|out of memory|oom-kill|Out of memory: Killed process",
    # the message is captured by a lookahead, so that a gloo or DCP message inside it is still found on its own
    "exception": r"(?:(?<=\]:)|(?<=\]: )|(?<=\n)|\A)(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt))\b"
                 r"(?=:(?P<exc_text>[^\n]{0,300}))?",
    "torchrun_failed": r"failed \(exitcode: (?P<tr_exit>-?\d+)\) local_rank: (?P<tr_local>\d+) \(pid: (?P<tr_pid>\d+)\)",
    "table_rank": r"(?m:^)\s*rank\s*: (?P<tab_rank>\d+) \(local_rank: (?P<tab_local>\d+)\)",
    "collapsed_rank": r"rank(?P<col_rank>\d+) \(local rank: (?P<col_local>\d+)\)exitcode: (?P<col_exit>-?\d+)",
    "table_exit": r"(?m:^)\s*exitcode\s*: (?P<tab_exit>-?\d+)",
    "table_host": r"(?m:^)\s*host\s*: (?P<tab_host>\S+)",
    "signal": r"[Ss]ignal (?P<signal>\d+) \((?P<signal_name>SIG\w+)\) received",
    "save_progress": r"Saving (?:FSDP model|FSDP Optimizer|the checkpoint|checkpoint)|Loading (?:FSDP model|"
                     r"Optimizer|checkpoint)",
}
SCANNER = re.compile("|".join(f"(?P<k_{name}>{pattern})" for name, pattern in PATTERNS.items()))


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


@dataclasses.dataclass
class Traceback:
    rank: int | None             # the rank whose failure it is (DCP's "(RANK n)"), else the printer's
    printed_by: int | None
    faulthandler: bool
    frames: tuple[Frame, ...] = ()


@dataclasses.dataclass
class Sighting:
    kind: str
    rank: int | None
    text: str
    data: dict


@dataclasses.dataclass
class Evidence:
    """Everything the scan kept."""

    tracebacks: list[Traceback] = dataclasses.field(default_factory=list)
    sightings: list[Sighting] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)
    truncated: list[str] = dataclasses.field(default_factory=list)
    bytes_read: int = 0
    _interned: dict = dataclasses.field(default_factory=dict, repr=False)
    _per_rank: dict = dataclasses.field(default_factory=dict, repr=False)

    def add(self, sighting: Sighting) -> None:
        count = self._per_rank.get((sighting.rank, sighting.kind), 0)
        if count < MAX_ERRORS:
            self._per_rank[sighting.rank, sighting.kind] = count + 1
            self.sightings.append(sighting)

    def intern(self, frames: list[Frame]) -> tuple[Frame, ...]:
        key = tuple(frames)
        return self._interned.setdefault(key, key)

    def of(self, *kinds: str) -> list[Sighting]:
        return [s for s in self.sightings if s.kind in kinds]


class BadLogInput(CkptDoctorError):
    """A log path that cannot be read at all."""


def log_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files to read: each path given, or the log files in a directory (recursively)."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES)
            if not found:
                raise BadLogInput(f"{path} is a directory with no log files in it")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise BadLogInput(f"no such log file: {path}")
    return files


def blocks(path: Path, evidence: Evidence) -> Iterator[str]:
    """The file's text in blocks. Gzip is decompressed incrementally, so that a truncated file
    yields everything up to the break (and is noted) instead of failing as a whole."""
    try:
        with open(path, "rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            data = _gunzip(raw, path, evidence) if gz else iter(lambda: raw.read(BLOCK), b"")
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            for chunk in data:
                evidence.bytes_read += len(chunk)
                yield decoder.decode(chunk)
            yield decoder.decode(b"", final=True)
    except OSError as error:
        raise BadLogInput(f"cannot read {path}: {error.strerror or error}") from None


def _gunzip(raw, path: Path, evidence: Evidence) -> Iterator[bytes]:
    """Decompressed blocks of at most BLOCK bytes (however well the log compresses); members of a
    concatenated gzip one after the other; a stream that ends inside a member is noted as truncated."""
    decompressor, fed, pending = zlib.decompressobj(16 + zlib.MAX_WBITS), False, b""
    while True:
        if not pending:
            pending = raw.read(BLOCK // 4)
            if not pending:
                break
        try:
            out = decompressor.decompress(pending, BLOCK)
        except zlib.error as error:
            evidence.truncated.append(f"{path} (corrupt gzip: {error}); read up to there")
            return
        fed = True
        yield out
        pending = decompressor.unconsumed_tail
        if decompressor.eof:
            pending = decompressor.unused_data + pending
            decompressor, fed = zlib.decompressobj(16 + zlib.MAX_WBITS), False
    if fed and not decompressor.eof:
        evidence.truncated.append(f"{path} (the gzip stream ends early: a truncated file); read up to there")


class _Reader:
    """Carries what spans blocks: the open traceback, the rank prefix of an unfinished line, table rows."""

    def __init__(self, evidence: Evidence):
        self.evidence = evidence
        self.carry_rank: int | None = None   # the rank prefix in force where the last block's scan ended
        self.traceback: Traceback | None = None
        self.frames: list[Frame] = []
        self.table: dict = {}

    def feed(self, text: str, final: bool) -> str:
        """Scan `text`; returns the unscanned tail to prepend to the next block (sightings that
        start in the last OVERLAP characters are found whole there)."""
        limit = len(text) if final else max(0, len(text) - OVERLAP)
        scanned = 0
        for anchor in ANCHORS.finditer(text):
            position = anchor.start()
            if position >= limit:
                break
            if position < scanned:
                continue
            line_start = text.rfind("\n", 0, position) + 1
            line_end = text.find("\n", position)
            start = max(line_start, position - WINDOW, scanned)
            end = min(len(text) if line_end == -1 else line_end, position + WINDOW)
            scanned = position + 1  # the next anchor's window starts after what this one matched, not at its end:
            for match in SCANNER.finditer(text, start, end):  # a frame cut by this window is found whole by its own
                self._sighting(match, self.rank_at(text, match.start()))
                scanned = max(scanned, match.end())
        end = max(limit, scanned)
        self.carry_rank = self.rank_at(text, end)
        return text[end:]

    def rank_at(self, text: str, position: int) -> int | None:
        """The rank prefix of the line `position` is on; a line that began in an earlier block has its."""
        line_start = text.rfind("\n", 0, position) + 1
        i = text.rfind("[rank", line_start, position)
        while i != -1:
            match = RANK_PREFIX.match(text, i)
            if match:
                return int(match.group(1))
            i = text.rfind("[rank", line_start, i)
        return self.carry_rank if line_start == 0 else None

    def _sighting(self, match: re.Match, here: int | None) -> None:
        g = match.groupdict()
        kind = next(k[2:] for k, v in g.items() if k.startswith("k_") and v is not None)
        if kind in ("traceback", "fault_thread"):
            self._close_traceback()
            owner = int(g["tb_rank"]) if g.get("tb_rank") else here
            self.traceback = Traceback(owner, here, kind == "fault_thread")
            self.frames = []
            return
        if kind == "frame":
            if self.traceback is None:  # frames without a header (a cut excerpt): one traceback of their own
                self.traceback = Traceback(here, here, faulthandler=not g["comma"])
            if len(self.frames) < MAX_FRAMES:
                self.frames.append(Frame(g["file"], int(g["line"]), g["func"]))
            return
        if kind in ("table_rank", "table_exit", "table_host", "collapsed_rank", "signal"):
            self._table_row(kind, g, match.group(0), here)
            return
        if kind == "exception":
            self._close_traceback()
        explicit = next((int(g[k]) for k in ("wd_rank", "ws_rank", "down_rank") if g.get(k)), None)
        self.evidence.add(Sighting(kind, here if here is not None else explicit, match.group(0)[:400],
                                   {k: v for k, v in g.items() if v is not None and not k.startswith("k_")}))

    def _table_row(self, kind: str, g: dict, text: str, here: int | None) -> None:
        """torchrun's "Root Cause" table, row by row, and its collapsed one-line form."""
        if kind == "collapsed_rank":
            self.table = {"rank": int(g["col_rank"]), "local_rank": int(g["col_local"]), "exitcode": int(g["col_exit"]),
                          "host": self.table.get("host")}
        elif kind == "table_host":
            self.table = {"host": g["tab_host"]}
        elif kind == "table_rank":
            self.table.update(rank=int(g["tab_rank"]), local_rank=int(g["tab_local"]))
        elif kind == "table_exit":
            self.table["exitcode"] = int(g["tab_exit"])
        elif kind == "signal":
            self.table["signal"] = g["signal_name"]
        if "rank" in self.table and "exitcode" in self.table and ("signal" in self.table or kind == "signal"
                                                                  or self.table["exitcode"] >= 0):
            self.evidence.add(Sighting("torchrun_failure", self.table["rank"], text, dict(self.table)))
            self.table = {"host": self.table.get("host")}

    def _close_traceback(self) -> None:
        if self.traceback is not None and self.frames:
            if self.traceback.faulthandler:  # faulthandler prints the innermost frame first
                self.frames.reverse()
            self.traceback.frames = self.evidence.intern(self.frames)
            self.evidence.tracebacks.append(self.traceback)
        self.traceback, self.frames = None, []

    def finish(self) -> None:
        if self.table.get("exitcode") is not None and "rank" in self.table:
            self.evidence.add(Sighting("torchrun_failure", self.table["rank"], "", dict(self.table)))
        self._close_traceback()


def scan(paths: Iterable[str | Path]) -> Evidence:
    evidence = Evidence()
    for path in log_files(paths):
        evidence.files.append(str(path))
        reader, tail = _Reader(evidence), ""
        for block in blocks(path, evidence):
            tail = reader.feed(tail + block, final=False)
        reader.feed(tail, final=True)
        reader.finish()
    return evidence
