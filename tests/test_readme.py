"""Every command the README shows runs as written (from a scratch copy of the repository root).

Commands come from two places in README.md: the first column of the command table (inline code
starting with ``canzona``) and every ``bash`` block. Each table row and each block runs in its own
scratch directory holding links to the repository's ``data/``, ``profiling/`` and ``notebooks/``
(so that relative paths mean what they mean at the repository root while outputs stay out of the
tree), lines of one block in order, two groups at a time (:data:`PARALLEL`). A command is left out
only for a reason listed in :data:`SKIPPED` or :data:`SKIPPED_EXACT`; a few run at a smaller size,
by appending the options in :data:`SMALLER` (the code path and the flags as written are exercised,
not minutes of planning at DP32). When the README gains a command, this test runs it, or fails
until it is given a reason here.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: command prefix -> why the test does not run it
SKIPPED: dict[str, str] = {
    "make demo": "builds a fresh .venv and installs packages (network); `canzona demo` is tested in tests/test_demo.py (plan act) and tests/test_wheel.py (all acts, from an installed wheel)",
    "make test": "runs the whole suite (this test is part of it)",
    "canzona validate --quick": "about a minute by design; the suite's own checks are tests/test_validation.py",
    "canzona validate --full": "744 cells, many minutes by design",
    "tensorboard --logdir": "starts a web server that runs until stopped",
    "python profiling/nsys_profile.py": "needs Nsight Systems and a GPU (tests/test_profiling.py checks that it fails cleanly without)",
    "python profiling/bench_strategies.py": "a benchmark: minutes of timed runs by design",
    "pip install": "installs packages from the network (transformers is in the dev extra the suite runs with)",
    "torchrun": "starts a multi-process (or multi-node) torchrun job; tests/test_torchrun.py runs canzona under torchrun",
    "PYTHONPATH=. canzona validate --optimizer examples.": "a validation matrix on a user optimizer (minutes); tests/test_validation_api.py runs the same path on examples.sign_momentum",
    "pytest -q tests/test_gpu.py": "the suite runs tests/test_gpu.py itself (its cases skip without CUDA)",
}

#: exact command line -> why the test does not run it
SKIPPED_EXACT: dict[str, str] = {
    "canzona profile --tensorboard runs/prof": "the profiling block runs the same command (with --steps 3) and reads its traces",
    "canzona train --dp 2 --tp 2 --steps 20": "at the test's size it is the same run as the table's `canzona train --nproc 4 ...` "
                                              "(lb-asc and muon are the defaults, --nproc defaults to dp x tp; "
                                              "test_readme_has_commands_and_every_skip_is_used checks that), which runs",
}

#: skipped command line -> the README command that runs the same training once both are made small
SAME_TRAINING = {"canzona train --dp 2 --tp 2 --steps 20": "canzona train --nproc 4 --dp 2 --tp 2 --strategy lb-asc --optimizer muon"}

#: command prefix -> options appended (argparse keeps the last value of an option) to run it small
SMALLER: dict[str, str] = {
    "canzona train --nproc 4": "--steps 1 --batch-size 4 --seq-len 16",
    "canzona train --dp 2 --tp 2 --steps 20": "--steps 1 --batch-size 4 --seq-len 16",
    "canzona profile --tensorboard": "--steps 1 --warmup 0 --batch-size 4 --seq-len 16",
    "canzona simulate --model qwen3-32b": "--model qwen3-1.7b --dp 4 --tp 2 --no-sensitivity",
    "canzona figures --out": "--model qwen3-tiny --dp 2 --tp 2",
    # the benchmarks' command lines run as written, at a size that only checks they run:
    # tests/test_bench_vs_torch.py checks the figures' arithmetic and one small real run
    "python profiling/bench_vs_torch.py": "--variants ddp,lb-asc --depth 2 --steps 1 --warmup 0 --repeat 1",
    "python profiling/bench_collectives.py": "--numel 4096 --repeats 1 --worlds 2",
}


def readme_commands() -> list[tuple[str, list[str]]]:
    """(label, command lines) per table row and per bash block, in README order."""
    text = README.read_text(encoding="utf-8")
    groups: list[tuple[str, list[str]]] = []
    for m in re.finditer(r"^\| `(canzona [^`]*)`", text, flags=re.MULTILINE):
        # optional parts in brackets are examples of further options: run them too
        groups.append((f"table: {m.group(1)}", [m.group(1).replace("[", "").replace("]", "")]))
    for i, m in enumerate(re.finditer(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)):
        body = re.sub(r"\\\n\s*", " ", m.group(1))  # a trailing backslash continues the line
        lines = [ln.split("  #")[0].split(" # ")[0].strip() for ln in body.splitlines()]
        groups.append((f"bash block {i + 1}", [ln for ln in lines if ln and not ln.startswith("#")]))
    return groups


def _skip_reason(line: str) -> str | None:
    if line in SKIPPED_EXACT:
        return SKIPPED_EXACT[line]
    if line.startswith("canzona figures") and re.search(r"--format (png|svg|pdf)", line):
        # the optional static exporter (extra "figures" + a Chromium); tests/test_viz.py checks
        # the one-line error when it is missing
        from canzona.viz.export import static_export_problem

        if (problem := static_export_problem()) is not None:
            return f"static export cannot run here: {problem}"
    return next((why for prefix, why in SKIPPED.items() if line.startswith(prefix)), None)


def _argv(line: str) -> list[str]:
    extra = next((more for prefix, more in SMALLER.items() if line.startswith(prefix)), "")
    words = shlex.split(line) + shlex.split(extra)
    if words[0] == "canzona":
        return [sys.executable, "-m", "canzona", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    raise AssertionError(f"README command {line!r}: the test knows how to run canzona and python commands only")


def test_readme_has_commands_and_every_skip_is_used() -> None:
    lines = [ln for _, group in readme_commands() for ln in group]
    assert len(lines) >= 12
    for prefix in [*SKIPPED, *SMALLER]:
        assert any(ln.startswith(prefix) for ln in lines), f"{prefix!r} is no longer in the README: drop it from the test"
    for line in SKIPPED_EXACT:
        assert line in lines, f"{line!r} is no longer in the README: drop it from the test"
    for skipped, ran in SAME_TRAINING.items():
        assert ran in lines and not _skip_reason(ran), f"{ran!r} no longer runs: run {skipped!r} again"
        assert _train_run(skipped) == _train_run(ran), f"{skipped!r} and {ran!r} are no longer the same run: run both"


def _train_run(line: str) -> tuple[dict, int]:
    """The training configuration and the number of local workers ``line`` starts at the test's size."""
    import argparse

    from canzona.commands.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(_argv(line)[4:])  # after python -m canzona train
    workers = args.nproc if args.nproc is not None else args.dp * args.tp
    return {k: v for k, v in vars(args).items() if k != "nproc"}, workers


