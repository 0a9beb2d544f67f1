#!/usr/bin/env python3
"""Where an eagle3-datagen job stands, as one JSON line (stdlib only; datagen.yml polls it).

    datagen_state.py OUT_DIR [UNIT]

finished: OUT_DIR/index.json exists (the dataset is complete: generate writes it last); active / result / status /
restarts: the unit's ActiveState, Result, ExecMainStatus and NRestarts; line: the job's newest progress line;
tail: its last log lines (shown when it failed).
"""

import json
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    unit = argv[2] if len(argv) > 2 else "eagle3-datagen.service"
    props = subprocess.run(
        ["systemctl", "show", unit, "-p", "ActiveState", "-p", "Result", "-p", "ExecMainStatus", "-p", "NRestarts",
         "-p", "ConditionResult"],
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    state = dict(line.split("=", 1) for line in props.splitlines() if "=" in line)
    log = subprocess.run(
        ["journalctl", "-u", unit, "-n", "200", "-o", "cat", "--no-pager"], capture_output=True, text=True
    ).stdout.splitlines()
    progress = [line for line in log if line.startswith(("generate:", "tiny-target:"))]
    print(json.dumps({
        "finished": (out / "index.json").is_file(),
        "active": state.get("ActiveState", ""),
        "result": state.get("Result", ""),
        "status": int(state.get("ExecMainStatus") or 0),
        "restarts": int(state.get("NRestarts") or 0),
        "line": progress[-1] if progress else "",
        "tail": log[-12:],
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
