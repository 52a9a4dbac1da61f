"""`ckptdoctor docs`: the documents by a stable name, from a checkout (the installed wheel's copy
is tested in tests/packaging/test_wheel.py); every message that names one names a real one."""

import re
import subprocess

import pytest

from ckptdoctor.documents import DOCUMENTS, locate
from ckptdoctor.errors import CkptDoctorError

from support.commands import CKPTDOCTOR
from support.paths import REPO


def test_each_name_is_the_checkouts_file():
    assert {name: locate(name) for name in DOCUMENTS} == {name: REPO / path for name, path in DOCUMENTS.items()}


def test_an_unknown_name_is_one_line_naming_the_known_ones():
    with pytest.raises(CkptDoctorError, match=r"^no document named 'guide'; there are: readme, fix-for-mova, "
                                              r"root-cause, reproduction$"):
        locate("guide")


def test_the_cli_prints_a_document_and_lists_them_from_another_directory(tmp_path):
    shown = subprocess.run([CKPTDOCTOR, "docs", "root-cause"], cwd=tmp_path, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout == (REPO / "docs" / "root-cause.md").read_text()
    listed = subprocess.run([CKPTDOCTOR, "docs"], cwd=tmp_path, capture_output=True, text=True)
    assert [line.split()[0] for line in listed.stdout.splitlines()] == list(DOCUMENTS)


def test_every_message_names_a_document_that_exists():
    named = {m for path in (REPO / "src" / "ckptdoctor").rglob("*.py")
             for m in re.findall(r"ckptdoctor docs ([\w-]+)", path.read_text())}
    assert named and named <= set(DOCUMENTS) | {"NAME"}, named