GROUPS = readme_commands()
#: groups run two at a time: most commands are one single-threaded process that spends its first
#: seconds importing torch, so on a 2-core runner one core would otherwise idle
PARALLEL = 2


def _run_group(label: str, lines: list[str], where: Path) -> str | None:
    """Run the group's commands in order in ``where``: the first failure's message, or None."""
    for name in ("data", "profiling", "notebooks"):
        (where / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CANZONA_RUNS_DIR": str(where / "runs")}
    for line in lines:
        try:
            res = subprocess.run(_argv(line), cwd=where, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"{label}: `{line}` ran past 300 s"
        if res.returncode != 0:
            return f"{label}: `{line}` exited {res.returncode}\n{res.stderr[-2000:]}"
    return None


@pytest.fixture(scope="module")
def readme_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """label -> the group's failure (None: every command ran), for the groups this session selected
    that have a command to run, each in its own scratch directory."""
    from concurrent.futures import ThreadPoolExecutor

    selected = {item.callspec.params["label"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_readme_command_runs" and item.module is sys.modules[__name__]}
    todo = {label: [ln for ln in lines if not _skip_reason(ln)] for label, lines in GROUPS if label in selected}
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {label: pool.submit(_run_group, label, lines, tmp_path_factory.mktemp("readme"))
                   for label, lines in todo.items() if lines}
        return {label: f.result() for label, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("label,lines", GROUPS, ids=[g[0] for g in GROUPS])
def test_readme_command_runs(readme_runs: dict[str, str | None], label: str, lines: list[str]) -> None:
    if label not in readme_runs:
        pytest.skip("; ".join(f"{ln}: {_skip_reason(ln)}" for ln in lines))
    failure = readme_runs[label]
    assert failure is None, failure
