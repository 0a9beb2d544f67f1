"""Where the vLLM server of serve.yml stands (standard library only): the unit, whether it answers a completion, and
the drafter's acceptance read from its Prometheus counters.

    eagle3-serve.service (vllm.entrypoints.openai.api_server --speculative-config {"method": "eagle3", ...})
      GET  /v1/models       the served model's id (the name a request must give)
      POST /v1/completions  healthy = it answers one with generated tokens
      GET  /metrics         vllm:spec_decode_num_drafts, ..._num_accepted_tokens, ..._num_accepted_tokens_per_pos
                            -> acceptance length tau = 1 + accepted / drafts (docs/facts.md#serving-with-vllm)

Pure functions first (parse_prometheus, acceptance, export_problem, describe), then the HTTP calls (ask_completion,
read_metrics), which library/serve_job.py puts together.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

UNIT = "eagle3-serve.service"
# The counters vLLM keeps for speculative decoding (the Prometheus client adds _total to a counter's name).
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# The health request: a short prompt, a few tokens, greedy; ignore_eos (vLLM's own field) so that tokens come back
# even when the model would stop at once.
HEALTH_PROMPT = "The capital of France is"
HEALTH_TOKENS = 4
# What marks a folder as an EAGLE-3 export (eagle3 export: speculators' config.json; its MLA layout: vLLM's
# Eagle3DeepseekV*ForCausalLM architectures).
EXPORT_CONFIG = "config.json"
EXPORT_WEIGHTS = "model.safetensors"
RUNNING = ("active", "activating", "reloading")

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


# ------------------------------------------------------------------------------------------------ metrics
def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample of a Prometheus text exposition; comments and bad lines skipped.

    >>> parse_prometheus('# TYPE x counter\\nx_total{engine="0",model_name="m"} 12.0\\ny 3\\nbad line here x')
    [('x_total', {'engine': '0', 'model_name': 'm'}, 12.0), ('y', {}, 3.0)]
    """
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group("labels") or ""))
        samples.append((match.group("name"), labels, value))
    return samples


def _counter(samples, name: str) -> list[tuple[dict, float]]:
    """The samples of counter `name`, exposed as NAME_total (prometheus_client) or NAME; never NAME_created."""
    return [(labels, v) for n, labels, v in samples if n in (name, name + "_total")]


def acceptance(samples) -> dict:
    """The drafter's acceptance from vLLM's counters, summed over engines: drafts, draft tokens, accepted tokens,
    the acceptance rate per draft position, and tau = 1 + accepted / drafts (None before the first draft, or when
    the server has no speculative decoding: `speculative` False).

    >>> m = parse_prometheus('vllm:spec_decode_num_drafts_total{engine="0"} 4\\n'
    ...     'vllm:spec_decode_num_draft_tokens_total{engine="0"} 12\\n'
    ...     'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 6\\n'
    ...     'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 4\\n'
    ...     'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2\\n'
    ...     'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 0\\n')
    >>> acceptance(m)
    {'speculative': True, 'drafts': 4, 'draft_tokens': 12, 'accepted': 6, 'per_position': [1.0, 0.5, 0.0], 'tau': 2.5}
    >>> acceptance([])["speculative"], acceptance([])["tau"]
    (False, None)
    """
    drafts = _counter(samples, DRAFTS)
    total = {name: int(sum(v for _, v in _counter(samples, name))) for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED)}
    by_pos: dict[int, float] = {}
    for labels, v in _counter(samples, ACCEPTED_PER_POS):
        if str(labels.get("position", "")).isdigit():
            by_pos[int(labels["position"])] = by_pos.get(int(labels["position"]), 0.0) + v
    n = total[DRAFTS]
    return {
        "speculative": bool(drafts),
        "drafts": n,
        "draft_tokens": total[DRAFT_TOKENS],
        "accepted": total[ACCEPTED],
        "per_position": [round(by_pos[p] / n, 4) if n else 0.0 for p in sorted(by_pos)],
        "tau": round(1 + total[ACCEPTED] / n, 4) if n else None,
    }


def acceptance_line(acc: dict | None) -> str:
    """One line for a person.

    >>> acceptance_line({"speculative": True, "drafts": 4, "draft_tokens": 12, "accepted": 6,
    ...                  "per_position": [1.0, 0.5, 0.0], "tau": 2.5})
    'acceptance length 2.5 (4 drafts, 6 of 12 draft tokens accepted; per position 1.00, 0.50, 0.00)'
    >>> acceptance_line({"speculative": True, "drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": [],
    ...                  "tau": None})
    'acceptance length not measured yet (no drafts: the server has answered no request since it started)'
    >>> acceptance_line(None)
    'acceptance length unknown (/metrics could not be read)'
    """
    if acc is None:
        return "acceptance length unknown (/metrics could not be read)"
    if not acc["speculative"]:
        return "no speculative decoding counters on /metrics (the server runs without a drafter)"
    if not acc["drafts"]:
        return "acceptance length not measured yet (no drafts: the server has answered no request since it started)"
    per_pos = ", ".join(f"{r:.2f}" for r in acc["per_position"])
    return (
        f"acceptance length {acc['tau']:g} ({acc['drafts']} drafts, {acc['accepted']} of {acc['draft_tokens']} "
        f"draft tokens accepted{'; per position ' + per_pos if per_pos else ''})"
    )


