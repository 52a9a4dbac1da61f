"""Rank 0's share of a save at N ranks, measured or extrapolated: the cost model behind
`ckptdoctor check` (and the lab's `ckptdoctor simulate`).

Runs save_phases.py's measurements as jobs (jobs.py) in an interpreter whose torch is measured
(this one, by default) and fits cost laws (fits.py) where a full measurement would take hours:

* the per-item phases (unpickling, dedup, metadata, pickling, finish) are measured with
  every rank's plan materialised up to `max_measured` ranks and extrapolated linearly in N
  beyond (every rank sends the same number of items, so the work grows with N);
* with `planner="ours"` (ScalableSavePlanner) rank 0 plans from its own state dict, so its
  planning is measured in full at every N (`measure_planning_ours`); its finish step (the
  write results every rank sends) is per item like stock's and comes from the materialised
  measurement;
* stock validation is measured on a sample (one tensor per distinct shape, weighted by count) up
  to `max_validated` ranks and extrapolated beyond with the power law fitted on the last
  two measured points (quadratic on torch 2.8.0).

Every record says which of its phases were measured and which extrapolated, from where.
benchmarks/extrapolation_error.py measures how far the extrapolation is from a direct
measurement at N=256.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from .fits import extrapolate_linear, extrapolate_power
from .jobs import Workload, here_only, run_job
from .units import fmt_b, fmt_s

DEADLINE_S = 1800.0
FINISH_PREFIX = "finish: "
TOTALS = ("items_gathered", "bytes_to_rank0", "bytes_from_rank0", "peak_mem_bytes")


@dataclasses.dataclass
class ScalingOptions(Workload):
    planners: tuple[str, ...] = ("stock", "ours")
    max_measured: int = 16
    max_validated: int = 2816  # torch's validation sampled at every N up to here (chunk counts step with N)
    parallel: int = 2


def measurement_jobs(opts: ScalingOptions):
    """(key, stack, job) for every measurement the requested records need."""
    measured = sorted({n for n in opts.ranks if n <= opts.max_measured} | {8, opts.max_measured})
    validated = sorted({n for n in opts.ranks if n <= opts.max_validated}
                       | {n for n in (256, 512, opts.max_validated) if n <= opts.max_validated})
    for stack in opts.stacks:
        for layout in opts.layouts:
            for save in opts.saves:
                base = opts.source(save) | {"layout": str(layout), "save": save}
                for planner in opts.planners:
                    for n in measured:
                        if layout.kind == "fsdp" or n % layout.shard == 0:
                            yield ("coordinator", stack, str(layout), save, n, planner), stack, base | {
                                "kind": "coordinator", "ranks": n, "validation_sample": 1, "planner": planner}
                    for n in sorted(set(opts.ranks) | set(measured)) if planner == "ours" else ():
                        if layout.kind == "fsdp" or n % layout.shard == 0:
                            yield ("planning", stack, str(layout), save, n, planner), stack, base | {
                                "kind": "planning", "ranks": n}
                for n in validated if "stock" in opts.planners else ():
                    if layout.kind == "fsdp" or n % layout.shard == 0:
                        yield ("validation", stack, str(layout), save, n, "stock"), stack, base | {
                            "kind": "validation", "ranks": n}


def measure_all(opts: ScalingOptions, progress=print, python_for=here_only) -> dict:
    """Every job's result, keyed as `measurement_jobs` names them; `python_for(stack)` is the interpreter."""
    jobs = list(measurement_jobs(opts))
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=opts.parallel) as pool:
        futures = {pool.submit(run_job, python_for(stack), job): key for key, stack, job in jobs}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            key = futures[future]
            results[key] = future.result()
            progress(f"  [{done}/{len(jobs)}] {key[1]} {key[5]} {key[2]} {key[3]} save, {key[0]} at N={key[4]}")
    return results


def _validation_s(per_class) -> float:
    return sum(count * seconds for _, count, seconds in per_class)


def build_records(opts: ScalingOptions, results: dict) -> list[dict]:
    records = []
    for stack in opts.stacks:
        for layout in opts.layouts:
            for save in opts.saves:
                for planner in opts.planners:
                    records += [_record(opts, results, stack, layout, save, n, planner) for n in opts.ranks
                                if layout.kind == "fsdp" or n % layout.shard == 0]
    return records


def _record(opts, results, stack, layout, save, n, planner) -> dict:
    key = lambda kind, r: (kind, stack, str(layout), save, r, planner)  # noqa: E731
    coord = {r: results[key("coordinator", r)] for r in _measured_ns(results, stack, layout, save, "coordinator", planner)}
    if planner == "ours":
        phase_s, basis, totals = _ours_at(results, key, coord, n)
        measured, fit_from = True, [] if n in coord else [max(coord)]
    else:
        phase_s, basis, totals = _from_coordinator(coord, n)
        valid = {r: _validation_s(results[key("validation", r)]["per_class"])
                 for r in _measured_ns(results, stack, layout, save, "validation", planner)}
        phase_s["validate"], basis["validate"] = _stock_validation(valid, n)
        measured = n in coord and n in valid
        fit_from = ([] if n in coord else sorted(coord)[-2:]) + ([] if n in valid else sorted(valid)[-2:])
    planning = {k: v for k, v in phase_s.items() if not k.startswith(FINISH_PREFIX)}
    return {
        "stack": stack, "torch": next(iter(coord.values()))["torch"], "planner": planner, "layout": str(layout),
        "mode": "checkpoint" if save in opts.checkpoints else opts.mode, "save": save, "ranks": n,
        **{k: int(v) for k, v in totals.items() if k != "results_to_rank0"},
        "phase_s": phase_s, "phase_basis": basis, "coordinator_s": sum(planning.values()),
        "finish_s": sum(v for k, v in phase_s.items() if k.startswith(FINISH_PREFIX)),
        "measured": measured, "fit_from": sorted(set(fit_from)),
    }


