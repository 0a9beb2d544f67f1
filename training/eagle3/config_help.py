"""The config declaration (eagle3.config) rendered for people: `eagle3 train --help` and the key table of
training/README.md (a test holds the README to it).

    python -m eagle3.config_help                      print the key table (Markdown)
    python -m eagle3.config_help --readme README.md   rewrite the table between the README's markers
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle3.config import REQUIRED, SPECS, format_default
from eagle3.errors import ConfigError
from eagle3.files import atomic_write_text

TRAIN_USAGE = """\
usage: python -m eagle3 train --config FILE [--KEY VALUE ...]

Train a drafter, or resume it from the newest complete checkpoint in run_dir.
Every config key below can be set in the --config file (a flat YAML or JSON mapping) and on the command
line, where it wins: --max-seq-len 16384, --max_seq_len=16384; a bool key alone (--fsdp) means true.
Exit status: 0 done or stopped cleanly, 1 crash, 2 bad config or data, 3 out of memory, 4 hang (the watchdog),
5 a run_dir that refuses writes.

options:
  -h, --help             show this help and exit
  --config FILE          the config file (flat YAML or JSON)

config keys (type, default, allowed values):"""


def render_help() -> str:
    """`eagle3 train --help`: every key with its type, default, allowed values or bound, and meaning."""
    lines = [TRAIN_USAGE]
    metavars = {"bool": "[BOOL]", "list": "A,B,..."}
    heads = {name: f"{s.flag} {metavars.get(s.type_name, s.type_name.upper())}" for name, s in SPECS.items()}
    width = max(map(len, heads.values())) + 2
    for name, spec in SPECS.items():
        facts = f"default {format_default(spec.default)}"
        if spec.bound is REQUIRED:
            facts = "required"
        elif spec.allowed:
            facts += f"; allowed: {spec.allowed}"
        lines.append(f"  {heads[name]:<{width}}{facts}")
        lines.append(f"      {spec.help}")
    return "\n".join(lines)


README_BEGIN = "<!-- config-keys:begin -->"
README_END = "<!-- config-keys:end -->"


def render_markdown() -> str:
    """The key table of training/README.md (between its config-keys markers)."""
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for spec in SPECS.values():
        allowed, meaning = (text.replace("|", "\\|") for text in (spec.allowed, spec.help))
        lines.append(f"| `{spec.name}` | {spec.type_name} | `{format_default(spec.default)}` | {allowed} | {meaning} |")
    return "\n".join(lines)


def readme_table(text: str) -> str:
    """The text between the config-keys markers of a README (stripped)."""
    try:
        start = text.index(README_BEGIN) + len(README_BEGIN)
        end = text.index(README_END, start)
    except ValueError as e:
        raise ConfigError(f"the README lacks the markers {README_BEGIN} ... {README_END}") from e
    return text[start:end].strip()


def update_readme(path: str | os.PathLike) -> bool:
    """Rewrite the key table between the markers of the README at `path`; True when it changed."""
    p = Path(path)
    text = p.read_text()
    old = readme_table(text)
    new = render_markdown()
    if old == new:
        return False
    start = text.index(README_BEGIN) + len(README_BEGIN)
    end = text.index(README_END, start)
    atomic_write_text(p, text[:start] + "\n" + new + "\n" + text[end:])
    return True


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--readme"] and len(sys.argv) == 3:
        print("updated" if update_readme(sys.argv[2]) else "unchanged", sys.argv[2])
    else:
        print(render_markdown())
