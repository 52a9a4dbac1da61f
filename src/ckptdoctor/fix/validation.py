"""torch's validation of a global plan (bounds, overlap, coverage), in time linear in the chunks.

torch's `_validate_global_plan` compares every pair of chunks of every tensor: quadratic in the
shard count (minutes at N = 2,816 on torch 2.8.0). The same three verdicts here: a chunk out of
bounds, chunks that do not cover the tensor exactly, overlapping chunks (torch's box test,
including an empty chunk strictly inside another); overlap found by sorting slabs (FSDP, HSDP) or
counting on the grid of the chunks' edges, pairwise only when the chunks form no grid. A chunk
list shared by several tensors of one size is checked once. tests/fix/test_planner.py checks the
verdicts against torch's on random chunkings.
"""

from __future__ import annotations

import bisect
import math

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata


MAX_GRID_CELLS_PER_CHUNK = 64  # beyond this the chunks do not form a grid: check pairs


def validate_chunks(metadata: Metadata) -> list[str]:
    """torch's three checks on every tensor (bounds, overlap, coverage); [] when valid.
    A chunk list shared by several tensors of one size is checked once."""
    problems, checked_lists = [], set()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata) or len(md.size) == 0:
            continue
        if (id(md.chunks), tuple(md.size)) in checked_lists:
            continue
        checked_lists.add((id(md.chunks), tuple(md.size)))
        problems += _validate_tensor(key, tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
    return problems


def _validate_tensor(key: str, size: tuple[int, ...], chunks: list[tuple[tuple, tuple]]) -> list[str]:
    problems = []
    for offsets, sizes in chunks:
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, size)):
            problems.append(f"{key}: chunk {offsets}+{sizes} out of bounds of {size}")
    volume = sum(math.prod(s) for _, s in chunks)
    if volume != math.prod(size):
        problems.append(f"{key}: chunks cover {volume} elements of {math.prod(size)}")
    if not problems and _overlap(chunks):
        problems.append(f"{key}: overlapping chunks")
    return problems


def _overlap(chunks: list[tuple[tuple, tuple]]) -> bool:
    """Whether two chunks overlap as torch's box test says: two non-empty chunks that share an
    element, found in time linear in the chunks when they form a grid (every FSDP/HSDP layout:
    count coverage on the grid of their edges); or an empty chunk that lies strictly inside a
    non-empty one (torch's test has no case for size 0; FSDP's empty chunks sit at a dim's end,
    which never counts)."""
    boxes = [(o, s) for o, s in chunks if all(s)]
    empties = {(o, s) for o, s in chunks if not all(s)}  # FSDP's are all alike: checked once
    if any(_overlap_pairwise([empty, box]) for empty in empties for box in boxes):
        return True
    if len(boxes) < 2:
        return False
    split = _single_split_dim(boxes)
    if split is not None:  # FSDP/HSDP: chunks are slabs along one dimension; sort and compare neighbours
        spans = sorted((o[split], o[split] + s[split]) for o, s in boxes)
        return any(start < previous_end for (_, previous_end), (start, _) in zip(spans, spans[1:]))
    edges = [sorted({o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d in range(len(boxes[0][0]))]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_GRID_CELLS_PER_CHUNK * len(boxes):
        return _overlap_pairwise(boxes)
    grid = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for offsets, sizes in boxes:
        index = tuple(slice(bisect.bisect_left(e, o), bisect.bisect_left(e, o + s))
                      for e, o, s in zip(edges, offsets, sizes))
        grid[index] += 1
    return bool((grid > 1).any())


def _single_split_dim(boxes) -> int | None:
    """The one dimension the chunks differ in, if all agree on every other (offset and size)."""
    first_offsets, first_sizes = boxes[0]
    differing = {d for o, s in boxes for d in range(len(o)) if o[d] != first_offsets[d] or s[d] != first_sizes[d]}
    return differing.pop() if len(differing) == 1 else (0 if not differing else None)


def _overlap_pairwise(boxes) -> bool:
    for i, (o0, s0) in enumerate(boxes):
        for o1, s1 in boxes[i + 1:]:
            if all(a < b + t and b < a + u for a, u, b, t in zip(o0, s0, o1, s1)):
                return True
    return False
