"""The notebooks' explorers in a real JupyterLab, driven by headless Chromium through selenium.

One JupyterLab server for the file (module fixture): on 127.0.0.1, a free port, a random token,
its own config, data, runtime, settings and workspace folders, serving a temporary copy of
``notebooks/`` (so Lab's autosave can never write outputs into the tracked files). The test opens
a notebook, runs its cells through the explorers (the rest of each notebook is
tests/test_notebooks.py's business), changes explorer controls the way a user does (the ``<select>`` of
an ipywidgets dropdown) and reads the title of the figure *drawn on the page* (plotly's SVG), so
it fails when the kernel rebuilds a figure that the browser never receives.

Needs Chromium and its driver on PATH (Debian: ``apt-get install chromium chromium-driver``;
``.ci/run`` installs them where it can) and the ``selenium`` package; skipped with the reason
otherwise. Nothing is downloaded at run time. Set ``CANZONA_BROWSER_SHOTS=DIR`` to keep a
screenshot of each explorer state.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SERVER_START_S = 90
RUN_ALL_S = 420
UPDATE_S = 90
SHOTS_ENV = "CANZONA_BROWSER_SHOTS"


def _browser() -> tuple[str, str]:
    """Paths of a Chromium (or Chrome) binary and its chromedriver, or skip saying what is missing."""
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if browser is None:
        pytest.skip("no Chromium on PATH (Debian: apt-get install chromium chromium-driver)")
    if driver is None:
        pytest.skip("no chromedriver on PATH (Debian: apt-get install chromium-driver)")
    return browser, driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lab_settings(settings: Path) -> None:
    """User settings for this server only: every cell stays in the page (no windowing, so output
    of cells scrolled away is still drawn), no autosave, no news or update checks."""
    files = {
        "notebook-extension/tracker": {"windowingMode": "none"},
        "docmanager-extension/plugin": {"autosave": False},
        "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }
    for name, doc in files.items():
        path = settings / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc), encoding="utf-8")


def _pids_mentioning(marker: str) -> list[int]:
    """Processes whose command line contains ``marker`` (a temporary path only this test uses)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                out.append(int(d.name))
    return out


