"""A real Prometheus scrapes the metrics endpoint and answers a query about one of its metrics."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
from waiting import wait_until

from cmb_dagster.callbacks import CallbackClient
from cmb_dagster.metrics import serve

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, ConnectionError):
        return None


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary on PATH (Debian: apt-get install prometheus)")
def test_prometheus_scrapes_the_endpoint_and_answers_a_query(db, tmp_path):
    with CallbackClient(db, buffered=False) as client:
        for i in range(3):
            client.create("prom", "g", str(i), datetime.now(UTC) + timedelta(hours=1), "https://example.com/cb")
    endpoint = serve(db, host="127.0.0.1", port=0)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: cmb\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{endpoint.port}']\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        api = f"http://127.0.0.1:{port}/api/v1"
        query = urllib.parse.urlencode({"query": 'sum(cmb_callbacks_pending{job="cmb"})'})

        def answered() -> list:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            reply = get_json(f"{api}/query?{query}")
            return reply["data"]["result"] if reply and reply.get("status") == "success" else []

        (result,) = wait_until(answered, 60, "Prometheus has scraped the endpoint")
        assert float(result["value"][1]) == 3
        targets = get_json(f"{api}/targets")
        assert targets is not None
        (target,) = targets["data"]["activeTargets"]
        assert target["health"] == "up", target
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        endpoint.stop()
