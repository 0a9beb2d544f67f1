#!/usr/bin/env python3
"""Every query of a Grafana dashboard JSON, asked of a Prometheus server's HTTP API (instant queries, now).

    dashboard_queries.py DASHBOARD.json PROMETHEUS_URL [--wait-for EXPR] [--timeout S]

Grafana's variables are given the values a user would see: $run matches every run, $__rate_interval is 1m.
--wait-for first waits until EXPR has a result (the scrapes the queries need). Prints one JSON object:
{"queries": [{"panel": ..., "expr": ..., "series": N, "error": ...}], "waited_s": S}. Standard library only: it runs
inside the CT, whose loopback the server listens on.
"""

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request

VARIABLES = {"$__rate_interval": "1m", "$run": ".*"}


def query(url: str, expr: str) -> dict:
    body = urllib.parse.urlencode({"query": expr}).encode()
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query", data=body, timeout=10) as response:
            answer = json.load(response)
    except OSError as e:
        return {"series": 0, "error": str(e)}
    if answer.get("status") != "success":
        return {"series": 0, "error": answer.get("error", "?")}
    return {"series": len(answer["data"]["result"]), "error": None}


def resolve(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dashboard")
    p.add_argument("url")
    p.add_argument("--wait-for", default="")
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    t0 = time.monotonic()
    while args.wait_for and query(args.url, args.wait_for)["series"] == 0:
        if time.monotonic() - t0 > args.timeout:
            print(json.dumps({"error": f"no result for {args.wait_for} in {args.timeout:g} s"}))
            return 1
        time.sleep(1)
    with open(args.dashboard) as f:
        dashboard = json.load(f)
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = resolve(target["expr"])
            out.append({"panel": panel["title"], "expr": expr, **query(args.url, expr)})
    print(json.dumps({"queries": out, "waited_s": round(time.monotonic() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
