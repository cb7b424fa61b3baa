"""What every benchmark record of benches/torch starts with (date, device, torch, commit, the
command that made it), how it is written (one JSON file, the script's first argument), the
arguments every such script takes, and how a row is printed as it is measured."""
import argparse
import json
import os
import sys
import time

import torch


def header(commit: str, device: str) -> dict:
    """The record's head: today's date (UTC), ``device`` ("cuda": the GPU's name), torch's
    version, ``commit`` and this process's command line."""
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
        "torch": torch.__version__,
        "commit": commit,
        "command": "python3 " + os.path.relpath(sys.argv[0]) + " " + " ".join(sys.argv[1:]),
    }


def write(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's arguments: ``out`` (the record), ``--commit`` and ``--cpu`` (a smoke test on the
    CPU); the script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--commit", default="")
    ap.add_argument("--cpu", action="store_true")
    return ap


def show(row: dict, digits: int = 1) -> None:
    """Prints a row as ``key=value`` pairs, floats to ``digits`` decimals."""
    print(" ".join(f"{k}={v:.{digits}f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
