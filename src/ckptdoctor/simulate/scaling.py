"""`ckptdoctor simulate`: rank 0's share of the save at N ranks, on the lab's pinned stacks.

The cost model is the product's (check/save_model.py); the lab runs it in each stack's
interpreter (.venv/<stack>/bin/python), so that torch 2.8.0 and the newest torch are
compared in one run, and plots it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..check.jobs import HERE
from ..check.save_model import DEADLINE_S
from ..errors import CkptDoctorError
from ..repro.stacks import STACKS

REPO = Path(__file__).resolve().parents[3]  # the checkout: its .venv/<stack> interpreters


def stack_python(stack: str) -> str:
    if stack == HERE:
        return sys.executable
    python = REPO / ".venv" / stack / "bin" / "python"
    if stack not in STACKS:
        raise CkptDoctorError(f"unknown stack {stack!r}; expected one of: {', '.join(STACKS)}")
    if not python.exists():
        raise CkptDoctorError(f"the '{stack}' stack is not set up; run scripts/setup.sh {stack}")
    return str(python)


def plot(records: list[dict], path: str) -> None:
    """One panel per save; colour = torch and planner, line style = layout; the deadline in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saves = [s for s in ("optimizer", "model") if any(r["save"] == s for r in records)]
    fig, axes = plt.subplots(1, len(saves), figsize=(6.5 * len(saves), 5.5), sharey=True, squeeze=False)
    series = sorted({(r["torch"], r["planner"]) for r in records})
    colours = {key: plt.cm.tab10(i) for i, key in enumerate(series)}
    styles = {layout: style for layout, style in zip(sorted({r["layout"] for r in records}), ("-", "--", ":", "-."))}
    for ax, save in zip(axes[0], saves):
        for (torch_v, planner) in series:
            for layout, style in styles.items():
                rows = sorted((r for r in records if (r["torch"], r["planner"], r["layout"], r["save"]) ==
                               (torch_v, planner, layout, save)), key=lambda r: r["ranks"])
                if not rows:
                    continue
                xs, ys = [r["ranks"] for r in rows], [max(r["coordinator_s"], 1e-2) for r in rows]
                colour = colours[(torch_v, planner)]
                ax.plot(xs, ys, style, color=colour, label=f"torch {torch_v}, {planner}, {layout}")
                for r, y in zip(rows, ys):
                    ax.plot(r["ranks"], y, "o", color=colour, fillstyle="full" if r["measured"] else "none")
        ax.axhline(DEADLINE_S, color="red", linestyle="--", linewidth=1)
        ax.text(xs[0], DEADLINE_S * 1.2, "gloo default deadline: 30 min", color="red", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ranks (N)")
        ax.set_title(f"{save} save")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("rank 0 planning time (s)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4)  # below the panels: no data hidden
    fig.suptitle(f"MOVA {records[0]['mode']}: rank 0's share of a DCP save (filled: measured, hollow: extrapolated)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
