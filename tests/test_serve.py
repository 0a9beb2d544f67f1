"""serve.yml on the controller tier: the drafter's acceptance read from vLLM's Prometheus counters, the health
question asked of a server (a stand-in for vLLM's OpenAI-compatible API, on 127.0.0.1), the unit the role writes
(rendered by the role's own task, checked by systemd-analyze), and bad input refused before anything is touched.

The real server in a real CT is the lxc scenario's case (molecule/lxc/tasks/serve.yml).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.local_inventory import local_training_inventory
from test_role_inputs import inventory, run  # noqa: F401 (inventory: a fixture)
from test_train_control import run_module

from module_utils import serve_status

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
MODEL = "/var/lib/eagle3/tiny-target"

# What vLLM's /metrics says after 1658 drafts of 3 tokens (prometheus_client's exposition: a counter's samples end in
# _total, and each has a _created sample holding a timestamp, which must never count).
METRICS = "\n".join(
    [
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="{MODEL}"}} 1658.0',
        f'vllm:spec_decode_num_drafts_created{{engine="0",model_name="{MODEL}"}} 1.7651e+09',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="{MODEL}"}} 4974.0',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{MODEL}"}} 2190.0',
        *(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{MODEL}",position="{p}"}} {n}'
            for p, n in enumerate((1180.0, 710.0, 300.0))
        ),
        f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0',
        "",
    ]
)


# ------------------------------------------------------------------------------------------------ the counters
def test_the_acceptance_length_is_one_plus_accepted_per_draft_from_the_counters():
    acc = serve_status.acceptance(serve_status.parse_prometheus(METRICS))
    # 2.3209, not skewed by the _created samples
    assert acc["tau"] == pytest.approx(1 + 2190 / 1658, abs=1e-4)
    assert (acc["drafts"], acc["draft_tokens"], acc["accepted"]) == (1658, 4974, 2190)
    assert acc["per_position"] == pytest.approx([1180 / 1658, 710 / 1658, 300 / 1658], abs=1e-4)
    assert serve_status.acceptance_line(acc).startswith("acceptance length 2.3209 (1658 drafts, 2190 of 4974")


def test_two_engines_are_summed_and_a_server_without_a_drafter_says_so():
    two = METRICS + METRICS.replace('engine="0"', 'engine="1"')
    acc = serve_status.acceptance(serve_status.parse_prometheus(two))
    assert acc["drafts"] == 2 * 1658 and acc["tau"] == pytest.approx(1 + 2190 / 1658, abs=1e-4)
    plain = serve_status.acceptance(serve_status.parse_prometheus('vllm:num_requests_running{engine="0"} 0.0\n'))
    assert not plain["speculative"] and plain["tau"] is None
    assert "without a drafter" in serve_status.acceptance_line(plain)


# ------------------------------------------------------------------------------------------------ the drafter
def write_export(folder: Path, config: dict | str | None, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return folder


EAGLE3 = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"]}


@pytest.mark.parametrize(
    ("config", "weights", "problem"),
    [
        (EAGLE3, True, None),
        ({"architectures": ["Eagle3DeepseekV2ForCausalLM"]}, True, None),  # the MLA layout
        ({"architectures": ["Eagle3DeepseekV3ForCausalLM"]}, True, None),  # an older MLA export
        (None, True, "has no config.json, so it is no export"),
        ("{not json", True, "has a config.json that cannot be read as JSON"),
        ({"architectures": ["LlamaForCausalLM"]}, True, "something else than an EAGLE-3"),
        (EAGLE3, False, "has no model.safetensors"),
    ],
)
def test_a_folder_is_served_as_a_drafter_only_when_it_is_an_export(tmp_path, config, weights, problem):
    folder = write_export(tmp_path / "export", config, weights)
    found = serve_status.export_problem(str(folder))
    assert found is None if problem is None else problem in found, found


# ------------------------------------------------------------------------------------------------ the server
class StandInVllm(BaseHTTPRequestHandler):
    """vLLM's OpenAI-compatible API as serve_job asks it: /v1/models, /v1/completions, /metrics. `mode` (class
    attribute, set by the test): "up", "loading" (503 everywhere, as while the engine starts) or "empty"."""

    mode = "up"
    asked: list = []

    def _reply(self, code: int, body: str, kind: str = "application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.asked.append(("GET", self.path))
        if self.mode == "loading":
            return self._reply(503, '{"error": "loading"}')
        if self.path == "/v1/models":
            return self._reply(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        if self.path == "/metrics":
            return self._reply(200, METRICS, "text/plain; version=0.0.4")
        return self._reply(404, "{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.asked.append(("POST", self.path, body))
        if self.path != "/v1/completions" or body.get("model") != MODEL:
            return self._reply(404, json.dumps({"error": f"model {body.get('model')} does not exist"}))
        text, tokens = ("", 0) if self.mode == "empty" else (" Paris, and the", body["max_tokens"])
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
        return self._reply(
            200,
            json.dumps(
                {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [choice], "usage": usage}
            ),
        )

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    StandInVllm.mode, StandInVllm.asked = "up", []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandInVllm)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def test_a_server_is_healthy_when_it_answers_a_completion_of_its_model(server):
    base = f"http://127.0.0.1:{server.server_port}"
    answer = serve_status.ask_completion(base, timeout=5)
    assert answer == {
        "ok": True,
        "model": MODEL,
        "text": " Paris, and the",
        "tokens": serve_status.HEALTH_TOKENS,
    }
    posted = next(a for a in StandInVllm.asked if a[0] == "POST")[2]
    assert posted["model"] == MODEL and posted["temperature"] == 0 and posted["ignore_eos"] is True
    assert serve_status.read_metrics(base, timeout=5)["drafts"] == 1658


@pytest.mark.parametrize(("mode", "error"), [("loading", "HTTP 503"), ("empty", "the completion came back empty")])
def test_a_server_that_is_loading_or_answers_nothing_is_not_healthy(server, mode, error):
    StandInVllm.mode = mode
    answer = serve_status.ask_completion(f"http://127.0.0.1:{server.server_port}", timeout=5)
    assert not answer["ok"] and error in answer["error"], answer


def test_nothing_listening_is_not_healthy_and_says_why():
    probe = ThreadingHTTPServer(("127.0.0.1", 0), StandInVllm)
    port = probe.server_port
    probe.server_close()  # a port nothing listens on any more
    answer = serve_status.ask_completion(f"http://127.0.0.1:{port}", timeout=5)
    assert not answer["ok"] and "refused" in answer["error"].lower()
    assert serve_status.read_metrics(f"http://127.0.0.1:{port}", timeout=5) is None


def unit_shows(fake_systemd: Path, port: int, **props) -> None:
    execstart = (
        "{ path=/opt/eagle3-venv/bin/python ; argv[]=/opt/eagle3-venv/bin/python -m "
        f"vllm.entrypoints.openai.api_server --model {MODEL} --host 127.0.0.1 --port {port} ; ignore_errors=no }}"
    )
    shown = {
        "LoadState": "loaded",
        "ActiveState": "active",
        "SubState": "running",
        "Result": "success",
        "ExecMainStatus": "0",
        "NRestarts": "0",
        "ExecStart": execstart,
        **props,
    }
    (fake_systemd / "show").write_text("".join(f"{k}={v}\n" for k, v in shown.items()))


def test_the_module_finds_the_address_in_the_unit_and_reports_health_and_acceptance(fake_systemd, server, capsys):
    unit_shows(fake_systemd, server.server_port)
    result, rc = run_module("serve_job", {"answer": True}, capsys)
    assert rc == 0 and result["verdict"] == "healthy" and not result["changed"]
    assert result["url"] == f"http://127.0.0.1:{server.server_port}"
    assert result["acceptance"]["tau"] == pytest.approx(2.3209, abs=1e-4)
    assert "answers at" in result["summary"] and "acceptance length 2.3209" in result["summary"]


def test_status_asks_no_completion_so_the_figures_it_shows_are_the_users(fake_systemd, server, capsys):
    unit_shows(fake_systemd, server.server_port)
    result, rc = run_module("serve_job", {}, capsys)
    assert rc == 0 and result["verdict"] == "running" and result["answer"] is None
    assert not [a for a in StandInVllm.asked if a[0] == "POST"]
    assert result["summary"].startswith(f"eagle3-serve.service: active at http://127.0.0.1:{server.server_port}; ")


def test_a_unit_that_crashed_and_waits_for_its_restart_is_failed_with_its_last_line(fake_systemd, server, capsys):
    unit_shows(
        fake_systemd,
        server.server_port,
        ActiveState="activating",
        SubState="auto-restart",
        Result="exit-code",
        ExecMainStatus="1",
    )
    result, rc = run_module("serve_job", {"answer": True}, capsys)
    assert rc == 0 and result["verdict"] == "failed" and result["answer"] is None  # a restarting unit is not asked
    assert result["summary"] == "eagle3-serve.service: failed (exit-code, exit status 1, restarting): log line 40"


# ------------------------------------------------------------------------------------------------ the unit
RENDER = """\
- name: The unit as roles/eagle3_serve writes it
  hosts: all
  gather_facts: false
  tasks:
    - name: The GPU jobs' identity
      ansible.builtin.include_role:
        name: gpu_cleanup
        tasks_from: identity.yml
        public: true
    - name: The role's unit task, with its defaults
      ansible.builtin.include_role:
        name: eagle3_serve
        tasks_from: unit.yml
      vars:
        eagle3_serve__unit_file: "{{ out }}/defaults/eagle3-serve.service"
    - name: The role's unit task, for a GPU host with a given export
      ansible.builtin.include_role:
        name: eagle3_serve
        tasks_from: unit.yml
      vars:
        eagle3_serve__unit_file: "{{ out }}/gpu/eagle3-serve.service"
        eagle3_serve_drafter: /srv/drafters/kimi-eagle3
        eagle3_serve_host: 10.0.0.5
        eagle3_serve_port: 8443
        eagle3_serve_served_model_name: kimi-k2.5
        eagle3_serve_enforce_eager: true
        eagle3_serve_max_model_len: 32768
        eagle3_serve_kv_cache_mib: 40960
        eagle3_serve_args: [--tensor-parallel-size, 8, --gpu-memory-utilization, "0.92"]
        eagle3_serve_env: {CUDA_VISIBLE_DEVICES: "0,1,2,3,4,5,6,7"}
