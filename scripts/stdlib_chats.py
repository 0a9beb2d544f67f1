#!/usr/bin/env python3
"""Conversations from the Python standard library's own sources, as chat JSONL (stdlib only; runs in the CT).

    stdlib_chats.py OUT.jsonl [--held-out] [--files N]

Each module of the stdlib (sorted by name) gives two conversations: the user shows 8 lines of it and the assistant
continues with the next 12. Every 16th module is held out: --held-out writes only those (prompts for evaluate),
the default only the others (training data), at most N modules either way. Text that exists on every Linux machine
with Python, in the `messages` layout `eagle3 generate` reads; the same machine always writes the same file.
"""

import argparse
import json
import sysconfig
from pathlib import Path

HELD_OUT_EVERY = 16


def conversations(held_out: bool, files: int) -> list[dict]:
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    paths = [p for i, p in enumerate(paths) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out][:files]
    out = []
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()
        for start in (0, 40):
            head, tail = "\n".join(lines[start : start + 8]), "\n".join(lines[start + 8 : start + 20])
            if head.strip() and tail.strip():
                out.append({"messages": [{"role": "user", "content": head}, {"role": "assistant", "content": tail}]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--held-out", action="store_true", help=f"only every {HELD_OUT_EVERY}th module (evaluate)")
    parser.add_argument("--files", type=int, default=10_000, help="at most this many modules")
    args = parser.parse_args()
    chats = conversations(args.held_out, args.files)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(c) + "\n" for c in chats))
    tmp.replace(args.out)
    print(f"{len(chats)} conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
