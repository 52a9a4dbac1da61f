"""A resume at N ranks, per rank and for rank 0, stock vs the fix: `check --load` (and the lab's
`simulate --op load`, which runs it in each pinned stack).

Runs load_phases.py's measurements as jobs (jobs.py) in an interpreter whose torch it measures, one
process per measurement (so that the memory a metadata read leaves is that read's). What is measured at every N:

* ours: the index file (written at every N; its rows are 20 bytes per chunk), every rank's read
  of it, every rank's read plan (ScalableLoadPlanner), rank 0's exchange (N markers);
* stock's read plan (DefaultLoadPlanner on the same metadata: its cost does not depend on whether
  chunk lists are shared) and rank 0's exchange (N plans of rank 0's size; up to 256 held at once
  and scaled to N: every plan costs the same).

What cannot be held in memory at every N is measured up to a chunk budget and extrapolated on the
straight line in the number of chunks through the two largest measured N (unpickling and the
objects it leaves are per entry): the stock-written `.metadata` (size, every rank's read and
what it holds), and ours-written `.metadata` as a stock reader reads it. Each value says which.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from .fits import extrapolate_linear
from .jobs import Workload, here_only, run_job
from .layout import Layout
from .units import fmt_b, fmt_s

RANKS_PER_NODE = 8
STOCK_CHUNK_BUDGET = 2_000_000        # stock-written .metadata materialised up to this many chunks
OURS_METADATA_CHUNK_BUDGET = 5_000_000  # ours-written .metadata (stock-readable copy) up to this many


@dataclasses.dataclass
class LoadOptions(Workload):
    stock_chunk_budget: int = STOCK_CHUNK_BUDGET
    ours_metadata_chunk_budget: int = OURS_METADATA_CHUNK_BUDGET


def measure_cell(opts: LoadOptions, python: str, layout: Layout, save: str, n: int, scratch: Path) -> dict:
    """Every measurement of one (interpreter, layout, save, N)."""
    base = opts.source(save) | {"layout": str(layout), "save": save, "ranks": n}
    ours_dir, stock_dir = scratch / "ours", scratch / "stock"
    try:
        plan = run_job(python, base | {"kind": "load-plan"})
        index = run_job(python, base | {"kind": "load-write-ours", "dir": str(ours_dir), "with_metadata": False})
        ours_read = run_job(python, base | {"kind": "load-read", "dir": str(ours_dir), "reader": "ours"})
        chunks = ours_read["chunks_listed"]
        cell = {"chunks": chunks, "plan": plan, "index_bytes": index["index_bytes"], "ours_read": ours_read}
        if chunks <= opts.ours_metadata_chunk_budget:
            shutil.rmtree(ours_dir)
            ours = run_job(python, base | {"kind": "load-write-ours", "dir": str(ours_dir), "with_metadata": True})
            cell["ours_metadata"] = ours | run_job(python, base | {"kind": "load-read", "dir": str(ours_dir),
                                                                        "reader": "stock"})
        if chunks <= opts.stock_chunk_budget:
            stock = run_job(python, base | {"kind": "load-write-stock", "dir": str(stock_dir)})
            cell["stock_metadata"] = stock | run_job(python, base | {"kind": "load-read", "dir": str(stock_dir),
                                                                          "reader": "stock"})
        return cell
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure_all(opts: LoadOptions, progress=print, python_for=here_only) -> dict:
    cells = {}
    for stack in opts.stacks:
        for layout in opts.layouts:
            for save in opts.saves:
                for n in opts.ranks:
                    if layout.kind == "hsdp" and n % layout.shard:
                        continue
                    scratch = Path(tempfile.mkdtemp(prefix="ckptdoctor-load-"))
                    cells[stack, str(layout), save, n] = measure_cell(opts, python_for(stack), layout, save, n, scratch)
                    progress(f"  {stack} {layout} {save} load at N={n}: {cells[stack, str(layout), save, n]['chunks']:,}"
                             f" chunks listed")
    return cells


def on_the_chunk_line(cells: dict[int, dict], field: str, value, chunks: int) -> tuple[float, str]:
    """`value(cell)` at `chunks`: measured where the cell has `field`, else on the straight line in
    chunks through the two largest measured N."""
    measured = {cell["chunks"]: value(cell[field]) for cell in cells.values() if field in cell}
    for n, cell in cells.items():
        if cell["chunks"] == chunks and field in cell:
            return value(cell[field]), "measured"
    if not measured:
        return float("nan"), "not measured"
    fit = sorted(measured)[-2:]
    ns = sorted(n for n, c in cells.items() if c["chunks"] in fit and field in c)
    return extrapolate_linear({x: measured[x] for x in fit}, chunks), \
        f"extrapolated (linear in chunks, fit from N={','.join(map(str, ns))})"


def build_records(opts: LoadOptions, cells: dict) -> list[dict]:
    records = []
    for stack in opts.stacks:
        for layout in opts.layouts:
            for save in opts.saves:
                mine = {k[3]: v for k, v in cells.items() if k[:3] == (stack, str(layout), save)}
                records += [_record(stack, layout, save, n, mine) for n in sorted(mine)]
    return records


def _record(stack, layout, save, n, cells) -> dict:
    cell = cells[n]
    plan, exchange = cell["plan"], cell["plan"]["exchange"]
    stock_bytes, stock_bytes_basis = on_the_chunk_line(cells, "stock_metadata", lambda m: m["metadata_bytes"],
                                                       cell["chunks"])
    stock_read, stock_basis = on_the_chunk_line(cells, "stock_metadata", lambda m: m["read_s"], cell["chunks"])
    stock_held, _ = on_the_chunk_line(cells, "stock_metadata", lambda m: m["held_bytes"], cell["chunks"])
    ours_meta_bytes, ours_meta_basis = on_the_chunk_line(cells, "ours_metadata", lambda m: m["metadata_bytes"],
                                                         cell["chunks"])
    ours_meta_read, _ = on_the_chunk_line(cells, "ours_metadata", lambda m: m["read_s"], cell["chunks"])
    ours_meta_held, _ = on_the_chunk_line(cells, "ours_metadata", lambda m: m["held_bytes"], cell["chunks"])

    def rank0(side):
        return exchange[side]["unpickle_s"] + exchange[side]["pickle_s"]

    return {
        "stack": stack, "torch": plan["torch"], "layout": str(layout), "save": save, "ranks": n,
        "chunks": cell["chunks"], "items_per_rank": plan["items_per_rank"],
        "stock": {"metadata_bytes": stock_bytes, "read_s": stock_read, "held_bytes": stock_held,
                  "node_held_bytes": RANKS_PER_NODE * stock_held, "basis": stock_basis,
                  "local_plan_s": plan["local_plan_s"]["local plan: stock"],
                  "rank0_exchange_s": rank0("stock"), "rank0_plans_held_bytes": exchange["stock"]["plans_held_bytes"],
                  "bytes_to_rank0": exchange["stock"]["bytes_to_rank0"],
                  "bytes_from_rank0": exchange["stock"]["bytes_from_rank0"]},
        "ours": {"index_bytes": cell["index_bytes"], "read_s": cell["ours_read"]["read_s"],
                 "held_bytes": cell["ours_read"]["held_bytes"],
                 "node_held_bytes": RANKS_PER_NODE * cell["ours_read"]["held_bytes"],
                 "metadata_bytes": ours_meta_bytes, "metadata_basis": ours_meta_basis,
                 "stock_reader_read_s": ours_meta_read, "stock_reader_held_bytes": ours_meta_held,
                 "local_plan_s": plan["local_plan_s"]["local plan: ours"], "rank0_exchange_s": rank0("ours"),
                 "bytes_to_rank0": exchange["ours"]["bytes_to_rank0"],
                 "bytes_from_rank0": exchange["ours"]["bytes_from_rank0"]},
        "basis": {"stock metadata": stock_bytes_basis, "ours index, reads, plans": "measured",
                  "rank 0 exchange": f"measured with {exchange['stock']['measured_plans']} plans held, scaled to N"},
    }


def format_table(records: list[dict]) -> str:
    head = (f"{'torch':>7} {'layout':>7} {'save':>9} {'N':>5} {'chunks':>11}  "
            f"{'stock .metadata':>15} {'read/rank':>10} {'held/rank':>10} {'held/node':>10} {'plan/rank':>10} "
            f"{'rank0 xchg':>10}  |  {'our index':>10} {'read/rank':>10} {'held/rank':>10} {'plan/rank':>10} "
            f"{'rank0 xchg':>10}  basis (stock .metadata)")
    lines = [head, "-" * len(head)]
    for r in records:
        s, o = r["stock"], r["ours"]
        lines.append(f"{r['torch']:>7} {r['layout']:>7} {r['save']:>9} {r['ranks']:>5} {r['chunks']:>11,}  "
                     f"{fmt_b(s['metadata_bytes']):>15} {fmt_s(s['read_s']):>10} {fmt_b(s['held_bytes']):>10} "
                     f"{fmt_b(s['node_held_bytes']):>10} {fmt_s(s['local_plan_s']):>10} "
                     f"{fmt_s(s['rank0_exchange_s']):>10}  |  {fmt_b(o['index_bytes']):>10} "
                     f"{fmt_s(o['read_s']):>10} {fmt_b(o['held_bytes']):>10} {fmt_s(o['local_plan_s']):>10} "
                     f"{fmt_s(o['rank0_exchange_s']):>10}  {r['basis']['stock metadata']}")
    return "\n".join(lines)