"""


def exec_start(unit: str) -> tuple[list[str], dict[str, str]]:
    """ExecStart's argv as systemd passes it, and each --option's value."""
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    argv = [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line.removeprefix("ExecStart="))]
    opts = {w: argv[i + 1] for i, w in enumerate(argv[:-1]) if w.startswith("--") and not argv[i + 1].startswith("--")}
    return argv, opts


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("units")
    for sub in ("defaults", "gpu"):
        (out / sub).mkdir()
    venv = out / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)  # systemd-analyze checks that ExecStart's program exists
    play = out / "render.yml"
    play.write_text(RENDER)
    inv = local_training_inventory(
        out / "hosts.yml", eagle3_serve_target="/var/lib/eagle3/tiny-target", eagle3_serve_venv=str(out / "venv")
    )
    render_play(play, str(inv), out)
    return out


def render_play(play: Path, hosts: str, out: Path) -> None:
    """Run a playbook that renders role templates into `out` (its variable), failing with the play's output."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    proc = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", hosts, str(play), "-e", f"out={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.slow
def test_the_unit_serves_the_target_with_the_exported_drafter_on_loopback(rendered):
    unit = (rendered / "defaults" / "eagle3-serve.service").read_text()
    argv, opts = exec_start(unit)
    assert argv[:3] == [f"{rendered}/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert opts["--model"] == "/var/lib/eagle3/tiny-target"
    assert json.loads(opts["--speculative-config"]) == {
        "method": "eagle3",
        "model": "/var/lib/eagle3/serve/drafter",
        "num_speculative_tokens": 3,
    }
    assert (opts["--host"], opts["--port"], opts["--dtype"]) == ("127.0.0.1", "8000", "bfloat16")
    assert "--enforce-eager" not in argv and "--served-model-name" not in argv
    assert "--kv-cache-memory-bytes" not in argv  # vLLM sizes it (on a GPU, from --gpu-memory-utilization)
    # One of the project's GPU jobs: its mark, the clean-up's marker on every process, never beside the others,
    # and a stop that reaches the engine core (a process of its own) too.
    assert unit.splitlines()[1].startswith("# eagle3-pve:")
    assert '"EAGLE3_JOB=eagle3-train"' in next(x for x in unit.splitlines() if x.startswith("Environment="))
    assert "Conflicts=eagle3-train.service eagle3-datagen.service\n" in unit
    assert "KillMode=control-group\n" in unit and "Restart=on-failure\n" in unit


@pytest.mark.slow
def test_the_unit_takes_the_inventorys_address_a_given_export_and_more_vllm_arguments(rendered):
    unit = (rendered / "gpu" / "eagle3-serve.service").read_text()
    argv, opts = exec_start(unit)
    assert json.loads(opts["--speculative-config"])["model"] == "/srv/drafters/kimi-eagle3"
    assert (opts["--host"], opts["--port"]) == ("10.0.0.5", "8443")
    assert (opts["--served-model-name"], opts["--max-model-len"]) == ("kimi-k2.5", "32768")
    assert opts["--kv-cache-memory-bytes"] == str(40 << 30)
    assert "--enforce-eager" in argv
    env = shlex.split(next(x for x in unit.splitlines() if x.startswith("Environment=")).removeprefix("Environment="))
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in env and "EAGLE3_JOB=eagle3-train" in env
    assert argv[-4:] == ["--tensor-parallel-size", "8", "--gpu-memory-utilization", "0.92"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("case", ["defaults", "gpu"])
def test_systemd_reads_the_unit_without_a_complaint(rendered, case):
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(rendered / case / "eagle3-serve.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    complaints = [line for line in proc.stderr.splitlines() if "eagle3-serve.service" in line]
    assert proc.returncode == 0 and not complaints, proc.stderr


# ------------------------------------------------------------------------------------------------ bad input
BAD_SERVE_INPUTS = {
    "eagle3_serve_port": (
        "70000",
        "eagle3_serve_port=70000 is out of range; allowed: a whole number >= 1 and <= 65535",
    ),
    "eagle3_serve_host": ("127.0.0.256", "eagle3_serve_host=127.0.0.256 is not an IP address; allowed: an IP address"),
    "eagle3_serve_drafter": ("exports/kimi", "eagle3_serve_drafter=exports/kimi is not an absolute path"),
    "eagle3_serve_export_dir": ("/var/lib", "eagle3_serve_export_dir=/var/lib is a system folder"),
    "eagle3_serve_args": (
        ["--port", "9000"],
        "eagle3_serve_args[0]=--port sets what the role sets itself; allowed: "
        "any other argument (for --port, set eagle3_serve_port)",
    ),
    "eagle3_serve_served_model_name": ("my model", "eagle3_serve_served_model_name=my model has the wrong form"),
    "eagle3_serve_num_speculative_tokens": ("0", "eagle3_serve_num_speculative_tokens=0 is out of range"),
    "eagle3_serve_enforce_eager": ("maybe", "eagle3_serve_enforce_eager=maybe is not a boolean"),
    "eagle3_serve_env": ({"EAGLE3_JOB": "decoy"}, "eagle3_serve_env has the key EAGLE3_JOB, which is set by the role"),
    "eagle3_serve_prot": (
        "8000",
        "eagle3_serve_prot=8000 is not a variable of the eagle3_serve role; did you mean eagle3_serve_port?",
    ),
}


@pytest.mark.slow
def test_serve_names_every_bad_variable_before_touching_the_ct(inventory, tmp_path):  # noqa: F811
    proc = run("serve.yml", inventory, {name: value for name, (value, _) in BAD_SERVE_INPUTS.items()})
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    missing = [message for _, message in BAD_SERVE_INPUTS.values() if message not in out]
    assert not missing, f"not reported: {missing}\n{proc.stdout[-4000:]}"
    assert out.count("Nothing was changed") == 1 and "is stopped" not in out  # the CT was never asked about
    assert not any((tmp_path / "lxc").iterdir())


@pytest.mark.slow
def test_serve_refuses_a_drafter_that_is_no_export_and_what_else_cannot_work_changing_nothing(tmp_path):
    """On this machine in check mode, with every path under tmp_path: each problem of the CT's side named at once."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)  # a Python without vLLM
    not_an_export = write_export(tmp_path / "drafter", {"architectures": ["LlamaForCausalLM"]})
    inv = local_training_inventory(
        tmp_path / "hosts.yml",
        eagle3_serve_target=f"{tmp_path}/target",
        eagle3_serve_venv=str(tmp_path / "venv"),
        eagle3_serve_drafter=str(not_an_export),
        eagle3_serve_export_dir=f"{tmp_path}/export",
        run_lock_path=f"{tmp_path}/lock",
    )
    proc = run("serve.yml", inv, {"eagle3_serve__unit_file": f"{tmp_path}/eagle3-serve.service"}, "--check")
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert f"eagle3_serve_drafter={not_an_export} has a config.json of something else than an EAGLE-3 drafter" in out
    assert f"eagle3_serve_venv={tmp_path}/venv has no vLLM" in out
    assert f"eagle3_serve_target={tmp_path}/target holds no model (no config.json)" in out
    assert re.search(r"Nothing was changed\.", out)
    assert not (tmp_path / "eagle3-serve.service").exists() and not (tmp_path / "export").exists()
