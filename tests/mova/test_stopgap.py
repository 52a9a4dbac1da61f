"""The guide's stopgap (a longer timeout on MOVA's default group), applied to MOVA's own
`mova/utils/adapter.py` exactly as the guide prints it, in both languages, and run: it must start
the group and give it the timeout. As first printed it failed on every rank (no `datetime` there)."""

import re
import subprocess
import sys

from ckptdoctor.repro.mova.rank import STANDINS

from support.paths import REPO

GUIDE = REPO / "docs" / "fix-for-mova.md"
STOCK_LINE = 'dist.init_process_group(backend="cpu:gloo,npu:hccl",init_method="env://")'


def printed(marker: str) -> tuple[str, str]:
    """(the import line, the call) the guide's stopgap bullet starting at `marker` prints."""
    text = GUIDE.read_text()
    bullet = text[text.index(marker):]
    bullet = bullet[:bullet.index("\n* ")]
    call = re.search(r'`(init_process_group\(backend="cpu:gloo,npu:hccl"[^`]*)`', bullet)[1]
    assert "`import datetime`" in bullet
    return "import datetime", call


def test_the_stopgap_reads_the_same_in_both_languages():
    assert printed("* **A longer timeout on MOVA's default group**") == printed("* **延长 MOVA 默认进程组的超时**")


def test_the_stopgap_as_printed_starts_movas_group_with_the_longer_timeout(extract, tmp_path):
    imported, call = printed("* **A longer timeout on MOVA's default group**")
    copy = extract.copy_to(tmp_path / "mova", integration=None)
    adapter = copy / "mova" / "utils" / "adapter.py"
    lines = adapter.read_text().splitlines(keepends=True)
    assert lines[36].strip() == STOCK_LINE  # line 37, as the guide says
    lines[36] = lines[36].replace(STOCK_LINE, f"dist.{call}")
    adapter.write_text(f"{imported}\n" + "".join(lines))  # "at the top"
    script = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
              "import torch, torch.distributed as dist\n"
              "from mova.utils.adapter import init_distributed_adapter, HAS_NPU\n"
              "init_distributed_adapter()\n"
              "backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device('cpu'))\n"
              "print(HAS_NPU, backend.options._timeout.total_seconds())\n")
    env = {"PATH": "/usr/bin:/bin", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script, str(STANDINS), str(copy)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["True", "10800.0"]  # the NPU branch (stand-in torch_npu), 3 h
