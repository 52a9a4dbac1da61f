"""Do the cost model's laws predict a point they were not fitted on? Measured, not asserted.

    .venv/user/bin/python benchmarks/cost_model_laws.py [--repeats 5] [--out docs/evidence/cost_model_laws_user.txt]

`ckptdoctor check` measures rank 0's phases at small N and extrapolates: stock's validation by a
power law in N, stock's other phases and ours' finish step by a line (in N, or in the items
written). Each law here is fitted on two points and compared with a third, measured in the same
run (best of `repeats`, taken round-robin over the Ns, so a slow spell on shared cores hits every
N). Reports each law's prediction / measurement ratio. These were tests with a +-30 % bound; a
CPU-time law is a benchmark's business: a loaded machine (one CI run inflated N=256 by 60 %)
must not turn a suite red. The suite keeps what does not depend on time (tests/check).
"""

import argparse
import dataclasses
import math
import time
from pathlib import Path

from ckptdoctor.check.fits import extrapolate_linear, extrapolate_power
from ckptdoctor.check.layout import Layout
from ckptdoctor.check.mova_shape import MovaShape
from ckptdoctor.check.save_phases import measure_coordinator, measure_planning_ours, validation_seconds_per_tensor
from ckptdoctor.check.state_dicts import mova_specs

# Widths above the largest N: a dimension smaller than the shard group gives the extra ranks the
# same empty chunk, which dedup folds, and the per-chunk work stops growing.
WIDE = dataclasses.replace(MovaShape(), video_dim=64, video_ffn=128, audio_dim=64, audio_ffn=128, text_dim=64,
                           latent_channels=64, freq_dim=64).with_layers(6)


def interleaved_best(measure, ns, repeats: int) -> dict:
    best = {n: math.inf for n in ns}
    for _ in range(repeats):
        for n in ns:
            best[n] = min(best[n], measure(n))
    return best


def validation_law(repeats: int) -> dict:
    """Stock's quadratic validation, one 5120 x 5120 tensor: fit 256, 512; predict 1024."""
    layout, shape = Layout.parse("fsdp"), (5120, 5120)
    measured = interleaved_best(lambda n: validation_seconds_per_tensor(shape, n, layout), (256, 512, 1024), repeats)
    predicted, exponent = extrapolate_power({n: measured[n] for n in (256, 512)}, 1024)
    return {"law": "stock validation, power in N", "fit": "N=256,512", "at": "N=1024", "measured_s": measured[1024],
            "predicted_s": predicted, "exponent": round(exponent, 2)}


def coordinator_law(repeats: int) -> dict:
    """Stock's per-item phases (all but validation), optimizer save: fit 8, 16; predict 32."""
    specs, layout = mova_specs(WIDE, "sft"), Layout.parse("fsdp")
    runs = interleaved_best(lambda n: sum(v for k, v in measure_coordinator("optimizer", specs, n, layout,
                                                                            validation_sample=1).phase_s.items()
                                          if k != "validate"), (8, 16, 32), repeats)
    return {"law": "stock per-item phases, line in N", "fit": "N=8,16", "at": "N=32", "measured_s": runs[32],
            "predicted_s": extrapolate_linear({8: runs[8], 16: runs[16]}, 32)}


def ours_finish_law(repeats: int) -> dict:
    """Ours' finish step, optimizer save: a line in the items written, fit at 16, 32; predict 96."""
    specs, layout, ns = mova_specs(WIDE, "sft"), Layout.parse("fsdp"), (16, 32, 96)
    finish = interleaved_best(lambda n: sum(measure_coordinator("optimizer", specs, n, layout,
                                                                planner="ours").phase_s.values()), ns, repeats)
    chunks = {n: measure_planning_ours("optimizer", specs, n, layout, repeats=1)["chunks"] for n in ns}
    return {"law": "ours' finish, line in items written", "fit": "N=16,32", "at": "N=96", "measured_s": finish[96],
            "predicted_s": extrapolate_linear({chunks[16]: finish[16], chunks[32]: finish[32]}, chunks[96])}


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    lines = [f"# benchmarks/cost_model_laws.py --repeats {args.repeats}  ({time.strftime('%Y-%m-%d %H:%M')}, "
             f"torch {torch.__version__.split('+')[0]}, this machine's CPU time, best of {args.repeats})",
             f"{'law':38s} {'fit on':10s} {'at':7s} {'measured':>10s} {'predicted':>10s} {'ratio':>6s}"]
    for law in (validation_law, coordinator_law, ours_finish_law):
        print(f"measuring: {law.__doc__.splitlines()[0]}", flush=True)
        r = law(args.repeats)
        lines.append(f"{r['law']:38s} {r['fit']:10s} {r['at']:7s} {r['measured_s']:9.3f}s {r['predicted_s']:9.3f}s "
                     f"{r['predicted_s'] / r['measured_s']:6.2f}")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
