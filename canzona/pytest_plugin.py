"""pytest plugin: the exactness gate as a fixture, for a project's own optimizer and model.

Installed with canzona (entry point ``pytest11``: ``canzona``), so any project that has canzona
installed can write (the fixture reaches the exactness suite through :func:`canzona.lab.suite`,
imported only when a test calls it)::

    def test_my_optimizer_is_exact(canzona_exact):
        canzona_exact(MyOptimizer, my_model, meshes=["dp2", "dp2xtp2"])

``canzona_exact(optimizer, model=None, *, meshes=("dp2", "dp2xtp2"), **filters)`` runs
:func:`validation.run` (gloo on CPU, spawned worker processes) and fails the test with the table
of failing cells when any cell mismatches, or with the reason when the optimizer cannot be exact
under distribution (:class:`validation.probe.NotSeparableError`) or cannot be imported. It
returns the :class:`validation.SuiteResult` otherwise. ``optimizer``/``model`` are classes and
factories defined at module level in an importable module (the workers import them by name), or
import paths ``package.module:Name``. ``model=None`` runs the built-in awkward and Qwen3 models.

Time: bounded by ``timeout_s`` (default 600) per mesh process group; the defaults (two meshes,
quick level) take well under a minute on two CPU cores. Command-line options: ``--canzona-report
DIR`` also writes each call's report into a numbered folder of DIR.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

__all__ = ["canzona_exact", "pytest_addoption"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("canzona", "canzona exactness gate")
    group.addoption("--canzona-report", default=None, metavar="DIR", help="write the reports of canzona_exact calls under DIR")


@pytest.fixture
def canzona_exact(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Validate an optimizer (and model) under distribution; fails the test on any mismatch."""
    report_root = request.config.getoption("--canzona-report")
    calls = [0]

    def check(
        optimizer: Any,
        model: Any = None,
        *,
        meshes: Sequence[str] | str = ("dp2", "dp2xtp2"),
        optimizer_kwargs: dict[str, Any] | None = None,
        model_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
        **filters: Any,
    ) -> Any:
        from canzona.lab import suite

        lab = suite()

        calls[0] += 1
        report = None
        if report_root:
            safe = request.node.name.replace("/", "_").replace("[", "_").replace("]", "")
            report = f"{report_root}/{safe}-{calls[0]}"
        try:
            res = lab.run(
                optimizer,
                model,
                meshes=meshes,
                optimizer_kwargs=optimizer_kwargs,
                model_kwargs=model_kwargs,
                report=report,
                command=f"pytest {request.node.nodeid}",
                mesh_timeout_s=timeout_s,
                **filters,
            )
        except lab.NotSeparableError as exc:
            pytest.fail(f"canzona_exact: refused: {exc}", pytrace=False)
        except lab.TargetError as exc:
            pytest.fail(f"canzona_exact: {exc}", pytrace=False)
        if not res.ok:
            pytest.fail(f"canzona_exact: {len(res.failures)} of {len(res.report['cells'])} cells failed\n{res.table()}", pytrace=False)
        return res

    return check
