#!/usr/bin/env python3
"""Conversations from the Python standard library's own sources, as chat JSONL (stdlib only; runs in the CT).

    stdlib_chats.py OUT.jsonl [--every 15] [--files 12]

Every EVERY-th module of the stdlib (sorted by name, at most FILES of them) gives two conversations: the user shows
8 lines of it and the assistant continues with the next 12. Text that exists on every Linux machine with Python, in
the `messages` layout `eagle3 generate` reads; the same machine always writes the same file.
"""

import argparse
import json
import sysconfig
from pathlib import Path


def conversations(every: int, files: int) -> list[dict]:
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::every][:files]
    out = []
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()
        for start in (0, 40):
            head, tail = "\n".join(lines[start : start + 8]), "\n".join(lines[start + 8 : start + 20])
            if head.strip() and tail.strip():
                out.append(
                    {"messages": [{"role": "user", "content": head}, {"role": "assistant", "content": tail}]}
                )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--every", type=int, default=15, help="take every N-th stdlib module (default 15)")
    parser.add_argument("--files", type=int, default=12, help="at most this many modules (default 12)")
    args = parser.parse_args()
    chats = conversations(args.every, args.files)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(c) + "\n" for c in chats))
    tmp.replace(args.out)
    print(f"{len(chats)} conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
