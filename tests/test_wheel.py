"""A wheel built from the repository works on its own: installed into a fresh venv (reusing this
environment's torch and other dependencies, nothing downloaded), run from a scratch directory
outside the checkout, it finds everything it reads inside the installed package: it plans
Qwen3-32B at DP32 x TP8, names the shipped models when asked for an unknown one, runs
``canzona demo``, and the timeline and exactness notebooks open the samples it ships."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: wall-clock bounds on a shared 2-core runner (the demo takes ~25 s, a notebook ~5-20 s)
DEMO_TIMEOUT_S = 420
NOTEBOOK_BUDGET_S = 240
CELL_TIMEOUT_S = 180
#: top-level entries the wheel is not built from: version control, environments, build and run outputs
_NOT_SOURCE = {".git", ".venv", "build", "dist", ".pytest_cache", ".hypothesis", "runs", "figures", "data"}


def _not_source(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    return skip | (_NOT_SOURCE & set(names) if Path(directory) == ROOT else set())


def _env() -> dict[str, str]:
    """This environment without what would point the child at the checkout or at the suite's
    runs folder: the child sees only the installed wheel and its own working directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CANZONA_RUNS_DIR")}
    env["PIP_NO_INDEX"] = "1"  # nothing from the network: the wheel has no dependencies to fetch here
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(), timeout=timeout)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    # build from a clean copy: pip builds in the source tree, and a build/ left there by an earlier
    # build would put stale files into the wheel (and litter the checkout)
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_not_source)
    res = _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")], tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("canzona-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # Reuse this environment's packages (torch ...) through a .pth line that comes after the new
    # venv's own site-packages, so the installed wheel, not the checkout, provides canzona.
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).stdout.strip())
    (purelib / "reuse-parent-env.pth").write_text("\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]) + "\n")
    res = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", str(wheel)], tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    return wheel, py


def _installed_package(py: Path, cwd: Path) -> Path:
    """Where the venv's interpreter imports canzona from (asserted to be the venv, not the checkout)."""
    where = _run([str(py), "-c", "import canzona; print(canzona.__file__)"], cwd)
    assert where.returncode == 0, where.stderr
    pkg = Path(where.stdout.strip()).resolve().parent
    assert not pkg.is_relative_to(ROOT) and pkg.is_relative_to(py.parents[1].resolve()), pkg
    return pkg


def test_wheel_ships_every_package_data_file(wheel_venv: tuple[Path, Path]) -> None:
    wheel, _ = wheel_venv
    names = set(zipfile.ZipFile(wheel).namelist())
    data = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "canzona" / "data").rglob("*") if p.is_file())
    assert "canzona/data/models/qwen3-32b.json" in data and "canzona/data/profiles/sample/phases.csv" in data
    assert "canzona/data/validation-sample/report.json" in data
    assert [n for n in data if n not in names] == []


def test_wheel_keeps_product_and_lab_apart(wheel_venv: tuple[Path, Path]) -> None:
    """The product ships no test helper: the planted defects, the reference runner and the GPU
    check are the exactness suite's (``validation/``, shipped beside it), the tests' helpers stay
    in the checkout, and importing the installed ``canzona`` (CLI included) imports no suite."""
    wheel, py = wheel_venv
    names = set(zipfile.ZipFile(wheel).namelist())
    lab_in_product = sorted(n for n in names if n in {"canzona/testing.py", "canzona/testing_fsdp.py", "canzona/runtime/faults.py", "canzona/profiling/gpu.py"})
    assert lab_in_product == []
    assert not any(n.startswith("tests/") for n in names)
    assert {"validation/harness.py", "validation/faults.py", "validation/fsdp_harness.py", "canzona/lab.py"} <= names
    code = ("import sys, canzona, canzona.cli, canzona.distributed, canzona.pytest_plugin, canzona.commands.validate; "
            "print(sorted(m for m in sys.modules if m == 'validation' or m.startswith('validation.')))")
    res = _run([str(py), "-c", code], wheel.parent)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    res = _run([str(py), "-c", "import canzona.lab; print(canzona.lab.suite().__file__)"], wheel.parent)
    assert res.returncode == 0 and "site-packages" in res.stdout, res.stdout + res.stderr


