"""The documents agree with themselves, with each other and with the code, checked on every run
(not a one-time read): each bilingual document's English and 中文 halves carry the same figures
and knob names, every path, test name and section a document points to exists, and the knobs the
code reads are the knobs the guide lists. No torch: it runs on one stack."""

import re
from collections import Counter

import pytest

from support.paths import REPO

BILINGUAL = ["README.md", "docs/fix-for-mova.md", "docs/root-cause.md", "docs/reproduction.md"]
# a figure: 1,144 or 28.4 (not a version such as 2.8.0, not part of a name)
FIGURE = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?!\.?\w)")
KNOB = re.compile(r"CKPTDOCTOR_[A-Z_]+")
OURS = re.compile(r"`((?:docs|tests|benchmarks|patches|scripts|src)/[^`\s]*)`")
NOT_OURS = ("scripts/training_scripts/",  # MOVA's own paths, named in our documents
            "tests/test_state_checkpointing.py", "tests/test_accelerator.py")  # Accelerate's, fetched at run time
TEST_NAME = re.compile(r"`(test_[a-z0-9_]+?)(\.\.\.|\[[^\]]*\])?`")
SECTION = re.compile(r"`(docs/[\w-]+\.md)`(?:'s)?,? \"([^\"]+)\"")
SEE_SECTION = re.compile(r"\((?:see|见) \"([^\"]+)\"")


def halves(name: str) -> tuple[str, str]:
    """(English, 中文): the 中文 half starts at the first heading with Chinese in it."""
    text = (REPO / name).read_text()
    start = re.search(r"^#{1,2} .*[\u4e00-\u9fff]", text, re.M)
    assert start, f"{name} has no 中文 half"
    return text[:start.start()], text[start.start():]


def prose(text: str) -> str:
    """Without tables, code blocks and inline code: the part a translation must carry whole."""
    kept, code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and not line.lstrip().startswith("|"):
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def headings(name: str) -> list[str]:
    return [h.strip() for h in re.findall(r"^#+ (.*)$", (REPO / name).read_text(), re.M)]


@pytest.mark.parametrize("name", BILINGUAL)
def test_every_figure_in_the_chinese_half_is_one_the_english_half_gives(name):
    """Counted: a figure the 中文 half gives more often than the English one is a stale copy."""
    english, chinese = halves(name)
    assert sorted((Counter(FIGURE.findall(chinese)) - Counter(FIGURE.findall(english))).elements()) == []


@pytest.mark.parametrize("name", BILINGUAL)
def test_every_figure_in_the_english_prose_is_carried_into_the_chinese_half(name):
    english, chinese = halves(name)
    assert sorted(set(FIGURE.findall(prose(english))) - set(FIGURE.findall(chinese))) == []


@pytest.mark.parametrize("name", BILINGUAL)
def test_both_halves_name_the_same_knobs(name):
    english, chinese = halves(name)
    assert sorted(set(KNOB.findall(english))) == sorted(set(KNOB.findall(chinese)))


def test_the_guide_lists_every_knob_the_code_reads_in_both_languages():
    from ckptdoctor.fix.settings import ENV

    english, chinese = halves("docs/fix-for-mova.md")
    for variable in [*ENV.values(), "CKPTDOCTOR_ALLOW_UNCHECKED_VERSIONS"]:
        assert f"| `{variable}` |" in english and f"| `{variable}` |" in chinese, variable


@pytest.mark.parametrize("name", BILINGUAL)
def test_every_path_a_document_names_exists(name):
    missing = []
    for path in OURS.findall((REPO / name).read_text()):
        if path.startswith(NOT_OURS):
            continue
        found = list(REPO.glob(path.rstrip("/"))) if "*" in path else [REPO / path.rstrip("/")]
        if not found or not all(p.exists() for p in found):
            missing.append(path)
    assert missing == []


@pytest.mark.parametrize("name", BILINGUAL)
def test_every_test_a_document_names_exists(name):
    """By its whole name, or a prefix written with `...` after it."""
    defined = set(re.findall(r"^def (test_\w+)", "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py")),
                             re.M))
    named = TEST_NAME.findall((REPO / name).read_text())
    missing = [t for t, more in named if not (t in defined or (more == "..." and any(d.startswith(t) for d in defined)))]
    assert missing == []


@pytest.mark.parametrize("name", BILINGUAL)
def test_every_section_a_document_points_to_exists(name):
    text = (REPO / name).read_text()
    pointers = [(doc, title) for doc, title in SECTION.findall(text)] + [(name, t) for t in SEE_SECTION.findall(text)]
    missing = [(doc, title) for doc, title in pointers
               if not any(title.lower().strip("`") in h.lower() for h in headings(doc))]
    assert missing == []


def test_the_readmes_plain_dcp_snippet_saves_and_loads_back_as_written(tmp_path):
    """The README's 'planner alone' code, run as written (one process: dcp.save without a group),
    loading into zeros to see the values come back."""
    import torch

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Plain DCP, no Accelerate"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(3)}
    scope = {"state_dict": state, "path": str(tmp_path / "ckpt")}
    exec(code.replace("dcp.load(", "state_dict = {'w': torch.zeros(2, 3), 'step': torch.tensor(0)}\ndcp.load("),
         scope | {"torch": torch})
    assert torch.equal(scope["state_dict"]["w"], state["w"]) and scope["state_dict"]["step"].item() == 3
    assert (tmp_path / "ckpt" / ".metadata").is_file() and (tmp_path / "ckpt" / ".ckptdoctor-index").is_file()
