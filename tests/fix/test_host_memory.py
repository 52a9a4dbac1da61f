"""The host-memory check before the first async save (fix/host_memory.py)."""

from pathlib import Path

from ckptdoctor.fix import host_memory


def test_the_refusal_is_one_line_naming_the_need_and_what_is_free():
    gib = host_memory.GIB
    assert host_memory.shortfall(gib, 8, 9 * gib, "MemAvailable") is None
    line = host_memory.shortfall(gib, 8, 7 * gib, "memory cgroup /sys/fs/cgroup/memory/job")
    assert line.startswith("an async save stages a host copy of the state: this node needs 8.00 GiB "
                           "(1.00 GiB per rank x 8 rank(s)) and has 7.00 GiB free (memory cgroup ")
    assert "nothing was saved" in line and "CKPTDOCTOR_ASYNC=0" in line and "\n" not in line


def write(directory: Path, files: dict) -> Path:
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def test_a_cgroup_leaves_its_limit_minus_usage_plus_reclaimable_cache(tmp_path):
    """The two formats the kernel writes (v1 and v2), in files laid out as it lays them out."""
    v1 = write(tmp_path / "v1", {"memory.limit_in_bytes": "1000000\n", "memory.usage_in_bytes": "700000\n",
                                 "memory.stat": "cache 5\ntotal_inactive_file 100000\n"})
    assert host_memory._room(v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file") == \
        (400000, f"memory cgroup {v1}")
    v2 = write(tmp_path / "v2", {"memory.max": "2000000\n", "memory.current": "500000\n",
                                 "memory.stat": "anon 1\ninactive_file 0\n"})
    assert host_memory._room(v2, "memory.max", "memory.current", "inactive_file")[0] == 1500000
    unlimited = write(tmp_path / "none", {"memory.max": "max\n", "memory.current": "5\n", "memory.stat": ""})
    assert host_memory._room(unlimited, "memory.max", "memory.current", "inactive_file") is None


def test_this_process_sees_some_free_memory_and_says_where_it_comes_from():
    free, source = host_memory.free_bytes()
    assert free > 0 and (source == "MemAvailable" or source.startswith("memory cgroup /sys/fs/cgroup"))
