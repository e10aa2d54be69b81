"""The dashboard in a real browser, against a running pipeline (real Redis, real Spark).

The browser is Debian's chromium, driven by Selenium through Debian's chromedriver; the test
setup installs both with apt when they are missing (as root), and never downloads a browser
build. One pipeline runs for the module, under bursty load with some malformed events:

- the page's charts receive data, the audit books balance, the dead letters show their reasons;
- the metric explorer, run for a real metric and key, shows exactly the API's answer;
- the page asks for the bearer token when the API wants one, and works once it is pasted;
- `GET /metrics` parses with the official parser, and its families move under the load;
- `sluice demo`, run as a user runs it, answers and shows its pipeline running.

A screenshot goes to the test's tmp dir; with SLUICE_UPDATE_SCREENSHOT=1 also to
docs/dashboard.png (the README's), after a longer, demo-like load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from sluice.config import Config
from sluice.pipeline.fold import FoldQuery
from sluice.redis.connection import RedisHandle
from sluice.server.app import create_app
from sluice.source.loadgen import Profile, run_load
from sluice.source.producer import Producer
from tests.conftest import ServerThread, free_port, make_config

pytestmark = [pytest.mark.spark, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
APT_PACKAGES = ("chromium", "chromium-driver", "fonts-dejavu-core")
UPDATE_SCREENSHOT = os.environ.get("SLUICE_UPDATE_SCREENSHOT") == "1"
README_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
# The load runs until the first test has what it needs (at most LOAD_S); for the README's
# screenshot, the demo's rate and bursts for a minute.
LOAD_S = 75.0 if UPDATE_SCREENSHOT else 60.0
RATE = 2_000.0 if UPDATE_SCREENSHOT else 1_500.0
PROFILE = (
    Profile("burst")
    if UPDATE_SCREENSHOT
    else Profile("burst", burst_factor=6.0, burst_s=4.0, period_s=15.0)
)
BAD_LINES = (
    b'{"ts": %d, "card": "card-7", "merchant": "merchant-2", "amount": "twelve"}',
    b'{"ts": %d, "card": "card-3", "merchant": "merchant-1", "amount": 4.5',
    b'{"ts": %d, "merchant": "merchant-5", "amount": 9.99}',
)


def _ensure_browser() -> None:
    """Debian's chromium and chromedriver, installed with apt when missing (root only)."""
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(
            "the browser test needs Debian's chromium and chromedriver; install them with"
            f" `apt-get install {' '.join(APT_PACKAGES)}` (as root)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        # Package lists may be missing or stale on a fresh machine.
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"apt-get install failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    _ensure_browser()
    # Selenium must use the system driver; its manager must never go to the network.
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--window-size=1440,1000", "--hide-scrollbars", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-extensions", "--lang=en-US",
    ):  # fmt: skip
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@dataclass
class Live:
    cfg: Config
    client: redis.Redis
    url: str
    pipeline: FoldQuery
    before: dict[str, Any]
    load: threading.Thread
    stop: threading.Event
    started_s: float
    result: dict[str, Any] = field(default_factory=dict)

    def end_load(self) -> None:
        """Stop producing (the malformed events too), and wait for the pipeline to drain."""
        self.stop.set()
        self.load.join(timeout=60)
        assert not self.load.is_alive()
        assert self.pipeline.wait_idle(120), "the pipeline did not drain"

    def get(self, path: str, **params: Any) -> Any:
        resp = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        assert resp.status_code == 200, resp.text
        return resp.json()


def _config(redis_url: str, state_dir: Path) -> Config:
    return make_config(
        redis_url,
        state_dir,
        metrics=[
            {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s",
             "retention": "1h"},
            {"name": "merchant_txn", "key": ["merchant"], "agg": "count", "slice": "10s",
             "retention": "1h"},
            {"name": "amount_sum", "key": ["merchant"], "agg": "sum", "value": "amount",
             "filter": "amount > 0", "slice": "10s", "retention": "1h"},
        ],
        derived=[{"name": "avg_ticket", "expr": "amount_sum / merchant_txn"}],
        spark={"trigger": "500ms"},
        # Watermarks sized to the bursts (as in `sluice demo`), so that backpressure acts.
        backpressure={"controller": "stepwise", "high_watermark": "1MB",
                      "low_watermark": "100KB", "sensitivity": "2s"},
    )  # fmt: skip


