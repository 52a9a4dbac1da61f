"""The check a user runs before a launch: predict rank 0's planning for each save at N ranks
(stock and ScalableSavePlanner) and, asked, the resume (stock load_state and the fix's), with
the torch installed here; warn when a stock save or resume would use a given fraction of the
deadline."""

from __future__ import annotations

import dataclasses

from ..errors import CkptDoctorError
from .save_model import DEADLINE_S, ScalingOptions, build_records, measure_all
from .layout import Layout
from .units import fmt_b, fmt_s

# benchmarks/extrapolation_error.py, docs/evidence/extrapolation_n256_user.txt (torch 2.8.0, MOVA sft, fsdp):
# stock planning extrapolated from N <= 16 read 0.70x (model) and 0.87x (optimizer) of a direct
# measurement at N = 256, so an extrapolated stock figure is a lower bound.
EXTRAPOLATED = ("stock figures past N = 16 are extrapolated; at N = 256 they read 0.70-0.87x of a direct "
                "measurement (docs/evidence/extrapolation_n256_user.txt): read them as lower bounds")
LOAD_ANCHORS = (8, 64)  # a resume is also measured here, for the fit of stock's .metadata past its budget


@dataclasses.dataclass
class CheckOptions:
    """One check: the job (N ranks, a layout, MOVA's saves in `mode` or a checkpoint's), the
    deadline its saves run under and the fraction of it that warns."""

    ranks: int
    layout: Layout | str = "fsdp"     # fsdp or hsdp:S
    mode: str = "sft"
    checkpoint: str | None = None     # a DCP checkpoint's directory, predicted instead of MOVA's saves
    torch_version: str | None = None  # the job's torch, checked against this interpreter's
    load: bool = False                # also predict the resume
    async_save: bool = False          # also predict an async save's host copy (host_copy_model.py)
    ranks_per_node: int = 8
    deadline_s: float = DEADLINE_S
    warn_fraction: float = 0.5

    def __post_init__(self):
        if not 0 < self.warn_fraction <= 1:
            raise CkptDoctorError(f"--warn-fraction must be in (0, 1], got {self.warn_fraction}")
        if isinstance(self.layout, str):
            self.layout = Layout.parse(self.layout)
        self.layout.check(self.ranks)
        if self.ranks_per_node < 1:
            raise CkptDoctorError(f"--ranks-per-node must be at least 1, got {self.ranks_per_node}")


