"""The lab's save probe wraps the collectives the save will call: with torch_npu installed, the
functions torch_npu puts in place on import (it replaces gather_object), not the ones it replaces."""

import sys

import torch.distributed as dist

from ckptdoctor.repro.probes import SaveProbe

# A stand-in for torch_npu's import-time patch (no NPU build here): the real one assigns its own
# gather_object to torch.distributed when imported.
STAND_IN = '''
import torch.distributed as dist
def gather_object(*args, **kwargs):
    return "npu gather_object"
gather_object.npu = True
dist.gather_object = gather_object
'''


def test_with_torch_npu_installed_the_probe_times_its_gather_object(tmp_path, monkeypatch):
    (tmp_path / "torch_npu.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(dist, "gather_object", dist.gather_object)  # restored after the test
    probe = SaveProbe(rank=0).install(time_collectives=True)
    try:
        assert dist.gather_object() == "npu gather_object"  # the wrapper calls torch_npu's function
        assert getattr(probe._originals[(dist, "gather_object")], "npu", False)
        assert [c.name for c in probe.calls] == ["gather_object"]  # and timed it
    finally:
        probe.uninstall()
