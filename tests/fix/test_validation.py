"""The linear validation (fix/validation.py): the same verdict as torch's, in linear time."""

from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.planner import SavePlan

from ckptdoctor.fix.validation import validate_chunks

from support.metadata import metadata_of


@st.composite
def tensors_and_chunks(draw):
    """A tensor size and chunks that are usually a valid grid split, sometimes perturbed."""
    size = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    cuts = [sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else [] for n in size]
    cells = [[(a, b - a) for a, b in zip([0] + c, c + [n])] for c, n in zip(cuts, size)]
    chunks = [((), ())]
    for dim_cells in cells:
        chunks = [(o + (a,), s + (b,)) for o, s in chunks for a, b in dim_cells]
    chunks = [(list(o), list(s)) for o, s in chunks]
    for _ in range(draw(st.integers(0, 2))):  # perturb: move, resize, duplicate or drop a chunk
        i, d = draw(st.integers(0, len(chunks) - 1)), draw(st.integers(0, len(size) - 1))
        action = draw(st.sampled_from(["offset", "size", "dup", "drop"]))
        if action == "offset":
            chunks[i][0][d] += draw(st.integers(-2, 2))
        elif action == "size":
            chunks[i][1][d] += draw(st.integers(-2, 2))
        elif action == "dup":
            chunks.append(([*chunks[i][0]], [*chunks[i][1]]))
        elif len(chunks) > 1:
            chunks.pop(i)
    if draw(st.booleans()):  # empty chunks, as FSDP makes for dims smaller than the shard group
        chunks.append(([0] * len(size), [0] * len(size)))
    return size, [(tuple(o), tuple(s)) for o, s in chunks]


@settings(max_examples=400, deadline=None)
@given(tensors_and_chunks())
@example(([4, 2], [((0, 0), (4, 1)), ((0, 1), (2, 1)), ((2, 0), (0, 1)), ((2, 1), (2, 1))]))  # an empty chunk
def test_linear_validation_agrees_with_torch(case):                                       # inside another
    size, chunks = case
    if any(s < 0 for _, sizes in chunks for s in sizes):
        return  # torch.Size rejects negative sizes before any planner sees them
    md = metadata_of(size, chunks)
    verdict = _validate_global_plan([SavePlan([]), SavePlan([])], md)  # 2.8: bool; newer: list of errors;
    torch_says_valid = verdict is True or verdict == []                 # newer checks coverage with > 1 plan
    assert (validate_chunks(md) == []) == torch_says_valid


def test_validation_names_the_problem():
    md = metadata_of((4, 4), [((0, 0), (2, 4)), ((2, 0), (3, 4))])
    assert validate_chunks(md) == ["t: chunk (2, 0)+(3, 4) out of bounds of (4, 4)", "t: chunks cover 20 elements of 16"]
    md = metadata_of((4,), [((0,), (2,)), ((1,), (2,)), ((3,), (0,))])
    assert validate_chunks(md) == ["t: overlapping chunks"]