def run_check(opts: CheckOptions, progress=print) -> dict:
    """MOVA's model and optimizer saves (`mode`), or each DCP checkpoint under `checkpoint`,
    saved again at `ranks` ranks under `layout`; with `load`, their resume at `ranks` too."""
    from ..fix.compat import installed_versions

    ranks, layout, deadline_s, warn_fraction = opts.ranks, opts.layout, opts.deadline_s, opts.warn_fraction
    mode, checkpoint, torch_version = opts.mode, opts.checkpoint, opts.torch_version
    installed = installed_versions()[0]
    if torch_version not in (None, installed):
        raise CkptDoctorError(f"--torch {torch_version}: this interpreter has torch {installed}; run check with the "
                              f"job's interpreter (in a checkout: .venv/<stack>/bin/ckptdoctor check)")
    checkpoints, notes = _read_checkpoints(checkpoint) if checkpoint else ({}, [])
    saves = ScalingOptions(ranks=[ranks], layouts=[layout], mode=mode, saves=tuple(checkpoints) or ("model", "optimizer"),
                           checkpoints=checkpoints, max_validated=min(ranks, 1144))
    records = build_records(saves, measure_all(saves, progress=progress))
    if any(r["planner"] == "stock" and not r["measured"] for r in records):
        notes.append(EXTRAPOLATED)
    ours = {r["save"]: r["coordinator_s"] for r in records if r["planner"] == "ours"}
    warnings = [f"{r['save']} save: rank 0 plans for about {fmt_s(r['coordinator_s'])} "
                f"({r['coordinator_s'] / deadline_s:.0%} of the {fmt_s(deadline_s)} deadline) with the stock planner; "
                f"use ckptdoctor's ScalableSavePlanner (`ckptdoctor docs fix-for-mova`): about {fmt_s(ours[r['save']])}"
                for r in records if r["planner"] == "stock" and r["coordinator_s"] >= warn_fraction * deadline_s]
    load_records = _predict_loads(ranks, layout, saves, progress) if opts.load else []
    warnings += [f"resume of the {r['save']} save: rank 0 reads the .metadata and exchanges load plans for about "
                 f"{fmt_s(_stock_load_s(r))} ({_stock_load_s(r) / deadline_s:.0%} of the {fmt_s(deadline_s)} "
                 f"deadline) with stock load_state; ScalableCheckpointing.load_state: about "
                 f"{fmt_s(r['ours']['read_s'] + r['ours']['rank0_exchange_s'])}"
                 for r in load_records if _stock_load_s(r) >= warn_fraction * deadline_s]
    finish = {r["save"]: r["finish_s"] for r in records if r["planner"] == "ours"}
    host_copy = _predict_host_copy(opts, saves, ours, finish) if opts.async_save else None
    if host_copy and host_copy["per_node_bytes"] > host_copy["free_bytes"]:
        warnings.append(f"async save: a node of {host_copy['ranks_per_node']} rank(s) needs "
                        f"{fmt_b(host_copy['per_node_bytes'], 3)} of host memory for the copy and this host has "
                        f"{fmt_b(host_copy['free_bytes'], 3)} free ({host_copy['free_source']}): the first async save "
                        f"would be refused here; save synchronously or free host memory")
    return {"ranks": ranks, "layout": str(layout), "mode": "checkpoint" if checkpoint else mode,
            "checkpoint": checkpoint, "torch": installed, "deadline_s": deadline_s, "warn_fraction": warn_fraction,
            "records": records, "load_records": load_records, "host_copy": host_copy, "warnings": warnings,
            "notes": notes}


def _predict_host_copy(opts: CheckOptions, saves: ScalingOptions, ours: dict[str, float],
                       finish: dict[str, float]) -> dict:
    """Rank 0's host copy of an async save at N (host_copy_model.py), beside this host's free
    memory and rank 0's planning and finish with the fix, which move to the background."""
    from ..fix.host_memory import free_bytes
    from .host_copy_model import predict

    free, source = free_bytes()
    return predict(saves, opts.layout, opts.ranks, opts.ranks_per_node) | {
        "free_bytes": free, "free_source": source, "background_planning_s": ours, "background_finish_s": finish}


def _predict_loads(ranks: int, layout: Layout, saves: ScalingOptions, progress) -> list[dict]:
    """The resume at `ranks` (load_model.py), beside smaller N for the chunk-line fit."""
    from .load_model import LoadOptions, build_records as load_records, measure_all as measure_loads

    ns = sorted({n for n in (*LOAD_ANCHORS, ranks) if n <= ranks and (layout.kind == "fsdp" or n % layout.shard == 0)})
    opts = LoadOptions(ranks=ns, layouts=[layout], mode=saves.mode, saves=saves.saves, checkpoints=saves.checkpoints)
    return [r for r in load_records(opts, measure_loads(opts, progress=progress)) if r["ranks"] == ranks]


def _stock_load_s(record: dict) -> float:
    """Rank 0's part of a stock resume the peers wait for: its .metadata read and the plan exchange."""
    return record["stock"]["read_s"] + record["stock"]["rank0_exchange_s"]


def _read_checkpoints(directory: str) -> tuple[dict[str, str], list[str]]:
    """{save name: absolute path} of each DCP checkpoint there, read once here so that an
    unreadable one is one line before any measurement starts."""
    from .state_dicts import find_checkpoints, read_checkpoint_entries

    checkpoints, notes = {}, []
    for name, path in find_checkpoints(directory):
        entries, read_notes = read_checkpoint_entries(path)
        if not entries:
            raise CkptDoctorError(f"{path}: the checkpoint lists no entries")
        checkpoints[name], notes = str(path.resolve()), notes + read_notes
    return checkpoints, notes
