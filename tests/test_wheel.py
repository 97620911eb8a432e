"""A wheel built from the repository works on its own: installed into a fresh venv (reusing this
environment's torch and other dependencies, nothing downloaded), run outside the checkout, it finds
its model configs and hardware profiles and plans Qwen3-32B at DP32 x TP8."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_NO_INDEX"] = "1"  # nothing from the network: the wheel has no dependencies to fetch here
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    res = _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")], tmp)
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


def test_wheel_ships_the_configs(wheel_venv: tuple[Path, Path]) -> None:
    wheel, _ = wheel_venv
    names = zipfile.ZipFile(wheel).namelist()
    assert "canzona/data/models/qwen3-32b.json" in names
    assert "canzona/data/hardware/h800-ib400.json" in names


def test_installed_wheel_plans_from_its_own_configs(wheel_venv: tuple[Path, Path], tmp_path: Path) -> None:
    _, py = wheel_venv
    where = _run([str(py), "-c", "import canzona; print(canzona.__file__)"], tmp_path)
    assert where.returncode == 0, where.stderr
    assert str(ROOT) not in where.stdout and str(py.parents[1]) in where.stdout, where.stdout
    res = _run([str(py), "-m", "canzona", "plan", "--model", "qwen3-32b", "--dp", "32", "--tp", "8"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "qwen3-32b" in res.stdout
    sim = _run([str(py), "-c", "from canzona.sim.hardware import available_hardware; print(available_hardware())"], tmp_path)
    assert "h800-ib400" in sim.stdout, sim.stderr


def test_unknown_model_lists_the_shipped_ones(wheel_venv: tuple[Path, Path], tmp_path: Path) -> None:
    _, py = wheel_venv
    res = _run([str(py), "-m", "canzona", "plan", "--model", "qwen9-1t", "--dp", "2"], tmp_path)
    assert res.returncode == 2
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "unknown model 'qwen9-1t'" in err and "qwen3-32b" in err and "qwen3-tiny" in err, err
