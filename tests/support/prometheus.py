"""Prometheus and promtool (built by hack/build-prometheus), and the chart's rules and dashboards.

`binary(name)` looks where hack/build-prometheus puts them (`$DYNAMO_PROMETHEUS_BIN_DIR`,
else the test bed's cache keyed by hack/versions.env), then on PATH; `require_promtool()` skips
the test with the reason when there is none. `PrometheusServer` runs a real Prometheus on
loopback and answers PromQL through its HTTP API. `dashboard_queries()` and `alert_rules()`
read the chart's own files, which the tests check as they ship.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "dynamo-operator"
RULES = CHART / "alerts" / "dynamo-operator.rules.yaml"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
VARIABLE = re.compile(r"\$(__rate_interval|namespace|dynamoworker)\b|\$\{(\w+)\}")


def _version() -> str:
    for line in (REPO / "hack" / "versions.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "PROMETHEUS_VERSION":
            return value.strip()
    raise AssertionError("hack/versions.env pins no PROMETHEUS_VERSION")


def binary(name: str) -> Path | None:
    """`prometheus` or `promtool`, or None."""
    if os.environ.get("DYNAMO_PROMETHEUS_BIN_DIR"):
        return Path(os.environ["DYNAMO_PROMETHEUS_BIN_DIR"]) / name
    cache = Path(
        os.environ.get("DYNAMO_TESTBED_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dynamo-testbed"
    )
    built = cache / "bin" / f"prometheus-{_version()}" / name
    if built.is_file():
        return built
    on_path = shutil.which(name)
    return Path(on_path) if on_path else None


def _require(name: str) -> Path:
    found = binary(name)
    if found is None or not found.is_file():
        pytest.skip(f"needs {name}: run hack/build-prometheus or set DYNAMO_PROMETHEUS_BIN_DIR")
    return found


def require_promtool() -> Path:
    return _require("promtool")


def require_prometheus() -> Path:
    return _require("prometheus")


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of the chart's rule file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    expr: str


def dashboard_queries() -> list[PanelQuery]:
    """Every PromQL query of the chart's dashboards: panel targets and query variables."""
    found = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                found.append(PanelQuery(path.name, panel["title"], target["expr"]))
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                found.append(PanelQuery(path.name, f"${variable['name']}", variable["definition"]))
    return found


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` with Grafana's variables replaced by `values` (named without the `$`)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise AssertionError(f"no value for ${name} in {expr}")
        return values[name]

    return VARIABLE.sub(value, expr)


class PrometheusServer:
    """A Prometheus process on loopback and its HTTP API."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/`path`; the `data` of a successful answer, else AssertionError."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:  # loopback only
                body = json.load(response)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) `expr` evaluates to now."""
        data = self.api("query", query=expr)
        if data["resultType"] == "vector":
            return list(data["result"])
        return [{"metric": {}, "value": data["result"]}]

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@contextmanager
def prometheus_server(
    config: dict[str, Any], workdir: Path, port: int
) -> Iterator[PrometheusServer]:
    """Prometheus with `config` (a prometheus.yml as a dict), its data under `workdir`,
    listening on 127.0.0.1:`port`; stopped on exit."""
    binary = require_prometheus()
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                str(binary),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = PrometheusServer(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2):  # loopback
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"prometheus not ready:\n{server.log_tail()}") from None
                time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