def test_installed_wheel_plans_from_its_own_configs(wheel_venv: tuple[Path, Path], tmp_path: Path) -> None:
    _, py = wheel_venv
    _installed_package(py, tmp_path)
    res = _run([str(py), "-m", "canzona", "plan", "--model", "qwen3-32b", "--dp", "32", "--tp", "8"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "qwen3-32b" in res.stdout
    sim = _run([str(py), "-c", "from canzona.sim.hardware import available_hardware; print(available_hardware())"], tmp_path)
    assert "h800-ib400" in sim.stdout, sim.stderr


def test_unknown_model_lists_the_shipped_ones(wheel_venv: tuple[Path, Path], tmp_path: Path) -> None:
    wheel, py = wheel_venv
    shipped = sorted(Path(n).stem for n in zipfile.ZipFile(wheel).namelist() if n.startswith("canzona/data/models/") and n.endswith(".json"))
    assert "qwen3-32b" in shipped and "qwen3-tiny" in shipped
    res = _run([str(py), "-m", "canzona", "plan", "--model", "qwen9-1t", "--dp", "2"], tmp_path)
    assert res.returncode == 2
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"unknown model 'qwen9-1t'; available: {', '.join(shipped)}" in err, err


def test_installed_wheel_runs_the_demo(wheel_venv: tuple[Path, Path], tmp_path: Path) -> None:
    """All three acts at the smallest size the demo has (one profiled step): 4 gloo processes
    spawned from the installed package, traces and phase table written under the working
    directory, and the exactness verdict."""
    _, py = wheel_venv
    _installed_package(py, tmp_path)
    res = _run([str(py), "-m", "canzona", "demo", "--steps", "1"], tmp_path, timeout=DEMO_TIMEOUT_S)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    out = res.stdout
    for act in ("1. Plan: Qwen3-32B", "2. Train: tiny Qwen3", "3. Verify: lb-asc at dp2 x tp2"):
        assert act in out, out[-3000:]
    assert "exactness verdict: EXACT" in out, out[-3000:]
    traces = tmp_path / "runs" / "demo" / "traces"
    assert len(list(traces.glob("rank*.pt.trace.json"))) == 4, sorted(p.name for p in traces.iterdir())
    phases = (tmp_path / "runs" / "demo" / "summary" / "phases.csv").read_text().splitlines()
    assert phases[0].startswith("rank,step,phase") and len(phases) > 1


def _kernel_manager(py: Path, resource_dir: Path):
    """An async kernel manager whose 'python3' spec is the venv's ``python -m ipykernel_launcher``."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class VenvPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: ARG002 - one kernel only
            return KernelSpec(argv=[str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name=f"canzona wheel ({py})", language="python", resource_dir=str(resource_dir))

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=VenvPython())


@pytest.mark.parametrize("name", ["03_profiler_timelines.ipynb", "05_exactness.ipynb"])
def test_installed_wheel_runs_a_notebook_outside_the_checkout(wheel_venv: tuple[Path, Path], tmp_path: Path, name: str) -> None:
    """The notebook, copied to a scratch directory, runs on the venv's kernel and opens the sample
    that the installed package ships (nothing under the scratch directory's runs/)."""
    from nbclient import NotebookClient

    _, py = wheel_venv
    pkg = _installed_package(py, tmp_path)
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    nbformat.write(nb, tmp_path / name)
    client = NotebookClient(nb, km=_kernel_manager(py, tmp_path), kernel_name="python3", timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(tmp_path)}}, allow_errors=False)
    t0 = time.perf_counter()
    client.execute(env=_env())
    elapsed = time.perf_counter() - t0
    assert elapsed < NOTEBOOK_BUDGET_S, f"{name} took {elapsed:.0f} s"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    figures = [o for c in code for o in c.outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figures, f"{name} drew no figure"
    stdout = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    if name.startswith("03"):
        assert f"showing the shipped sample {pkg / 'data' / 'profiles' / 'sample'}" in stdout, stdout[:2000]
    else:
        assert f"showing the shipped sample {pkg / 'data' / 'validation-sample' / 'report.json'}\n" in stdout, stdout[:2000]
