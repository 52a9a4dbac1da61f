"""The save's cost model (check/save_model.py): how measured points are carried past the largest N.
Its laws against a measured, unfitted point (CPU-time laws) are benchmarks/cost_model_laws.py."""


def test_extrapolation_follows_the_line_and_never_lowers_a_peak():
    """save_model.on_the_line: every phase and total on the line through the two largest x
    (N, or the items written at N), and the peak memory floored at the largest measured."""
    from ckptdoctor.check.save_model import on_the_line

    def at(n, seconds, peak):
        return {"phase_s": {"validate": seconds}, "bytes_to_rank0": 10 * n, "peak_mem_bytes": peak}

    coord = {8: at(8, 9.0, 1), 16: at(16, 1.0, 500), 32: at(32, 3.0, 400)}
    phase_s, totals = on_the_line(coord, 64, ("bytes_to_rank0", "peak_mem_bytes"))
    assert phase_s == {"validate": 7.0}  # through N=16 and 32; N=8 is ignored
    assert totals == {"bytes_to_rank0": 640, "peak_mem_bytes": 500}  # the line says 200: floored
    phase_s, _ = on_the_line(coord, 3000, ("peak_mem_bytes",), x_of={8: 100, 16: 1000, 32: 2000}.get)
    assert phase_s == {"validate": 5.0}  # placed at the items written, not at N
