"""A real headless Chromium opens the running dashboard (`fleetctl dashboard`) page by page.

On the demo's store, and on the demo's store with the rest of a fleet added (see conftest), every
page must finish its script run, draw each of its charts and show no exception or error element.
Screenshots of each page go to tests/artifacts/ (<page>.png on the demo store, <page>-full.png on
the full one). Chromium is driven over the DevTools protocol; Streamlit renders in the browser,
so the test polls the DOM until the page has settled instead of guessing a fixed delay.

Needs /usr/bin/chromium (scripts/ensure-chromium.sh installs it); the test installs nothing.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websocket

from controlplane.lab.engine import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
WIDTH, HEIGHT = 1400, 2000
# url path, title, the fewest charts on the demo store, on the full store
PAGES = {
    "fleet": ("", "Fleet", 3, 3),
    "pool": ("pool", "Pool", 7, 10),
    "ep": ("ep", "Expert parallelism", 0, 4),
    "kv": ("kv", "KV transfer", 0, 8),
    "gpus": ("gpus", "GPUs", 0, 5),
    "incidents": ("incidents", "Incidents", 2, 2),
    "actions": ("actions", "Actions", 1, 1),
    "canary": ("canary", "Canary gates", 0, 2),
}
STATE = """(() => {
  const app = document.querySelector('[data-testid="stApp"]');
  const main = document.querySelector('[data-testid="stMain"]');
  return {
    script: app ? app.getAttribute('data-test-script-state') : null,
    title: (document.querySelector('[data-testid="stMain"] h1') || {}).innerText || null,
    charts: document.querySelectorAll('[data-testid="stVegaLiteChart"]').length,
    drawn: document.querySelectorAll('[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg.marks')
      .length,
    exceptions: [...document.querySelectorAll('[data-testid="stException"]')].map(e => e.innerText.slice(0, 500)),
    errors: [...document.querySelectorAll('[data-testid="stAlertContentError"]')].map(e => e.innerText.slice(0, 500)),
    height: main ? main.scrollHeight : 0,
  };
})()"""



class Browser:
    """Headless Chromium with a fresh profile, driven over the DevTools protocol."""

    def __init__(self, profile: Path) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0
        self.call("Page.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def viewport(self, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=height, deviceScaleFactor=1, mobile=False)

    def open(self, url: str, timeout: float = 60.0) -> dict[str, Any]:
        """Load `url` and wait until the script finished, every chart is drawn and nothing changes for a while."""
        self.viewport(HEIGHT)
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        steady = 0
        while time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.eval(STATE)
            settled = state["script"] == "notRunning" and state["title"] and state["drawn"] >= state["charts"]
            steady = steady + 1 if settled and state == last else 0
            last = state
            if steady >= 3 or state["exceptions"]:
                break
        assert last is not None
        return last

    def wait(self, probe: str, until: Any, timeout: float = 30.0) -> Any:
        """Evaluate `probe` until `until(value)` holds; the last value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.eval(probe)
            if until(value):
                break
            time.sleep(0.3)
        return value

    def click_link(self, text: str) -> bool:
        """Click the link in the page whose text starts with `text`, as a user would."""
        return bool(self.eval(f"""(() => {{
          const a = [...document.querySelectorAll('[data-testid="stMain"] a')]
            .find(e => e.innerText.trim().startsWith({json.dumps(text)}));
          if (!a) return false; a.click(); return true; }})()"""))

    def choose(self, label: str, option: str) -> bool:
        """Open the selectbox labelled `label` with a mouse click and pick `option`."""
        box = self.eval(f"""(() => {{ const i = document.querySelector('input[aria-label={json.dumps(label)}]');
          if (!i) return null; const r = i.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        if box is None:
            return False
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)
        self.wait("document.querySelectorAll('[role=\"option\"]').length", bool, timeout=10)
        return bool(self.eval(f"""(() => {{
          const o = [...document.querySelectorAll('[role="option"]')].find(e => e.innerText.trim() === {json.dumps(option)});
          if (!o) return false; o.click(); return true; }})()"""))

    def screenshot(self, path: Path, height: int) -> None:
        """The whole page: the viewport grows to the content so nothing is cut off."""
        self.viewport(min(max(HEIGHT, height), 12000))
        time.sleep(1.0)  # charts re-layout for the new viewport
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def chromium() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/ensure-chromium.sh (as root) to install Debian's chromium")
    return CHROMIUM


def serve(db: Path) -> Iterator[str]:
    """`fleetctl dashboard` on `db` at a free port; yields its base URL and stops it with its child."""
    port = free_port()
    env = {**os.environ, "FLEETCTL_API_URL": f"http://127.0.0.1:{free_port()}"}
    for name in ("FLEETCTL_API_TOKEN", "FLEETCTL_CONFIG"):
        env.pop(name, None)
    log = open(db.parent / f"dashboard-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "dashboard", "--db", f"sqlite:///{db}",
                             "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the dashboard did not start: {(db.parent / f'dashboard-{port}.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the CLI and the Streamlit server it started
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def demo_server(demo_db: Path) -> Iterator[str]:
    yield from serve(demo_db)


@pytest.fixture(scope="module")
def full_server(full_db: Path) -> Iterator[str]:
    yield from serve(full_db)


def check_pages(base: str, browser: Browser, *, full: bool) -> dict[str, dict[str, Any]]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    seen: dict[str, dict[str, Any]] = {}
    for page, (path, title, demo_charts, full_charts) in PAGES.items():
        state = browser.open(f"{base}/{path}")
        browser.screenshot(ARTIFACTS / f"{page}{'-full' if full else ''}.png", state["height"])
        seen[page] = state
        assert not state["exceptions"], (page, state["exceptions"])
        assert not state["errors"], (page, state["errors"])
        assert state["script"] == "notRunning" and state["title"] == title, (page, state)
        assert state["charts"] >= (full_charts if full else demo_charts), (page, state)
        assert state["drawn"] == state["charts"], (page, "a chart was not drawn", state)
    return seen


def test_every_page_renders_on_the_demo_store(chromium: str, demo_server: str, tmp_path: Path) -> None:
    browser = Browser(tmp_path / "profile")
    try:
        seen = check_pages(demo_server, browser, full=False)
    finally:
        browser.close()
    assert seen["fleet"]["charts"] >= 3 and seen["incidents"]["charts"] >= 2


def test_every_page_draws_its_charts_on_a_full_fleet(chromium: str, full_server: str, tmp_path: Path) -> None:
    browser = Browser(tmp_path / "profile")
    try:
        check_pages(full_server, browser, full=True)
    finally:
        browser.close()
    assert all((ARTIFACTS / f"{page}-full.png").stat().st_size > 10_000 for page in PAGES)


PLACE = """(() => ({
  script: (document.querySelector('[data-testid="stApp"]') || {getAttribute: () => null}).getAttribute('data-test-script-state'),
  title: (document.querySelector('[data-testid="stMain"] h1') || {}).innerText || null,
  header: (document.querySelector('[data-testid="stMain"] h2') || {}).innerText || null,
  caption: (document.querySelector('[data-testid="stMain"] [data-testid="stCaptionContainer"]') || {}).innerText || '',
  sidebar: [...document.querySelectorAll('[data-testid="stSidebar"] [data-testid="stCaptionContainer"]')].map(e => e.innerText),
  search: location.search,
}))()"""


def test_links_and_choices_work_in_the_browser(chromium: str, full_server: str, tmp_path: Path) -> None:
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(f"{full_server}/incidents?finding=1")
        assert browser.eval(PLACE)["header"].startswith("#1 ")
        assert browser.click_link("Pool prefill at the time")
        pool = browser.wait(PLACE, lambda p: p["title"] == "Pool" and p["script"] == "notRunning"
                            and p["caption"].startswith("prefill (prefill)"))
        assert pool["caption"].startswith("prefill (prefill)"), pool
        assert any(c.startswith("Pinned to") for c in pool["sidebar"]), pool  # the incident's time, not live
        assert browser.choose("Pool", "moe-decode")
        chosen = browser.wait(PLACE, lambda p: p["caption"].startswith("moe-decode (") and p["script"] == "notRunning")
        assert chosen["caption"].startswith("moe-decode ("), chosen
        assert "pool=moe-decode" in chosen["search"], chosen  # shareable: the choice is in the URL
    finally:
        browser.close()
