#!/usr/bin/env python3
"""gradclip's measurements as data: one JSON-lines table per family under benches/results/
(bench, tests, torch, optim, step, sharded, misc). A row is one file a run recorded:

  {"run": "2026-12-01-h200/740b056-step-host", "date": "2026-12-01", "gpu": "h200",
   "commit": "740b056", "file": "step-host.json", "gpus": "GPU 0: NVIDIA H200 (...)",
   "content": <the JSON record, parsed, or the text of a log>}

so every number a run wrote is kept with its run, commit and command (the JSON records name
their command; a log's first lines do). Charts are not data: the latest of each name stays in
benches/results/charts/.

  python3 benches/records.py add DIR RUN   the files of a fetched device run (the device tool's
                                           files_at, or any folder) appended as run RUN
                                           (<date>-<gpu>/<commit>-<what>); charts to charts/
  python3 benches/records.py show RUN [FILE]   a run's files, as recorded
  python3 benches/records.py runs          every run, with its files
  python3 benches/records.py check         what CI checks: every table row well formed, every
                                           run the docs and notes name recorded, every figure
                                           README.md and docs/ quote (a number with a unit of
                                           time, size or bandwidth) found in a record: of the
                                           commits its paragraph names, when it names any
  python3 benches/records.py fold          the old per-run folders into the tables (done once,
                                           at 2026-12-01; kept for folders fetched the old way)

Standard library only: CI runs `check` on a clean clone.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import sys
import tarfile
from typing import Dict, Iterable, Iterator, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benches", "results")
CHARTS = os.path.join(RESULTS, "charts")
CHART_EXT = (".svg", ".png")

# A file's family, by its name: the first pattern that matches.
FAMILIES: List[Tuple[str, str]] = [
    ("step", r"step-host|train-step|compiled-step"),
    ("sharded", r"sharded|train-fsdp|placements"),
    ("optim", r"optim|adam|train-gpt|variants/"),
    ("bench", r"^bench-|seed-500|criterion|cpu-clip|cpu-compare"),
    ("torch", r"torch-compare|torch-compile|host-profile"),
    ("tests", r"\.log$|tests"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "misc"


def table_path(fam: str) -> str:
    return os.path.join(RESULTS, f"{fam}.jsonl")


def read_rows() -> Iterator[dict]:
    for name in sorted(os.listdir(RESULTS)):
        if name.endswith(".jsonl"):
            with open(os.path.join(RESULTS, name)) as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        row = json.loads(line)
                        row["_table"], row["_line"] = name, n
                        yield row


def content_of(name: str, data: bytes):
    """A file's content as a row keeps it: JSON parsed, text as text."""
    text = data.decode("utf-8", errors="replace")
    if name.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def commit_of(run_name: str, files: Dict[str, bytes]) -> str:
    if "commit" in files:
        return files["commit"].decode().strip()
    m = re.match(r"([0-9a-f]{7})\b", run_name) or re.search(r"-([0-9a-f]{7})$", run_name)
    if m:
        return m.group(1)
    for name, data in files.items():
        if name.endswith(".json"):
            c = content_of(name, data)
            if isinstance(c, dict) and c.get("commit"):
                return str(c["commit"])
    return ""


def rows_of(run: str, files: Dict[str, bytes]) -> Tuple[List[dict], Dict[str, bytes]]:
    """The table rows of one run's files (archives opened: a member is a file of the run), and
    its charts."""
    date_gpu, run_name = run.split("/", 1)
    m = re.match(r"(\d{4}-\d{2}-\d{2})-(\w+)$", date_gpu)
    date, gpu = (m.group(1), m.group(2)) if m else (run_name[:10], date_gpu)
    commit = commit_of(run_name, files)
    gpus = files.get("gpus.txt", b"").decode().strip()
    rows, charts = [], {}
    expanded: Dict[str, bytes] = {}
    for name, data in files.items():
        if name.endswith(".tgz"):
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                for member in tar.getmembers():
                    if member.isfile():
                        expanded[f"{name}/{member.name}"] = tar.extractfile(member).read()
        else:
            expanded[name] = data
    for name in sorted(expanded):
        if name in ("commit", "gpus.txt"):
            continue
        if name.endswith(CHART_EXT):
            charts[name] = expanded[name]
            continue
        rows.append(dict(run=run, date=date, gpu=gpu, commit=commit, file=name, gpus=gpus, content=content_of(name, expanded[name])))
    return rows, charts


