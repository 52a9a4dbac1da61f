"""The fix's knobs, reachable without editing the trainer: keyword, else environment, else default.

    CKPTDOCTOR_GROUP_TIMEOUT_S   the checkpoint group's gloo timeout          (default 10800 s, 3 h)
    CKPTDOCTOR_LOST_RANK_S       a rank silent this long is taken as lost      (default 300 s)
    CKPTDOCTOR_ON_LOST_RANK      "exit" (every rank exits 75) or "log"          (default exit)
    CKPTDOCTOR_HEARTBEAT         "process": a forked child posts too, so a rank busy holding
                                 the GIL stays alive; "thread": the Python thread only (default process)
    CKPTDOCTOR_LOG_LEVEL         the level of the "ckptdoctor" loggers          (default INFO, summary.py)
    CKPTDOCTOR_PUBLISH           "rename": write beside, rename into place, mark; "in_place": write
                                 in place, mark last, for object-store mounts (publish.py) (default rename)
    CKPTDOCTOR_SAVE_ROOT         the directory holding the trainer's step directories: at startup,
                                 a step a dead save left incomplete there is set aside before the
                                 trainer looks for its newest step (publish.py) (default none)
    CKPTDOCTOR_ASYNC             "1": save_state returns once the state is staged in host memory;
                                 the write, the finish step and the publish run in the
                                 background (background.py) (default 0: synchronous)

A keyword given to `ScalableCheckpointing` (or `install`) wins over the environment. A value
that cannot be used is refused at construction with one line naming the variable, before any
group exists.

The knobs must be the same on every rank: a rank publishing in place while the others rename
would write where nothing is published. Each rank reads its own environment, so right after the
checkpoint group exists every rank compares its resolved settings with rank 0's
(`differences`; the log level alone may differ: it changes
what a rank prints, not what it writes); the job refuses to start, on every rank, naming the ranks and knobs that
differ, before anything is written (checkpointing.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from ..errors import CkptDoctorError
from .heartbeat import LOST_RANK_S
from .publish import MODES as PUBLISH

GROUP_TIMEOUT_S = 3 * 3600.0
ON_LOST_RANK = ("exit", "log")
HEARTBEAT = ("process", "thread")
ENV = {"timeout_s": "CKPTDOCTOR_GROUP_TIMEOUT_S", "lost_rank_s": "CKPTDOCTOR_LOST_RANK_S",
       "on_lost_rank": "CKPTDOCTOR_ON_LOST_RANK", "heartbeat": "CKPTDOCTOR_HEARTBEAT",
       "log_level": "CKPTDOCTOR_LOG_LEVEL", "publish": "CKPTDOCTOR_PUBLISH", "save_root": "CKPTDOCTOR_SAVE_ROOT",
       "async_save": "CKPTDOCTOR_ASYNC"}
SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}

AGREED = tuple(knob for knob in ENV if knob != "log_level")


class BadSetting(CkptDoctorError):
    """A knob's value cannot be used."""


@dataclasses.dataclass(frozen=True)
class Settings:
    timeout_s: float = GROUP_TIMEOUT_S
    lost_rank_s: float = LOST_RANK_S
    on_lost_rank: str = "exit"
    heartbeat: str = "process"
    log_level: str | None = None
    publish: str = "rename"
    save_root: str | None = None
    async_save: bool = False
    sources: tuple[tuple[str, str], ...] = ()  # (knob, "keyword" | variable name) for each one not defaulted

    @classmethod
    def resolve(cls, environ=None, **keywords) -> "Settings":
        """Each knob from its keyword (when not None), else its variable, else its default."""
        environ = os.environ if environ is None else environ
        values, sources = {}, []
        for knob, variable in ENV.items():
            if keywords.get(knob) is not None:
                values[knob], where = keywords[knob], "keyword"
            elif environ.get(variable, "").strip():
                values[knob], where = environ[variable].strip(), variable
            else:
                continue
            values[knob] = _checked(knob, values[knob], where)
            sources.append((knob, where))
        return cls(**values, sources=tuple(sources))

    def apply_log_level(self) -> None:
        if self.log_level is not None:
            logging.getLogger("ckptdoctor").setLevel(self.log_level)

    def describe(self) -> str:
        given = ", ".join(f"{knob} from {where}" for knob, where in self.sources) or "all defaults"
        return (f"checkpoint group timeout {self.timeout_s:.0f} s, lost rank after {self.lost_rank_s:.0f} s "
                f"-> {self.on_lost_rank}, heartbeat by {self.heartbeat}, publish by {self.publish}, "
                f"save root {self.save_root or 'not given'}, {'async' if self.async_save else 'synchronous'} saves ({given})")

    def values(self) -> dict:
        """The resolved knobs every rank must share (not where they came from)."""
        return {knob: getattr(self, knob) for knob in AGREED}

    def differences(self, rank0: dict) -> list[str]:
        """`knob=this rank's value (rank 0: its value)` for each knob that differs from rank 0's."""
        mine = self.values()
        return [f"{knob}={mine[knob]!r} (rank 0: {rank0[knob]!r})" for knob in AGREED if mine[knob] != rank0[knob]]


def _checked(knob: str, value, where: str):
    name = "keyword " + knob if where == "keyword" else where
    if knob in ("timeout_s", "lost_rank_s"):
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise BadSetting(f"{name}={value!r}: expected seconds, a positive number") from None
        if not seconds > 0 or seconds == float("inf"):
            raise BadSetting(f"{name}={value!r}: expected seconds, a positive number")
        return seconds
    if knob == "save_root":
        return os.path.abspath(os.fspath(value))
    if knob == "async_save":
        if isinstance(value, bool):
            return value
        if str(value).strip().lower() not in SWITCH:
            raise BadSetting(f"{name}={value!r}: expected 1 or 0 (true or false)")
        return SWITCH[str(value).strip().lower()]
    if knob in ("on_lost_rank", "heartbeat", "publish"):
        allowed = {"on_lost_rank": ON_LOST_RANK, "heartbeat": HEARTBEAT, "publish": PUBLISH}[knob]
        if value not in allowed:
            raise BadSetting(f"{name}={value!r}: expected one of {', '.join(allowed)}")
        return value
    level = str(value).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise BadSetting(f"{name}={value!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level
