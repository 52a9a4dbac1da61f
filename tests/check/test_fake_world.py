"""The memory figures of `check`'s jobs are the job's own: not its parent's, not its setup's."""

import subprocess
import sys

from ckptdoctor.check.fake_world import peak_from_here, peak_rss_bytes

MB = 1 << 20
READ_PEAK = "from ckptdoctor.check.fake_world import peak_rss_bytes; print(peak_rss_bytes())"


def touched(size: int) -> bytearray:
    block = bytearray(size)
    block[::4096] = b"\1" * len(block[::4096])  # every page resident
    return block


def test_a_job_started_by_a_large_process_reports_its_own_peak_not_the_parents():
    held = touched(1024 * MB)  # the parent (pytest here, a trainer elsewhere) holds 1 GiB when it starts the job
    out = subprocess.run([sys.executable, "-c", READ_PEAK], capture_output=True, text=True, check=True).stdout
    del held
    assert int(out) < 300 * MB  # a bare interpreter; getrusage's ru_maxrss says >= 1 GiB here


def test_the_peak_counts_from_the_phases_start_not_from_what_the_setup_held():
    setup = touched(256 * MB)
    del setup  # freed before the phase starts
    baseline = peak_from_here()
    phase = touched(64 * MB)
    peak = peak_rss_bytes() - baseline
    del phase
    assert 60 * MB <= peak < 128 * MB  # the phase's 64 MiB, not the setup's 256