def append(rows: Iterable[dict]) -> int:
    by_family: Dict[str, List[dict]] = {}
    for row in rows:
        by_family.setdefault(family(row["file"]), []).append(row)
    for fam, rs in by_family.items():
        with open(table_path(fam), "a") as f:
            for r in rs:
                f.write(json.dumps(r, sort_keys=False) + "\n")
    return sum(len(rs) for rs in by_family.values())


def keep_charts(run: str, charts: Dict[str, bytes]) -> None:
    """The latest chart of each name (the run's date decides), in charts/ as <name> beside a
    note of its run."""
    os.makedirs(CHARTS, exist_ok=True)
    index_path = os.path.join(CHARTS, "index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else {}
    for name, data in charts.items():
        base = os.path.basename(name)
        if base in index and index[base] > run:
            continue
        with open(os.path.join(CHARTS, base), "wb") as f:
            f.write(data)
        index[base] = run
    with open(index_path, "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)


def read_folder(path: str) -> Dict[str, bytes]:
    files = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                files[os.path.relpath(full, path)] = f.read()
    return files


def file_run(run: str, files: Dict[str, bytes]) -> Tuple[int, int]:
    """One run's files into the tables and its charts into charts/: (files, charts) filed."""
    rows, charts = rows_of(run, files)
    n = append(rows)
    keep_charts(run, charts)
    return n, len(charts)


def cmd_add(args) -> None:
    if not re.match(r"(\d{4}-\d{2}-\d{2}-\w+|cpu)/[\w.-]+$", args.run):
        sys.exit(f"RUN must read <date>-<gpu>/<commit>-<what>, e.g. 2026-12-02-h200/abc1234-step-host; got {args.run!r}")
    if any(r["run"] == args.run for r in read_rows()):
        sys.exit(f"run {args.run} is recorded already")
    n, charts = file_run(args.run, read_folder(args.dir))
    print(f"{args.run}: {n} files recorded, {charts} charts")


def cmd_fold(_args) -> None:
    """Each legacy folder <date>-<gpu>/<run>/ (and cpu/<file>) into the tables, then removed."""
    folded = 0
    for date_gpu in sorted(os.listdir(RESULTS)):
        top = os.path.join(RESULTS, date_gpu)
        if not os.path.isdir(top) or date_gpu == "charts":
            continue
        if date_gpu == "cpu":
            for name in sorted(os.listdir(top)):
                run = "cpu/" + os.path.splitext(name)[0]
                with open(os.path.join(top, name), "rb") as f:
                    folded += file_run(run, {name: f.read()})[0]
        else:
            loose = {n: open(os.path.join(top, n), "rb").read() for n in sorted(os.listdir(top)) if os.path.isfile(os.path.join(top, n))}
            if loose:
                folded += file_run(f"{date_gpu}/_", loose)[0]
            for run_name in sorted(os.listdir(top)):
                path = os.path.join(top, run_name)
                if os.path.isdir(path):
                    folded += file_run(f"{date_gpu}/{run_name}", read_folder(path))[0]
        shutil.rmtree(top)
    print(f"{folded} files folded into the tables")


def cmd_show(args) -> None:
    found = False
    for r in read_rows():
        if r["run"] == args.run and (args.file is None or r["file"] == args.file):
            found = True
            c = r["content"]
            print(f"== {r['run']} {r['file']} (commit {r['commit']}, {r['_table']}:{r['_line']})")
            print(c if isinstance(c, str) else json.dumps(c, indent=1))
    if not found:
        sys.exit(f"no such run (or file): {args.run} {args.file or ''}")


def cmd_runs(_args) -> None:
    runs: Dict[str, List[str]] = {}
    for r in read_rows():
        runs.setdefault(r["run"], []).append(r["file"])
    for run, files in sorted(runs.items()):
        print(run, " ".join(files))


# --- check ----------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)")


def numbers_in(obj) -> Iterator[float]:
    """Every number a record holds (JSON numbers, and numbers in its text)."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, str):
        for m in NUMBER.finditer(obj):
            try:
                yield float(m.group(1).replace(",", ""))
            except ValueError:
                pass
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from numbers_in(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from numbers_in(v)


FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s*(ms|us|TB/s|GB/s|GB)\b")


def figures() -> Iterator[Tuple[str, int, str, str, frozenset]]:
    """(file, line, number, unit, commits) of every measured figure README.md and docs/*.md
    quote: each number with a unit of time, size or bandwidth (ratios, percentages and test
    counts are derived or counted, not measured), with the commits its paragraph names (its
    records are those runs')."""
    paths = ["README.md"] + ["docs/" + n for n in sorted(os.listdir(os.path.join(ROOT, "docs")))]
    for path in paths:
        lines = open(os.path.join(ROOT, path)).read().split("\n")
        start = 0
        for end in range(len(lines) + 1):
            if end < len(lines) and lines[end].strip():
                continue
            paragraph = lines[start:end]
            commits = frozenset(re.findall(r"\b([0-9a-f]{7})\b", "\n".join(paragraph)))
            for i, line in enumerate(paragraph, start + 1):
                for m in FIGURE.finditer(line):
                    yield path, i, m.group(1), m.group(2), commits
            start = end + 1


def matches(figure: str, unit: str, values: List[float]) -> bool:
    """Whether a record holds the figure at the precision it is written with (a time in ms also
    as us, the unit most records keep, and the other way round)."""
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    target = float(figure.replace(",", ""))
    tol = 0.5 * 10 ** (-decimals) + 1e-12
    scales = {"ms": (1.0, 1e3, 1e-3), "us": (1.0, 1e-3)}.get(unit, (1.0,))
    return any(abs(v - target * k) <= tol * k for k in scales for v in values)


def cited_runs() -> Iterator[Tuple[str, int, str]]:
    """(file, line, run) of every run the docs and notes name: as <date>-<gpu>/<name>, or, in
    the notes and the results index, as `<name>/` (the name of a run of the date above)."""
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benches", "NOTES.md"), os.path.join(RESULTS, "README.md")]
    paths += [os.path.join(ROOT, "docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))]
    for path in paths:
        for n, line in enumerate(open(path), 1):
            for m in re.finditer(r"(\d{4}-\d{2}-\d{2}-h200)/([0-9a-f]{7}[\w-]*|variants-\d)\b", line):
                yield os.path.relpath(path, ROOT), n, f"{m.group(1)}/{m.group(2)}"
            for m in re.finditer(r"`([0-9a-f]{7}(?:-[\w-]+)?)/`", line):
                yield os.path.relpath(path, ROOT), n, "*/" + m.group(1)


def cmd_check(_args) -> None:
    problems = []
    rows = list(read_rows())
    runs = {r["run"] for r in rows}
    for r in rows:
        missing = [k for k in ("run", "date", "gpu", "commit", "file", "content") if k not in r]
        if missing:
            problems.append(f"{r['_table']}:{r['_line']}: row without {missing}")
        elif family(r["file"]) + ".jsonl" != r["_table"]:
            problems.append(f"{r['_table']}:{r['_line']}: {r['file']} belongs in {family(r['file'])}.jsonl")
    names = {r.split("/", 1)[1] for r in runs}
    for path, n, run in cited_runs():
        if run not in runs and not (run.startswith("*/") and run[2:] in names):
            problems.append(f"{path}:{n}: run {run.lstrip('*/')} is not in the records")
    values = sorted(set(numbers_in([r["content"] for r in rows])))
    of_commit: Dict[str, List[dict]] = {}
    for r in rows:  # a run's commit, or the commit its name begins with
        for c in {r["commit"], r["run"].split("/", 1)[1][:7]}:
            of_commit.setdefault(c, []).append(r)
    cache: Dict[frozenset, List[float]] = {}
    quoted = list(figures())
    for path, n, fig, unit, commits in quoted:
        cited = frozenset(c for c in commits if c in of_commit)
        if cited and cited not in cache:
            cache[cited] = sorted(set(numbers_in([r["content"] for c in cited for r in of_commit[c]])))
        if not matches(fig, unit, cache[cited] if cited else values):
            where = f"the runs of {', '.join(sorted(cited))}, which its paragraph names" if cited else "any record"
            problems.append(f"{path}:{n}: the figure {fig} {unit} is in no record ({where})")
    leftovers = [d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d)) and d != "charts"]
    if leftovers:
        problems.append(f"per-run folders left in benches/results ({leftovers}): fold them (records.py fold)")
    for p in problems:
        print(p)
    print(f"{len(rows)} recorded files in {len(runs)} runs; {len(quoted)} quoted figures checked; {len(problems)} problems")
    sys.exit(1 if problems else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add")
    a.add_argument("dir")
    a.add_argument("run")
    sub.add_parser("fold")
    s = sub.add_parser("show")
    s.add_argument("run")
    s.add_argument("file", nargs="?")
    sub.add_parser("runs")
    sub.add_parser("check")
    args = ap.parse_args()
    {"add": cmd_add, "fold": cmd_fold, "show": cmd_show, "runs": cmd_runs, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    main()
