"""datagen.yml's engine: the unit roles/eagle3_datagen writes runs `eagle3 generate` in transformers by default and
with `--engine vllm --vllm-args JSON` when asked (training/tests/test_generate_vllm.py holds what that writes);
and generate's own command line takes exactly those words."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_serve import exec_start, render_play

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
RENDER = """\
- name: The datagen unit as roles/eagle3_datagen writes it
  hosts: localhost
  connection: local
  gather_facts: false
  vars_files: [{root}/roles/eagle3_datagen/defaults/main.yml]
  vars:
    eagle3_datagen_target: /var/lib/eagle3/tiny-target
    eagle3_datagen_data: /var/lib/eagle3/chat.jsonl
    ansible_python_interpreter: "{{{{ ansible_playbook_python }}}}"
  tasks:
    - name: With the defaults
      ansible.builtin.template:
        src: {root}/roles/eagle3_datagen/templates/eagle3-datagen.service.j2
        dest: "{{{{ out }}}}/transformers.service"
        mode: "0644"
    - name: Through vLLM, tensor parallel
      ansible.builtin.template:
        src: {root}/roles/eagle3_datagen/templates/eagle3-datagen.service.j2
        dest: "{{{{ out }}}}/vllm.service"
        mode: "0644"
      vars:
        eagle3_datagen_engine: vllm
        eagle3_datagen_vllm_args: {{tensor_parallel_size: 8, dtype: bfloat16}}
"""


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    out = tmp_path_factory.mktemp("datagen-units")
    play = out / "render.yml"
    play.write_text(RENDER.format(root=ROOT))
    render_play(play, "localhost,", out)
    return {name: exec_start((out / f"{name}.service").read_text()) for name in ("transformers", "vllm")}


@pytest.mark.slow
def test_the_datagen_unit_runs_the_target_in_transformers_unless_told_vllm(units):
    argv, opts = units["transformers"]
    assert argv[1:4] == ["-m", "eagle3", "generate"] and "--engine" not in argv and "--vllm-args" not in argv
    argv, opts = units["vllm"]
    assert opts["--engine"] == "vllm"
    assert json.loads(opts["--vllm-args"]) == {"dtype": "bfloat16", "tensor_parallel_size": 8}


@pytest.mark.slow
def test_generate_parses_the_units_words(units):
    if str(ROOT / "training") not in sys.path:
        sys.path.insert(0, str(ROOT / "training"))
    from eagle3.generate import build_parser  # torch-free at import, like errors and launch

    argv, _ = units["vllm"]
    args = build_parser().parse_args(argv[4:])
    assert args.engine == "vllm" and json.loads(args.vllm_args)["tensor_parallel_size"] == 8
