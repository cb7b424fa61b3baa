"""What every benchmark record of benches/torch starts with (date, device, torch, commit, the
command that made it), and how it is written: one JSON file, the script's first argument."""
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