# ------------------------------------------------------------------------------------------------ the drafter
def export_problem(folder: str) -> str | None:
    """Why `folder` is not an EAGLE-3 export that vLLM can serve (what `eagle3 export` writes), or None.

    >>> export_problem("/nonexistent-export")
    'does not exist'
    """
    path = Path(folder)
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a folder"
    config_path = path / EXPORT_CONFIG
    if not config_path.is_file():
        return f"has no {EXPORT_CONFIG}, so it is no export (python -m eagle3 export RUN_DIR {folder} writes one)"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        return f"has a {EXPORT_CONFIG} that cannot be read as JSON ({e})"
    if not isinstance(config, dict):
        return f"has a {EXPORT_CONFIG} that is not a JSON object"
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    if config.get("speculators_model_type") != "eagle3" and not any(str(a).startswith("Eagle3") for a in archs):
        return (
            f"has a {EXPORT_CONFIG} of something else than an EAGLE-3 drafter (speculators_model_type "
            f"{json.dumps(config.get('speculators_model_type'))}, architectures {json.dumps(archs)}): name a folder "
            "written by python -m eagle3 export"
        )
    if not (path / EXPORT_WEIGHTS).is_file():
        return f"has no {EXPORT_WEIGHTS} (an export interrupted before its weights were written?): export it again"
    return None


# ------------------------------------------------------------------------------------------------ the unit
def address_from_execstart(execstart: str) -> tuple[str, int | None]:
    """(host, port) the server was started with, from systemd's rendering of ExecStart.

    >>> address_from_execstart('{ path=/v/bin/python ; argv[]=/v/bin/python -m vllm.entrypoints.openai.api_server '
    ...                        '--model /t --host 127.0.0.1 --port 8001 ; ignore_errors=no }')
    ('127.0.0.1', 8001)
    >>> address_from_execstart("")
    ('', None)
    """
    argv = re.search(r"argv\[\]=([^;]*)", execstart)
    words = argv.group(1).split() if argv else []

    def after(flag):
        return words[words.index(flag) + 1] if flag in words[:-1] else ""

    port = after("--port")
    return after("--host"), int(port) if port.isdigit() else None


def url_host(host: str) -> str:
    """The host as it goes into a URL: an IPv6 address in brackets, a wildcard bind asked on loopback.

    >>> url_host("127.0.0.1"), url_host("::1"), url_host("0.0.0.0"), url_host("")
    ('127.0.0.1', '[::1]', '127.0.0.1', '127.0.0.1')
    """
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


# A traceback's last line, as vLLM's processes print it (the engine core's and workers' lines carry a "(Name pid=N)"
# prefix), and the lines that only point at another one: the engine core's and the API server's wrappers.
_RAISED = re.compile(r"^(?:\([^)]*\)\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.+)$")
_WRAPPER = re.compile(r"see root cause above|see stack trace for root cause|initialization failed", re.IGNORECASE)


def root_cause(log: list[str]) -> str | None:
    """The error that made the server fail, from its last log lines: the last exception raised that is not one of
    the wrappers vLLM puts around a worker's or engine core's failure (they say only "see root cause above").

    >>> root_cause(["(Worker pid=7) ERROR WorkerProc failed to start.", "Traceback (most recent call last):",
    ...             "(Worker pid=7) ValueError: head_dim 16 is not supported",
    ...             "Exception: WorkerProc initialization failed due to an exception in a background process.",
    ...             "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"])
    '(Worker pid=7) ValueError: head_dim 16 is not supported'
    >>> root_cause(["RuntimeError: Engine core initialization failed. See root cause above."]) is None
    True
    """
    causes = [line.strip() for line in log if _RAISED.match(line.strip()) and not _WRAPPER.search(line)]
    return causes[-1][:300] if causes else None