def _ours_at(results, key, coord: dict[int, dict], n: int) -> tuple[dict, dict, dict]:
    """ScalableSavePlanner at n: planning measured at n; the finish step measured with every
    write result materialised at n, or beyond on the straight line in the items written (the
    chunk count the planning job measured at each N) through the two largest such N."""
    planned = results[key("planning", n)]
    chunks = {r: results[key("planning", r)]["chunks"] for r in coord}
    if n in coord:
        finish, how = dict(coord[n]["phase_s"]), "measured"
        finish_totals = {k: coord[n][k] for k in ("results_to_rank0", "peak_mem_bytes")}
    else:
        how = f"extrapolated (linear in items written, fit from N={','.join(map(str, sorted(coord)[-2:]))})"
        finish, finish_totals = on_the_line(coord, planned["chunks"], ("results_to_rank0", "peak_mem_bytes"),
                                             x_of=chunks.get)
    phase_s = finish | planned["phase_s"]
    basis = {k: how for k in finish} | {k: "measured" for k in planned["phase_s"]}
    totals = {"items_gathered": planned["items_gathered"], "peak_mem_bytes": planned["peak_mem_bytes"],
              "bytes_from_rank0": planned["bytes_from_rank0"],
              "bytes_to_rank0": planned["bytes_to_rank0"] + finish_totals["results_to_rank0"],
              "finish_mem_bytes": finish_totals["peak_mem_bytes"],
              "agreement_bytes_per_rank": planned["agreement_bytes_per_rank"]}
    return phase_s, basis, totals


def _from_coordinator(coord: dict[int, dict], n: int) -> tuple[dict, dict, dict]:
    """(phase seconds, their basis, totals) at n from the jobs with every plan materialised:
    measured at n, else on the straight line through the two largest measured N."""
    if n in coord:
        m = coord[n]
        return dict(m["phase_s"]), {k: "measured" for k in m["phase_s"]}, {k: m[k] for k in TOTALS + ("results_to_rank0",)}
    fit = f"extrapolated (linear fit from N={','.join(map(str, sorted(coord)[-2:]))})"
    phase_s, totals = on_the_line(coord, n, TOTALS + ("results_to_rank0",))
    return phase_s, {phase: fit for phase in phase_s}, totals


def on_the_line(coord: dict[int, dict], x: float, totals, x_of=lambda n: n) -> tuple[dict, dict]:
    """(phase seconds, totals) at x on the straight line through the measurements at each N,
    placed at x_of(N). A peak does not shrink with more data, so the peak memory is never
    below what the measured points reached."""
    xs = [x_of(n) for n in coord]

    def line(values):
        return extrapolate_linear(dict(zip(xs, values)), x)

    points = list(coord.values())
    phase_s = {k: line([m["phase_s"][k] for m in points]) for k in coord[max(coord)]["phase_s"]}
    at_x = {k: line([m[k] for m in points]) for k in totals}
    at_x["peak_mem_bytes"] = max(at_x["peak_mem_bytes"], max(m["peak_mem_bytes"] for m in points))
    return phase_s, at_x


def _stock_validation(valid: dict[int, float], n: int) -> tuple[float, str]:
    """torch's validation: measured on a sample at n, else the power law of the last two N."""
    if n in valid:
        return valid[n], "measured on a sample (one tensor per shape, scaled by count)"
    seconds, exponent = extrapolate_power(valid, n)
    last_two = sorted(valid)[-2:]
    return seconds, f"extrapolated (N^{exponent:.2f} fit from N={last_two[0]},{last_two[1]})"


def _measured_ns(results, stack, layout, save, kind, planner) -> list[int]:
    return sorted(k[4] for k in results
                  if k[0] == kind and k[1] == stack and k[2] == str(layout) and k[3] == save and k[5] == planner)


def format_table(records: list[dict]) -> str:
    width = max([9] + [len(r["save"]) for r in records])
    head = f"{'torch':>7} {'planner':>7} {'layout':>7} {'save':>{width}} {'N':>5}  {'rank-0 planning':>15} " \
           f"{'of which validate':>17} {'to rank 0':>10} {'rank-0 mem':>10}  {'then finish':>11}  basis"
    lines = [head, "-" * len(head)]
    for r in records:
        plan = r["coordinator_s"]
        flag = " > 30 min" if plan > DEADLINE_S else ""
        lines.append(f"{r['torch']:>7} {r['planner']:>7} {r['layout']:>7} {r['save']:>{width}} {r['ranks']:>5}  "
                     f"{fmt_s(plan):>15} {_validate_cell(r):>17} {fmt_b(r['bytes_to_rank0']):>10} "
                     f"{fmt_b(r['peak_mem_bytes']):>10}  {fmt_s(r['finish_s']):>11}  "
                     f"{'measured' if r['measured'] else 'extrapolated'}{flag}")
    return "\n".join(lines)


def _validate_cell(record: dict) -> str:
    """Stock's validation is its own phase; ours validates inside its global plan step."""
    seconds = record["phase_s"].get("validate")
    return "in global plan" if seconds is None else fmt_s(seconds)