class Lab:
    def __init__(self, url: str, token: str, root: Path) -> None:
        self.url, self.token, self.root = url, token, root

    def api(self, path: str, method: str = "GET") -> Any:
        req = urllib.request.Request(f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[Lab]:
    _browser()
    base = tmp_path_factory.mktemp("jupyterlab")
    root = base / "notebooks"
    shutil.copytree(NOTEBOOKS, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    for d in ("config", "data", "runtime", "settings", "workspaces", "runs"):
        (base / d).mkdir()
    _lab_settings(base / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTER_DATA_DIR": str(base / "data"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "CANZONA_RUNS_DIR": str(base / "runs"),  # no run of the user's: the notebooks open the shipped samples
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_NUM_THREADS": "1",
    }
    log = (base / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly",
         # a server this test failed to stop still goes away on its own
         "--ServerApp.shutdown_no_activity_timeout=900", *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = Lab(f"http://127.0.0.1:{port}", token, root)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}: {(base / 'server.log').read_text()[-3000:]}")
            try:
                server.api("/api/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not answer within {SERVER_START_S} s")
                time.sleep(0.5)
        yield server
    finally:
        _stop_server(proc, server, str(base))
        log.close()


def _stop_server(proc: subprocess.Popen, server: Lab, marker: str) -> None:
    """Shut the server down through its API (it stops its kernels first), then make sure that no
    process of this test is left: the server's session and every kernel (they run in sessions of
    their own, found by the runtime folder on their command line)."""
    try:
        server.api("/api/shutdown", method="POST")
    except OSError:
        proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while (left := _pids_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.3)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left after the server shut down: {left}"


@pytest.fixture
def browser(lab: Lab, tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _browser()
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    profile = tmp_path / "chromium-profile"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1500,1100",
                "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium never looks for drivers on the network
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    drv.set_page_load_timeout(60)
    drv.set_script_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()
        for k in lab.api("/api/kernels"):  # this test's kernels, not left running for the next
            lab.api(f"/api/kernels/{k['id']}", method="DELETE")
        deadline = time.monotonic() + 10
        while (left := _pids_mentioning(str(profile))) and time.monotonic() < deadline:
            time.sleep(0.3)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"chromium processes left after quit: {left}"


# ------------------------------------------------------------------------------------------ helpers
def _wait(what: str, timeout: float, probe: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last seen: {last!r})")


#: the kernel's state and how many code cells, up to the one holding ``arguments[0]``, have run in
#: the notebook ``arguments[1]``; null until that notebook is the current widget and its content
#: has loaded (the Lab restores the notebook an earlier test left open before it opens this one)
_NOTEBOOK_DONE = """
const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
if (!w || !w.content || !w.context || w.context.path !== arguments[1] || !w.context.isReady) return null;
if (!w.sessionContext || !w.sessionContext.session) return null;
const kernel = w.sessionContext.session.kernel;
const all = w.content.widgets;
const last = all.findIndex(c => c.model.sharedModel.getSource().includes(arguments[0]));
const cells = all.slice(0, last + 1).filter(c => c.model.type === 'code');
const ran = cells.filter(c => c.model.executionCount !== null).length;
return {status: kernel ? kernel.status : 'none', ran: ran, cells: cells.length, last: last,
        errors: document.querySelectorAll('[data-mime-type="application/vnd.jupyter.error"]').length};
"""

#: select the cell holding ``arguments[0]``, run every cell above it, then it (what a user does
#: to reach the explorers without waiting for the rest of the notebook)
_RUN_THROUGH = """
const app = window.jupyterapp;
const nb = app.shell.currentWidget.content;
nb.activeCellIndex = nb.widgets.findIndex(c => c.model.sharedModel.getSource().includes(arguments[0]));
app.commands.execute('notebook:run-all-above').then(() => app.commands.execute('notebook:run-cell'));
"""

#: the title text of every plotly figure drawn in the notebook cell of explorer number
#: ``arguments[0]`` (the cell, not only the widget: the check holds whatever way the explorer shows them)
_EXPLORER_TITLES = """
const box = document.querySelectorAll('.canzona-explorer')[arguments[0]];
if (!box) return null;
const cell = box.closest('.jp-Cell') || box;
return Array.from(cell.querySelectorAll('.js-plotly-plot')).map(p => {
  const t = p.querySelector('.gtitle'); return t ? t.textContent : '';
});
"""


def _run_notebook(drv: Any, lab: Lab, name: str, through: str) -> None:
    """Open ``name`` and run its cells up to and including the one whose source holds ``through``."""
    drv.get(f"{lab.url}/lab/tree/{name}?token={lab.token}")
    opened = _wait("the notebook and its kernel", SERVER_START_S,
                   lambda: (s := drv.execute_script(_NOTEBOOK_DONE, through, name)) and s["status"] == "idle" and s)
    assert opened["last"] >= 0, f"{name}: no cell holds {through!r}"
    drv.execute_script(_RUN_THROUGH, through)
    # running stops at a cell that raises: an error ends the wait too
    state = _wait(f"the cells through {through!r} to run", RUN_ALL_S,
                  lambda: (s := drv.execute_script(_NOTEBOOK_DONE, through, name)) and s["status"] == "idle"
                  and (s["ran"] == s["cells"] or s["errors"]) and s)
    if state["errors"]:
        _shot(drv, f"error-{name}")
        text = drv.execute_script("return Array.from(document.querySelectorAll('[data-mime-type=\"application/vnd.jupyter.error\"]')).map(e => e.innerText).join('\\n')")
        pytest.fail(f"{name}: a cell raised in JupyterLab:\n{text[-3000:]}")


def _titles(drv: Any, explorer: int, n: int) -> list[str]:
    if not drv.execute_script(_EXPLORER_TITLES, explorer):
        _shot(drv, f"waiting-explorer-{explorer}")
    return _wait(f"{n} figures drawn in explorer {explorer}", UPDATE_S,
                 lambda: (t := drv.execute_script(_EXPLORER_TITLES, explorer)) and len(t) >= n and all(t) and t)


def _choose(drv: Any, explorer: int, label: str, text: str) -> None:
    """Pick ``text`` in the dropdown labelled ``label`` of explorer number ``explorer``, as a user does."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    box = drv.find_elements(By.CSS_SELECTOR, ".canzona-explorer")[explorer]
    sel = box.find_element(By.XPATH, f".//div[contains(@class,'widget-dropdown')][label[normalize-space()='{label}']]//select")
    drv.execute_script("arguments[0].scrollIntoView({block: 'center'});", sel)
    Select(sel).select_by_visible_text(text)


def _shot(drv: Any, name: str) -> None:
    out = os.environ.get(SHOTS_ENV)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        drv.save_screenshot(str(Path(out) / f"{name}.png"))


# ------------------------------------------------------------------------------------------ tests
def test_partition_explorer_redraws_on_the_page(lab: Lab, browser: Any) -> None:
    _run_notebook(browser, lab, "01_partition_maps.ipynb", through="vw.strategy_explorer(")
    first = _titles(browser, 0, 2)
    assert "DP32 x TP8, lb-asc" in first[0], first
    _shot(browser, "01-start")
    _choose(browser, 0, "dp", "8")
    # both figures of the explorer follow: the partition map and the per-rank loads
    _wait("both figures to show DP8", UPDATE_S, lambda: all("DP8 x TP8, lb-asc" in t for t in _titles(browser, 0, 2)))
    _choose(browser, 0, "strategy", "asc")
    _wait("both figures to show asc", UPDATE_S, lambda: all("DP8 x TP8, asc, " in t for t in _titles(browser, 0, 2)))
    _shot(browser, "01-dp8-asc")
    # the second explorer (strategies side by side) is independent of the first
    assert "DP32 x TP8" in _titles(browser, 1, 2)[0]


def test_timeline_explorer_follows_the_step_control(lab: Lab, browser: Any) -> None:
    _run_notebook(browser, lab, "03_profiler_timelines.ipynb", through="vw.timeline_explorer(")
    start = _titles(browser, 0, 2)
    assert start[0].startswith("Phase timeline per rank, step 4"), start
    _choose(browser, 0, "step", "2")
    _wait("the timeline and the critical path to show step 2", UPDATE_S,
          lambda: (t := _titles(browser, 0, 2))[0].startswith("Phase timeline per rank, step 2")
          and t[1].startswith("Optimizer critical path, step 2"))
    _shot(browser, "03-step2")
