"""The reporter's local lines, placed in a copy of MOVA's trainer five ways (lab only).

Their traceback sits 43 lines lower at `train()` (:509 vs :466) and 57 lower at the save call
(:572 vs :515): 43 local lines before `train()` and 14 between it and the save. Each placement
below is consistent with that; tests/mova/test_local_edits.py and benchmarks/local_edits.py run
both integration levels against each.
"""

from __future__ import annotations

# (the first line containing this, how many local lines go before it, at its indentation)
PLACEMENTS = {
    "43 at the top, 14 at the start of train()": [("import os, re", 43), ('"""Main training loop"""', 14)],
    "43 before _setup, 14 before the save_state call": [("def _setup(self):", 43),
                                                         ("self.accelerator.save_state(", 14)],
    "43 in _setup before the prepare, 14 in the train loop": [
        ("self.model, self.optimizer, self.train_dataloader, self.lr_scheduler = ", 43), ("batch = next(data_iter)", 14)],
    "43 before _build_lr_scheduler, 14 in _save_checkpoint after step_dir": [
        ("def _build_lr_scheduler(self):", 43), ("os.makedirs(step_dir", 14)],
    "43 right after the prepare, 14 at the start of train()": [
        ("if self.use_fsdp and hasattr(self, '_ignored_modules')", 43), ('"""Main training loop"""', 14)],
}


def with_local_lines(text: str, blocks) -> str:
    """`text` with each block of local lines (valid statements) inserted as PLACEMENTS says."""
    lines = text.splitlines(keepends=True)
    for where, count in blocks:
        at = next(i for i, line in enumerate(lines) if where in line)
        if where.startswith('"""'):
            at += 1  # after the docstring, at the body's indentation
        indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
        lines[at:at] = [f"{indent}local_line_{n} = {n}  # the reporter's own line\n" for n in range(count)]
    return "".join(lines)
