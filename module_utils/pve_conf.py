"""Raw `lxc.*` lines in a Proxmox CT config file (/etc/pve/lxc/<vmid>.conf), edited as text.

The PVE API cannot write them ("property is not defined in schema"), so the node-side module
pve_lxc_raw edits the file. A CT config is the current config, then one `[name]` section per
snapshot (and `[pve:pending]`); raw lines belong to the current config, so every edit happens
before the first section header. Standard library only: this runs on the PVE node.
"""

from __future__ import annotations

import re

SECTION = re.compile(r"^\[[^\]]+\]\s*$")
RAW_KEY = re.compile(r"^lxc(\.[A-Za-z0-9_-]+)+$")


class ConfError(ValueError):
    """A raw line that cannot be written; the message names the line and the fix."""


def parse_line(text):
    """(key, value) of a raw line written `key: value` or `key = value`.

    >>> parse_line('lxc.cgroup2.devices.allow: c 195:* rwm')
    ('lxc.cgroup2.devices.allow', 'c 195:* rwm')
    >>> parse_line('lxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind,optional,create=file')
    ('lxc.mount.entry', '/dev/nvidia0 dev/nvidia0 none bind,optional,create=file')
    """
    found = re.match(r"^\s*([^:=\s]+)\s*[:=]\s*(.*?)\s*$", str(text))
    if not found or not RAW_KEY.match(found.group(1)):
        raise ConfError(
            f"{text!r} is not a raw LXC line 'lxc.KEY: VALUE' (for example "
            "'lxc.cgroup2.devices.allow: c 195:* rwm'); PVE options such as devN go through pve_lxc"
        )
    if not found.group(2):
        raise ConfError(f"{text!r} has no value after the key")
    return found.group(1), found.group(2)


def format_line(key, value):
    """PVE's own spelling of a raw line.

    >>> format_line('lxc.hook.pre-start', '/usr/share/lxc/hooks/nvidia')
    'lxc.hook.pre-start: /usr/share/lxc/hooks/nvidia'
    """
    return f"{key}: {value}"


def cgroup_v1_keys(lines):
    """Keys among the lines that PVE 9 (cgroup v2 only) no longer honours.

    >>> cgroup_v1_keys(['lxc.cgroup.devices.allow: c 195:* rwm', 'lxc.cgroup2.devices.allow: c 195:* rwm'])
    ['lxc.cgroup.devices.allow']
    """
    return [key for key, _ in map(parse_line, lines) if key.startswith("lxc.cgroup.")]


def main_section_end(lines):
    """Index of the first section header (snapshot or pending), or len(lines) when there is none.

    >>> main_section_end(['arch: amd64', '', '[snap1]', 'arch: amd64'])
    2
    """
    for n, line in enumerate(lines):
        if SECTION.match(line):
            return n
    return len(lines)


def edit_raw_lines(text, lines, state="present", exclusive=False):
    """The config text with the raw lines present (or absent) in the current config.

    present: a line missing from the current config is added after its last lxc.* line (or at
    the end of the current config, before the blank line that precedes a section). With
    exclusive, other lines with the same keys are removed first, which replaces a value.
    absent: matching lines (same key and value) are removed. Snapshot sections are never touched.
    Returns the new text; equal to text when nothing needs to change.

    >>> conf = 'arch: amd64\\nlxc.mount.entry: /a a none bind\\n\\n[snap]\\nlxc.mount.entry: /a a none bind\\n'
    >>> print(edit_raw_lines(conf, ['lxc.mount.entry: /b b none bind']), end='')
    arch: amd64
    lxc.mount.entry: /a a none bind
    lxc.mount.entry: /b b none bind
    <BLANKLINE>
    [snap]
    lxc.mount.entry: /a a none bind
    >>> edit_raw_lines(conf, ['lxc.mount.entry: /a a none bind']) == conf
    True
    """
    if state not in ("present", "absent"):
        raise ConfError(f"state must be present or absent, not {state!r}")
    wanted = [parse_line(line) for line in lines]
    all_lines = text.splitlines()
    end = main_section_end(all_lines)
    head, tail = all_lines[:end], all_lines[end:]
    current = [(n, file_pair(line)) for n, line in enumerate(head) if is_raw(line)]

    drop = set()
    if state == "absent":
        drop = {n for n, pair in current if pair in wanted}
    elif exclusive:
        keys = {key for key, _ in wanted}
        drop = {n for n, pair in current if pair[0] in keys and pair not in wanted}
    kept = [line for n, line in enumerate(head) if n not in drop]

    if state == "present":
        have = {file_pair(line) for line in kept if is_raw(line)}
        missing = []
        for pair in wanted:
            if pair not in have and pair not in missing:
                missing.append(pair)
        if missing:
            at = insertion_point(kept)
            kept[at:at] = [format_line(*pair) for pair in missing]

    new_lines = kept + tail
    if new_lines == all_lines:
        return text
    return "\n".join(new_lines) + "\n"


def file_pair(line):
    """(key, value) of a raw line already in the file; never fails, so an odd line is kept as it is.

    >>> file_pair('lxc.apparmor.profile:unconfined'), file_pair('lxc.odd')
    (('lxc.apparmor.profile', 'unconfined'), ('lxc.odd', ''))
    """
    found = re.match(r"^\s*([^:=\s]+)\s*[:=]?\s*(.*?)\s*$", line)
    return found.group(1), found.group(2)


def is_raw(line):
    """True for an `lxc.*` line of the current config.

    >>> is_raw('lxc.apparmor.profile: unconfined'), is_raw('arch: amd64'), is_raw('# lxc.x: y')
    (True, False, False)
    """
    return line.lstrip().startswith("lxc.")


def insertion_point(head):
    """Where new raw lines go in the current config: after the last lxc.* line, else before the
    trailing blank lines (the separator PVE writes before a section).

    >>> insertion_point(['arch: amd64', 'lxc.a: 1', 'memory: 512', ''])
    2
    >>> insertion_point(['arch: amd64', 'memory: 512', '', ''])
    2
    """
    raw = [n for n, line in enumerate(head) if is_raw(line)]
    if raw:
        return raw[-1] + 1
    end = len(head)
    while end > 0 and not head[end - 1].strip():
        end -= 1
    return end


def raw_lines_of(text):
    """The (key, value) raw lines of the current config, in file order.

    >>> raw_lines_of('arch: amd64\\nlxc.a.b: 1\\n[snap]\\nlxc.c.d: 2\\n')
    [('lxc.a.b', '1')]
    """
    lines = text.splitlines()
    return [file_pair(line) for line in lines[: main_section_end(lines)] if is_raw(line)]
