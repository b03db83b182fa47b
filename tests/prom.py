"""Test kit for Prometheus: promtool checks and a real Prometheus server scraping test targets.

    check_metrics(body)                     # `promtool check metrics` on a /metrics body
    check_promql({"name": expr, ...})       # every expression parses (`promtool check rules`)
    check_config(path)                      # `promtool check config`
    with PrometheusServer({"job": ["127.0.0.1:9100"]}) as prom:
        prom.wait_for("up == 1")            # polls until the result is non-empty
        prom.query("sum(rate(x_total[1m]))")

The binaries come from Debian's `prometheus` package: installed with apt-get when missing
(as root); without apt-get or root the test is skipped, saying so.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

PACKAGE = "prometheus"  # Debian's: /usr/bin/prometheus and /usr/bin/promtool


@functools.cache
def _install_package() -> None:
    """apt-get install the package once per session; skip when apt-get cannot be used here."""
    if shutil.which("apt-get") is None:
        pytest.skip(f"promtool/prometheus missing and no apt-get to install Debian's {PACKAGE!r} package")
    if os.geteuid() != 0:
        pytest.skip(f"promtool/prometheus missing; installing Debian's {PACKAGE!r} package needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", PACKAGE]
    r = subprocess.run(install, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # a fresh image has no package lists yet
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
        r = subprocess.run(install, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"apt-get install {PACKAGE} failed:\n{r.stdout}{r.stderr}")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        _install_package()
        path = shutil.which(name)
        if path is None:
            pytest.fail(f"Debian's {PACKAGE!r} package is installed but {name!r} is not on PATH")
    return path


def promtool_path() -> str:
    return _binary("promtool")


def prometheus_path() -> str:
    return _binary("prometheus")


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([promtool_path(), *args], input=stdin, capture_output=True, text=True, timeout=60)


# The one lint finding allowed: the gateway gauges keep vLLM's names (colon included: the Kubernetes
# inference gateway reads them by those names), which promtool's lint reserves for recording rules.
VLLM_NAME = re.compile(r"^vllm:\w+ metric names should not contain ':'$")


def check_metrics(text: str) -> None:
    """Fail the test with promtool's findings if the exposition text is malformed (exit 1) or breaks
    its lint rules (exit 3: counter suffixes, base units, ...), but for VLLM_NAME."""
    r = _promtool("check", "metrics", stdin=text)
    findings = [line for line in (r.stdout + r.stderr).splitlines() if line.strip() and not VLLM_NAME.match(line)]
    if r.returncode not in (0, 3) or findings:
        pytest.fail(f"promtool check metrics (exit {r.returncode}):\n{r.stdout}{r.stderr}")


def check_promql(exprs: dict[str, str]) -> None:
    """Fail the test unless every expression parses: each becomes a recording rule named after its
    key (a valid metric name, e.g. "panel_3_A") and `promtool check rules` reads the file."""
    groups = {"groups": [{"name": "check", "rules": [{"record": k, "expr": e} for k, e in exprs.items()]}]}
    with tempfile.TemporaryDirectory(prefix="kvbridge-promql-") as tmp:
        rules = Path(tmp, "rules.yml")
        rules.write_text(json.dumps(groups, indent=1))  # JSON is YAML
        r = _promtool("check", "rules", str(rules))
    if r.returncode != 0:
        pytest.fail(f"promtool check rules (exit {r.returncode}):\n{r.stdout}{r.stderr}")


def check_config(path: str | Path) -> None:
    r = _promtool("check", "config", str(path))
    if r.returncode != 0:
        pytest.fail(f"promtool check config {path} (exit {r.returncode}):\n{r.stdout}{r.stderr}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PrometheusServer:
    """A Prometheus scraping `targets` ({job name: ["host:port", ...]}) every `scrape_interval`,
    from a config and TSDB in a temporary directory; killed and removed on exit."""

    def __init__(self, targets: dict[str, list[str]], scrape_interval: str = "1s"):
        self.targets, self.scrape_interval = targets, scrape_interval
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        binary = prometheus_path()
        self.dir = Path(tempfile.mkdtemp(prefix="kvbridge-prometheus-"))
        config = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": addrs}]} for job, addrs in self.targets.items()
            ],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = self.dir / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready(timeout=30)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while starting
                pass
            time.sleep(0.1)
        pytest.fail(f"prometheus not ready after {timeout} s:\n{self.log.read_text()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def api(self, path: str, **params: str) -> dict | list:
        """GET /api/v1/<path>: the response's `data` (fails the test on an API error)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # a bad query is a 400 with the error in its JSON body
            body = json.load(e)
        if body.get("status") != "success":
            pytest.fail(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list:
        """An instant query now: the result, e.g. [{"metric": {...}, "value": [time, "1.5"]}, ...]."""
        return self.api("query", query=promql)["result"]

    def wait_for(self, promql: str, timeout: float = 30) -> list:
        """Poll `promql` until its result is non-empty and return it; fail with the targets' health
        if it stays empty."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result:
                return result
            if time.monotonic() > deadline:
                health = [
                    {k: t.get(k) for k in ("scrapeUrl", "health", "lastError")}
                    for t in self.api("targets")["activeTargets"]
                ]
                pytest.fail(f"no result for {promql!r} after {timeout} s; targets: {health}")
            time.sleep(0.2)