def _scrape(url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _bad_events(cfg: Config, client: redis.Redis, stop: threading.Event) -> None:
    producer = Producer.from_config(cfg, client, flow=False)
    n = 0
    while not stop.wait(2.0):
        now = time.time_ns() // 1_000_000
        producer.send_lines(n % 2, [BAD_LINES[n % len(BAD_LINES)] % now])
        producer.flush()
        n += 1


@pytest.fixture(scope="module")
def live(spark: Any, redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    cfg = _config(redis_server.url, tmp_path_factory.mktemp("dashboard"))
    pipeline = FoldQuery(cfg, RedisHandle(redis_server.url), spark)
    supervisor = threading.Thread(target=pipeline.run_forever, name="supervisor", daemon=True)
    supervisor.start()
    stop = threading.Event()
    result: dict[str, Any] = {}
    with ServerThread(create_app(cfg, client)) as server:
        before = _scrape(server.url)

        def load() -> None:
            bad = threading.Thread(target=_bad_events, args=(cfg, client, stop), daemon=True)
            bad.start()
            result.update(run_load(cfg, client, RATE, LOAD_S, PROFILE, seed=5, stop=stop.is_set))
            stop.set()
            bad.join()

        loader = threading.Thread(target=load, name="load", daemon=True)
        loader.start()
        try:
            started = time.monotonic()
            yield Live(cfg, client, server.url, pipeline, before, loader, stop, started, result)
        finally:
            stop.set()
            loader.join(timeout=30)
            pipeline.request_stop()
            supervisor.join(timeout=60)
    client.close()


def _wait(driver: Any, script: str, timeout_s: float, what: str) -> Any:
    """Poll a JS expression in the page until it is truthy; returns its value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = driver.execute_script(f"return ({script});")
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _points(driver: Any, chart: str) -> int:
    return int(
        driver.execute_script(f"return document.getElementById('{chart}').dataset.points || 0")
    )


def _explore(driver: Any, metric: str, keys: list[str], window: str) -> dict[str, Any]:
    """Run the explorer like a user: pick, type, choose the window, submit; return its answer."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "metric")).select_by_value(metric)
    inputs = driver.find_elements(By.CSS_SELECTOR, "#keys input")
    assert len(inputs) == len(keys)
    for box, k in zip(inputs, keys, strict=True):
        box.clear()
        box.send_keys(k)
    win = driver.find_element(By.ID, "window")
    win.clear()
    win.send_keys(window)
    driver.execute_script("document.getElementById('answer').dataset.state = ''")
    driver.find_element(By.ID, "run").click()
    done = (
        "document.getElementById('answer').dataset.state === 'done'"
        " && document.getElementById('series-about').textContent"
    )
    _wait(driver, done, 20, "the explorer's answer")
    return dict(
        driver.execute_script(
            "const d = document.getElementById('answer').dataset;"
            "return {value: d.value, end: d.end, covered_start: d.coveredStart,"
            " covered_end: d.coveredEnd, shown: document.getElementById('answer-value')"
            ".textContent, series: document.getElementById('chart-series').dataset.points};"
        )
    )


def _screenshot(driver: Any, path: Path) -> None:
    """The whole page, beyond the window's height (Chrome DevTools' captureScreenshot)."""
    import base64

    driver.execute_script("window.scrollTo(0, 0)")
    width, height = driver.execute_script(
        "return [document.documentElement.clientWidth, document.documentElement.scrollHeight]"
    )
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {"format": "png", "captureBeyondViewport": True,
         "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}},
    )  # fmt: skip
    path.write_bytes(base64.b64decode(shot["data"]))


def _severe_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_demo_runs_the_real_pipeline_and_its_dashboard_says_so(
    browser: Any, tmp_path: Path
) -> None:
    """`sluice demo` as a new user runs it: the API answers, and the pipeline runs as `sluice
    run` runs it (supervisor, health, lease and role), so the dashboard's badge says running."""
    from selenium.webdriver.common.by import By

    port = free_port()
    # Stopped once checked (SIGTERM, as a service manager stops it): a fixed duration would be
    # a race with Spark's start, which takes longer on a loaded machine.
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "demo", "--duration", "240", "--port", str(port),
         "--rate", "500", "--state-dir", str(tmp_path / "demo")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    base = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    checked = False
    deadline = time.monotonic() + 150
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"total ([\d,]+)", line)
            if checked or not m or int(m.group(1).replace(",", "")) == 0:
                if not checked and time.monotonic() > deadline:
                    proc.send_signal(signal.SIGTERM)
                    deadline = float("inf")  # read on until it has stopped
                continue
            answer = httpx.get(f"{base}/v1/metrics/txn_count",
                               params={"key": "card-0", "window": "5m"}).json()  # fmt: skip
            assert answer["value"] > 0, answer
            status = httpx.get(f"{base}/v1/status").json()
            assert status["pipeline"]["state"] == "running", status["pipeline"]
            assert status["pipeline"]["heartbeat_age_ms"] is not None
            browser.get(f"{base}/")
            badge = "document.getElementById('pipeline-state')"
            _wait(browser, f"{badge}.textContent === 'pipeline running'", 30, "the running badge")
            assert "running" in browser.find_element(By.ID, "pipeline-state").get_attribute("class")
            checked = True
            proc.send_signal(signal.SIGTERM)
    except BaseException:
        proc.kill()  # a failed check leaves no demo running
        proc.wait(timeout=60)
        raise
    assert proc.wait(timeout=90) == 0, "".join(lines)
    text = "".join(lines)
    assert checked, text
    assert f"{base}/" in text
    assert "processed" in text and "freshness" in text
    assert "Traceback" not in text, text


def test_the_page_asks_for_the_token_and_uses_it(
    browser: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    cfg = make_config(redis_url, tmp_path, server={"token": "s3cret"})
    with ServerThread(create_app(cfg, r, history=False)) as server:
        browser.get(f"{server.url}/")
        browser.execute_script("localStorage.clear()")
        browser.get(f"{server.url}/")
        _wait(browser, "!document.getElementById('token-bar').hidden", 10, "the token prompt")
        box = browser.find_element(By.ID, "token")
        box.send_keys("s3cret")
        box.submit()
        _wait(browser, "document.querySelectorAll('#metric option').length", 10, "the metrics")
        _wait(browser, "document.getElementById('pipeline-state').textContent.includes('pipeline')",
              10, "the status")  # fmt: skip
        assert browser.find_element(By.ID, "token-bar").is_displayed() is False
        names = browser.execute_script(
            "return [...document.querySelectorAll('#metric option')].map(o => o.value)"
        )
        assert "txn_count" in names and "avg_ticket" in names
        browser.execute_script("localStorage.clear()")


def test_dashboard_shows_the_live_pipeline_and_the_explorer_matches_the_api(
    browser: Any, live: Live, tmp_path: Path
) -> None:
    # A page an earlier test left open polls its server, gone by now: leave it first, then read
    # the log (reading empties it), so that only this page's errors count below.
    browser.get("about:blank")
    _severe_errors(browser)
    browser.get(f"{live.url}/")
    assert browser.title == "Sluice"
    # The charts receive data: rates, backlog, freshness and the stages' rates.
    _wait(
        browser,
        "window.sluiceDashboard && window.sluiceDashboard.state.samples.some("
        "s => s.input_per_s > 0 && s.processed_per_s > 0 && s.fresh.p50 !== null)",
        120, "samples with input, processed and freshness",
    )  # fmt: skip
    time.sleep(1.5)  # one more poll, so every chart has drawn the samples
    for chart in ("chart-rates", "chart-backlog", "chart-freshness", "chart-ratio",
                  "chart-stage-ingest", "chart-stage-spark"):  # fmt: skip
        assert _points(browser, chart) > 0, chart
    assert _wait(browser, "document.querySelectorAll('#stages tbody tr').length", 10, "stages") == 3
    # The audit books and the dead letters, with their reasons.
    _wait(browser, "document.querySelectorAll('#dead .reason').length", 30, "dead letters")
    reasons = browser.execute_script(
        "return [...document.querySelectorAll('#dead .reason')].map(e => e.textContent)"
    )
    assert set(reasons) <= {"bad_type", "bad_json", "missing_field"} and reasons
    assert "balanced" in browser.find_element("id", "t-audit").text

    # The explorer while the load runs (this is what the screenshot shows) ...
    if UPDATE_SCREENSHOT:  # a few bursts and their backpressure on the charts
        time.sleep(max(0.0, live.started_s + LOAD_S - 12 - time.monotonic()))
    shown = _explore(browser, "txn_count", ["card-0"], "5m")
    assert int(shown["series"]) > 0
    _screenshot(browser, tmp_path / "dashboard.png")
    if UPDATE_SCREENSHOT:
        shutil.copy(tmp_path / "dashboard.png", README_SCREENSHOT)
    print(f"screenshot: {tmp_path / 'dashboard.png'}")

    # ... and once the pipeline is idle, so that nothing moves between the page and the API.
    live.end_load()
    for metric, keys in (("txn_count", ["card-0"]), ("avg_ticket", ["merchant-0"])):
        shown = _explore(browser, metric, keys, "15m")
        api = live.get(f"/v1/metrics/{metric}", key=keys, window="15m", end=shown["end"])
        assert json.loads(shown["value"]) == api["value"], (metric, shown, api)
        assert int(shown["covered_start"]) == api["covered_start"]
        assert int(shown["covered_end"]) == api["covered_end"]
        assert api["value"] is not None and api["value"] > 0
        if metric == "txn_count":
            assert shown["shown"].replace(",", "") == str(api["value"])
    # Everything came from this server; nothing went elsewhere, and no script failed.
    origins = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)"
    )
    assert set(origins) <= {live.url}, origins
    assert not _severe_errors(browser)


