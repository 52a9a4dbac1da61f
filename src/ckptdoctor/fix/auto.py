"""Every Accelerator saves through the fix once it has prepared something: `import ckptdoctor.auto`.

For trainers where finding the statement that prepares the model is the hard part (a framework
builds the Accelerator, several entry points, generated code), one line anywhere before the
first `prepare` does what `ckptdoctor.install(accelerator)` after it does, for every Accelerator
of the process (Ascend users know the shape from `torch_npu.contrib.transfer_to_npu`):

    import ckptdoctor.auto          # e.g. first line of the training script, or via sitecustomize

How: `enable()` wraps `accelerate.Accelerator.prepare` (the class attribute: the fix's only
change to Accelerate's class, made only on this import, version-checked by `compat.check_versions`
and undone by `disable()`; the other change to Accelerate, selftest/accelerate_cpu.py, is for
CPU-only hosts). After each `prepare(...)` returns, `install(self)` runs (a second call on the
same Accelerator returns the first one's ScalableCheckpointing). Settings come from the
CKPTDOCTOR_* variables (settings.py); `save_root` from CKPTDOCTOR_SAVE_ROOT.

Limits: a `save_state` before the first `prepare` is stock's; a trainer that also makes its own
`ScalableCheckpointing` (the full patch) is refused with one line on every rank, as `install`
refuses it (one integration per Accelerator); saves of a subclass that overrides `prepare`
without calling Accelerate's are not routed.
"""

from __future__ import annotations

import functools

from .compat import check_versions

_original = None


def enable() -> None:
    """Route every Accelerator's save_state/load_state through the fix after its first prepare."""
    global _original
    import accelerate

    from .install import install

    check_versions("ckptdoctor.auto")
    if _original is not None:
        return
    original = accelerate.Accelerator.prepare

    @functools.wraps(original)
    def prepare(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        install(self)
        return result

    _original, accelerate.Accelerator.prepare = original, prepare


def disable() -> None:
    """Accelerate's own prepare again (Accelerators already routed stay routed)."""
    global _original
    import accelerate

    if _original is not None:
        accelerate.Accelerator.prepare, _original = _original, None


def enabled() -> bool:
    return _original is not None