def describe(
    unit: str,
    props: dict,
    log: list[str],
    address: str,
    answer: dict | None,
    acc: dict | None,
    metrics: bool = False,
) -> dict:
    """The verdict and one line for a person, from the unit's properties, its journal, the completion it answered
    (None: not asked), the acceptance read from /metrics and whether /metrics was asked (`metrics`; `acc` None then
    means it did not answer).

    verdict: healthy (it answered), waiting (it runs but does not answer yet), running (it runs, not asked to
    answer: status.yml), failed (exited, or restarting after a crash), stopped (inactive after a clean stop), absent
    (never set up).

    >>> r = describe("s", {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}, ["INFO up"],
    ...              "127.0.0.1:8000", {"ok": True, "model": "m", "text": " Paris", "tokens": 4}, None)
    >>> r["verdict"], r["summary"]
    ('healthy', 's: active, answers at http://127.0.0.1:8000 (model m: " Paris")')
    >>> r = describe("s", {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"},
    ...              ["INFO Loading weights took 1.2 s"], "127.0.0.1:8000", {"ok": False, "error": "refused"}, None)
    >>> r["verdict"], r["progress"]
    ('waiting', 's active, not answering yet: INFO Loading weights took 1.2 s')
    >>> describe("s", {"LoadState": "loaded", "ActiveState": "active"}, [], "h:1", None, None, metrics=True)["summary"]
    's: active at http://h:1; acceptance length unknown (/metrics could not be read)'
    >>> r = describe("s", {"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart",
    ...              "Result": "exit-code", "ExecMainStatus": "1"}, ["ValueError: bad"], "h:1", None, None)
    >>> r["verdict"], r["summary"]
    ('failed', 's: failed (exit-code, exit status 1, restarting): ValueError: bad')
    >>> describe("s", {"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart",
    ...           "Result": "exit-code", "ExecMainStatus": "1"}, ["(EngineCore pid=9) OSError: [Errno 28] No space",
    ...           "RuntimeError: Engine core initialization failed. See root cause above."], "h:1", None, None)["summary"]
    's: failed (exit-code, exit status 1, restarting): RuntimeError: Engine core initialization failed. See root cause above. (the cause: (EngineCore pid=9) OSError: [Errno 28] No space)'
    >>> describe("s", {"LoadState": "not-found"}, [], "", None, None)["summary"]
    's: not set up (no serve.yml has run here)'
    """
    active, sub = props.get("ActiveState", ""), props.get("SubState", "")
    status = int(props.get("ExecMainStatus") or 0)
    last = log[-1][:200] if log else "no log lines"
    cause = root_cause(log)
    if cause and cause not in last:
        last = f"{last} (the cause: {cause})"
    url = f"http://{address}" if address else "an unknown address"
    measured = f"; {acceptance_line(acc)}" if acc is not None or metrics else ""
    if props.get("LoadState", "not-found") == "not-found":
        verdict, summary = "absent", f"{unit}: not set up (no serve.yml has run here)"
    elif sub == "auto-restart" or active == "failed" or (active == "inactive" and status != 0):
        restarting = ", restarting" if sub == "auto-restart" else ""
        verdict = "failed"
        summary = f"{unit}: failed ({props.get('Result') or 'exit'}, exit status {status}{restarting}): {last}"
    elif active == "inactive":
        verdict, summary = "stopped", f"{unit}: inactive (stopped; serve.yml starts it)"
    elif answer and answer.get("ok"):
        verdict = "healthy"
        said = json.dumps(answer.get("text", ""))[:80]
        summary = f"{unit}: {active}, answers at {url} (model {answer.get('model')}: {said}){measured}"
    elif answer is None:
        verdict, summary = "running", f"{unit}: {active} at {url}{measured}"
    else:
        verdict = "waiting"
        summary = f"{unit}: {active}, not answering yet ({answer.get('error')}) at {url}{measured}"
    progress = f"{unit} {active}, not answering yet: {last}" if verdict == "waiting" else summary
    return {
        "verdict": verdict,
        "active": active,
        "status": status,
        "restarts": int(props.get("NRestarts") or 0),
        "url": url if address else "",
        "answer": answer,
        "acceptance": acc,
        "tail": log[-12:],
        "progress": progress,
        "summary": summary,
    }


# ------------------------------------------------------------------------------------------------ HTTP
def _request(url: str, body: dict | None, timeout: float) -> str:
    """GET `url` (POST `body` as JSON when given): the reply's text; an HTTP error status raises HTTPError."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode("utf-8", "replace")


def _error(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        detail = e.read().decode("utf-8", "replace")[:200] if e.fp else ""
        return f"HTTP {e.code} {e.reason}{': ' + detail if detail else ''}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return f"{type(e).__name__}: {e}"


def ask_completion(base: str, timeout: float) -> dict:
    """Ask the server at `base` (http://HOST:PORT) for a short completion of its first served model:
    {ok, model, text, tokens} or {ok: False, error}."""
    try:
        models = json.loads(_request(f"{base}/v1/models", None, timeout))
        model = models["data"][0]["id"]
        body = {
            "model": model,
            "prompt": HEALTH_PROMPT,
            "max_tokens": HEALTH_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = json.loads(_request(f"{base}/v1/completions", body, timeout))
        text = reply["choices"][0].get("text") or ""
        tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return {"ok": False, "error": _error(e)}
    if tokens < 1 and not text:
        return {
            "ok": False,
            "model": model,
            "error": f"the completion came back empty: {json.dumps(reply)[:200]}",
        }
    return {"ok": True, "model": model, "text": text, "tokens": tokens}


def read_metrics(base: str, timeout: float) -> dict | None:
    """The acceptance from GET /metrics (None when it cannot be read)."""
    try:
        return acceptance(parse_prometheus(_request(f"{base}/metrics", None, timeout)))
    except (OSError, ValueError):
        return None
