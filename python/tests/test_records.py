"""The records' check (benches/records.py, which CI runs on the tree): it passes on the tree as
committed, and fails where a figure the docs quote is in no record, where a run they name is not
recorded, and where a table row is malformed (run on a copy of the tree)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(root):
    return subprocess.run([sys.executable, os.path.join(root, "benches", "records.py"), "check"], capture_output=True, text=True)


def _fails_saying(tree, message):
    """The check fails on ``tree`` and says ``message``."""
    r = _check(str(tree))
    assert r.returncode == 1 and message in r.stdout, r.stdout


@pytest.fixture
def tree(tmp_path):
    """README.md, docs/, benches/NOTES.md, benches/records.py and benches/results/ copied."""
    for name in ("README.md",):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
    (tmp_path / "benches").mkdir()
    for name in ("NOTES.md", "records.py"):
        shutil.copy(os.path.join(ROOT, "benches", name), tmp_path / "benches" / name)
    shutil.copytree(os.path.join(ROOT, "benches", "results"), tmp_path / "benches" / "results")
    return tmp_path


def test_the_tree_passes(tree):
    r = _check(str(tree))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 problems" in r.stdout


def test_a_figure_in_no_record_fails(tree):
    readme = tree / "README.md"
    text = readme.read_text()
    assert "4.30 ms" in text
    # Five decimals: no record holds it (as ms or as us) by chance, as records grow.
    readme.write_text(text.replace("4.30 ms", "4.97531 ms", 1))
    _fails_saying(tree, "the figure 4.97531 ms is in no record")


def test_a_run_not_recorded_fails(tree):
    notes = tree / "benches" / "NOTES.md"
    notes.write_text(notes.read_text() + "\nSee run 2026-12-01-h200/0000000-nowhere.\n")
    _fails_saying(tree, "run 2026-12-01-h200/0000000-nowhere is not in the records")


def test_a_row_in_the_wrong_table_fails(tree):
    tests = tree / "benches" / "results" / "tests.jsonl"
    first = tests.read_text().splitlines()[0]
    with open(tree / "benches" / "results" / "bench.jsonl", "a") as f:
        f.write(first + "\n")
    _fails_saying(tree, "belongs in tests.jsonl")


def test_a_figure_is_looked_for_in_the_runs_its_paragraph_names(tree):
    # 4.30 ms is in a bench record, not in the step-host run of 740b056: cited beside that run,
    # it is in no record of its paragraph.
    doc = tree / "docs" / "benchmarks.md"
    doc.write_text(doc.read_text() + "\nThe norm took 4.30 ms at 740b056.\n")
    _fails_saying(tree, "the figure 4.30 ms is in no record (the runs of 740b056")
