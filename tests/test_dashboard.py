"""The Grafana dashboard (docs/grafana) and the Prometheus scrape example (docs/prometheus) use
only metric names, ports and paths the real processes serve: a frontend in KV-router mode, a
prefill and a decode mocker worker, the real ``openai`` client, and their real ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import openai
import yaml

from dynamo_zmq.runtime._status_server import DEFAULT_SYSTEM_PORT
from tests.support.disagg import LONG, SHORT, Worker, wait_pools
from tests.support.http_calls import get
from tests.support.mocker_fleet import start_frontend
from tests.support.procs import ROOT

DASHBOARD = ROOT / "docs" / "grafana" / "dynamo-zmq.json"
SCRAPE = ROOT / "docs" / "prometheus" / "prometheus.yml"

#: PromQL words that look like names but are not metrics.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}
#: Sample suffixes of each family type in the text exposition.
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "untyped": ("",),
             "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created"), "info": ("_info",),
             "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows' nested panels too) and
    the query variables."""
    exprs: list[str] = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        exprs.extend(t["expr"] for t in panel.get("targets", []))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (as written, suffix included: ``x_bucket``)."""
    if m := re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)\s*", expr):
        return {m.group(1)}
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors ($__rate_interval)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        if not m.group(2) and m.group(1) not in _KEYWORDS:  # a name followed by "(" is a call
            names.add(m.group(1))
    return names


def exported_series(page: str) -> set[str]:
    """Every series name a /metrics page can have, from its ``# TYPE`` lines (a labelled
    family with no sample yet still counts: it is exported, just not observed yet)."""
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", page, re.MULTILINE):
        if kind == "counter":  # the text format names a counter's family with its _total
            family = family.removesuffix("_total")
        names.update(family + suffix for suffix in _SUFFIXES[kind])
    names.update(re.findall(r"^([A-Za-z_:][\w:]*)[{ ]", page, re.MULTILINE))
    return names


def unknown_names(dashboard: dict[str, Any], exported: set[str]) -> dict[str, str]:
    """Each dashboard name the processes do not export, with the expression using it."""
    return {name: expr for expr in expressions(dashboard) for name in metric_names(expr)
            if name not in exported}


def test_dashboard_is_importable_with_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36  # Grafana 10's is 38
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert [t["refId"] for t in panel["targets"]] == [
            chr(65 + i) for i in range(len(panel["targets"]))]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Frontend", "Workers", "KV router", "KV transfer (disaggregated workers)"]
    # The quantile panels read the histograms' buckets.
    quantiles = [e for e in expressions(dashboard) if e.startswith("histogram_quantile(0.99")]
    assert {"dynamo_frontend_time_to_first_token_seconds_bucket",
            "dynamo_frontend_inter_token_latency_seconds_bucket"} <= {
        n for e in quantiles for n in metric_names(e)}


def test_metric_names_of_expressions() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(a_seconds_bucket{model=~"$m", '
            'x!="y z"}[$__rate_interval]))) / on (model) group_left b_total + max(c) offset 5m')
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c"}
    assert metric_names("label_values(d_total, model)") == {"d_total"}
    page = ("# TYPE f_total counter\nf_total 1\n# TYPE e counter\n# TYPE g gauge\n"
            "# TYPE h histogram\n"
            'h_bucket{le="1"} 0\n')
    assert exported_series(page) >= {"f_total", "e_total", "g", "h_bucket", "h_sum", "h_count"}
    assert not {"f", "e", "f_total_total", "h"} & exported_series(page)


async def scrape(url: str) -> str:
    status, page = await asyncio.to_thread(get, f"{url}/metrics")
    assert status == 200, url
    return page.decode()


async def test_dashboard_and_scrape_example_match_the_processes(
    namespace, spawn, tiny_model, tmp_path: Path
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    prefill = Worker(spawn, namespace, tiny_model, "prefill")
    decode = Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "conditional",
                         "--disagg-max-local-prefill-tokens", "32", mode="kv", ready=True).address
    await wait_pools(url, prefill=1)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    try:
        for prompt in (LONG, SHORT, LONG):
            done = await client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
            assert done.choices[0].finish_reason in ("length", "stop")
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": SHORT}], max_tokens=3,
            stream=True)
        async for _ in stream:
            pass
    finally:
        await client.close()

    pages = [await scrape(url), *[await scrape(f"http://127.0.0.1:{w.port}")
                                  for w in (prefill, decode)]]
    exported = set().union(*map(exported_series, pages))
    names = {n for expr in expressions(dashboard) for n in metric_names(expr)}
    assert len(names) > 40 and {n.split("_")[1] for n in names} == {
        "frontend", "component", "router"}
    unknown = unknown_names(dashboard, exported)
    assert not unknown, "not exported: " + ", ".join(sorted(unknown))
    # A panel with a misspelled name is caught.
    typo = json.loads(DASHBOARD.read_text().replace(
        "dynamo_router_kv_index_size_blocks", "dynamo_router_kv_index_size_block"))
    assert set(unknown_names(typo, exported)) == {"dynamo_router_kv_index_size_block"}

    # The scrape example names the paths these processes serve, on their default ports.
    config = yaml.safe_load(SCRAPE.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"dynamo-frontend", "dynamo-worker"}
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert job.get("scheme", "http") == "http"
    ports = {name: {int(t.rsplit(":", 1)[1]) for sc in job["static_configs"]
                    for t in sc["targets"]} for name, job in jobs.items()}
    assert ports == {"dynamo-frontend": {frontend_default_port()},
                     "dynamo-worker": {DEFAULT_SYSTEM_PORT}}


def frontend_default_port() -> int:
    """The frontend's default ``--http-port``, from its real parser."""
    from dynamo_zmq.frontend.__main__ import build_parser

    return int(build_parser().parse_args([]).http_port)
