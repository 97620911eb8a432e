"""The notebooks: committed without outputs (and small), equal to what notebooks/_generate.py
writes, and each runs top to bottom headless (nbclient) within a bounded time. Their explorers in
a real JupyterLab page: tests/test_jupyterlab.py.

The kernel is this interpreter's ipykernel, started from an explicit command line, so the test
needs no user-installed kernelspec (CI has none) and never picks up another Python's kernel.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
#: wall-clock bound for one notebook on a shared 2-core runner (they take ~5-20 s)
BUDGET_S = 240
CELL_TIMEOUT_S = 180


def test_every_shipped_notebook_exists() -> None:
    assert NAMES == [
        "01_partition_maps.ipynb",
        "02_micro_groups.ipynb",
        "03_profiler_timelines.ipynb",
        "04_scaling.ipynb",
        "05_exactness.ipynb",
    ]


#: a committed notebook is its cells' source; one saved with figures in it weighs megabytes
MAX_NOTEBOOK_BYTES = 100_000


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name: str) -> None:
    size = (NOTEBOOKS / name).stat().st_size
    assert size <= MAX_NOTEBOOK_BYTES, (f"{name} is {size / 1e3:.0f} KB (saved with outputs?); restore it with "
                                        "`python notebooks/_generate.py`")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: cell {cell.id} has outputs"
            assert cell.execution_count is None, f"{name}: cell {cell.id} has an execution count"
            assert "execution" not in cell.metadata
    assert "widgets" not in nb.metadata, f"{name}: saved widget state"
    assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1


def test_notebooks_match_their_generator() -> None:
    res = subprocess.run([sys.executable, str(NOTEBOOKS / "_generate.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------------------------------ execution
def _kernel_manager():
    """An async kernel manager whose 'python3' spec is ``sys.executable -m ipykernel_launcher``."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: ARG002 - one kernel only
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                display_name=f"canzona ({sys.executable})",
                language="python",
                resource_dir=str(NOTEBOOKS),
            )

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ThisPython())


def _sample_runs() -> None:
    """Two small metrics logs in the runs folder the suite uses (tests/conftest.py)."""
    from canzona.runs import MetricsLog, runs_dir

    for k, strategy in enumerate(("sc", "lb-asc")):
        with MetricsLog(runs_dir() / f"train-{strategy}", run={"strategy": strategy, "dp": 2, "tp": 2, "optimizer": "muon"},
                        tensorboard=False) as log:
            for step in range(4):
                log.log(step, 5.5 - 0.2 * step, 0.01 * (1 + k), {"canzona/forward": 0.003})


def _stdout(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_headless(name: str) -> None:
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    if name.startswith("03"):
        _sample_runs()  # the loss cell draws two runs' metrics logs
    client = NotebookClient(nb, km=_kernel_manager(), kernel_name="python3", timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(NOTEBOOKS)}}, allow_errors=False)
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0
    assert elapsed < BUDGET_S, f"{name} took {elapsed:.0f} s"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors
    # every notebook draws: plotly figures reach the output as their own MIME type
    figures = [o for c in code for o in c.outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figures, f"{name} drew no figure"
    for o in figures:
        layout = o["data"]["application/vnd.plotly.v1+json"]["layout"]
        assert layout["title"]["text"]
        # an HTML copy beside the JSON (viz.use_notebook_renderer): what exporters and nbviewer show
        assert "text/html" in o["data"], f"{name}: a figure carries no HTML fallback"
    # notebooks 3 and 5 read the samples shipped inside the package when the user has no run of
    # their own (this test's runs folder holds metrics logs only, no profile or report)
    if name.startswith("03"):
        from canzona.viz.timeline import DEFAULT_PROFILE_DIR

        first = next(o["text"] for c in code for o in c.outputs if o.output_type == "stream")
        assert first.startswith("profile: NOTE no profile of yours") and f"showing the shipped sample {DEFAULT_PROFILE_DIR}" in first, first
    if name.startswith("05"):
        from canzona.viz.exactness import SAMPLE_REPORT

        # the suite's runs folder holds no report: the first output says the sample is shown
        first = next(o["text"] for c in code for o in c.outputs if o.output_type == "stream")
        assert first.startswith("validation report: NOTE no validation report of yours"), first
        assert f"showing the shipped sample {SAMPLE_REPORT}" in first
    if name.startswith("03"):
        titles = [o["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"] for o in figures]
        assert any(t.startswith("Training loss of 2 runs") for t in titles), "the loss cell drew no runs"
    _check_html_export(nb, figures, name)


def _check_html_export(nb: nbformat.NotebookNode, figures: list, name: str) -> None:
    """``jupyter nbconvert --to html`` of the executed notebook draws every figure: each one's
    plot call and title are in the page, and plotly.js is inlined once (the page works offline)."""
    from nbconvert import HTMLExporter

    page, _ = HTMLExporter().from_notebook_node(nb)
    assert page.count("Plotly.newPlot") >= len(figures), f"{name}: exported HTML draws fewer figures than the notebook"
    for o in figures:
        title = o["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"]
        # plotly escapes / < > & in the embedded JSON: compare the title up to the first of them
        head = json.dumps(re.split(r"[/<>&]", title)[0])[1:-1]
        assert head in page, f"{name}: figure {title!r} missing from the exported HTML"
    assert page.count("plotly.js v") >= 1 and len(page) > 3_000_000, f"{name}: plotly.js is not inlined in the exported HTML"