def test_prometheus_families_parse_and_move_under_load(live: Live) -> None:
    # Some load (and some malformed events) first, when this test runs on its own.
    time.sleep(max(0.0, live.started_s + 10 - time.monotonic()))
    live.end_load()
    after = _scrape(live.url)
    before = live.before

    def value(fams: dict[str, Any], name: str, **labels: str) -> float:
        fam = fams.get(name)
        if fam is None:
            return 0.0
        total = 0.0
        for s in fam.samples:
            suffix = s.name[len(fam.name) :]
            if suffix in ("", "_total", "_count") and all(
                s.labels.get(k) == v for k, v in labels.items()
            ):
                total += s.value
        return total

    expected = {
        "sluice_backlog_entries", "sluice_backlog_bytes", "sluice_backlog_high_watermark_bytes",
        "sluice_processed_events_per_second", "sluice_input_events_per_second",
        "sluice_admitted_events_per_second", "sluice_freshness_seconds", "sluice_freshness_ms",
        "sluice_events_produced", "sluice_events_in", "sluice_batches", "sluice_dead_letters",
        "sluice_stage_rate", "sluice_stage_backpressure", "sluice_stage_backpressure_ratio",
        "sluice_audit_batches", "sluice_audit_events", "sluice_audit_balanced",
        "sluice_http_request_duration_seconds", "sluice_redis_up",
        "sluice_redis_used_memory_bytes", "sluice_pipeline_state", "sluice_pipeline_up",
    }  # fmt: skip
    assert expected <= set(after), expected - set(after)
    assert after["sluice_freshness_seconds"].type == "histogram"
    assert after["sluice_http_request_duration_seconds"].type == "histogram"
    assert after["sluice_events_in"].type == "counter"
    # They move: events in, batches, freshness observations, queries and dead letters.
    produced = value(after, "sluice_events_produced") - value(before, "sluice_events_produced")
    assert produced > live.result["events"] > 0  # the load, and the malformed events
    # Drained: every event produced came in, and the good ones were aggregated.
    assert value(after, "sluice_events_in") - value(before, "sluice_events_in") == produced
    assert value(after, "sluice_events_aggregated") >= live.result["events"]
    assert value(after, "sluice_batches") > value(before, "sluice_batches")
    assert value(after, "sluice_freshness_seconds") > value(before, "sluice_freshness_seconds")
    assert value(after, "sluice_dead_letters") > 0
    assert value(after, "sluice_audit_balanced") == 1
    assert value(after, "sluice_redis_up") == 1
    assert value(after, "sluice_pipeline_state", state="running") == 1
    polls = value(after, "sluice_http_request_duration_seconds", route="/v1/status")
    assert polls > value(before, "sluice_http_request_duration_seconds", route="/v1/status")
    assert value(after, "sluice_http_request_duration_seconds", route="/v1/metrics/{name}") >= 2
