"""profiling/code_stats.py counts what it says, on a small hand-made checkout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("code_stats", ROOT / "profiling" / "code_stats.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def test_figures_of_a_tiny_checkout(tmp_path: Path, capsys) -> None:
    cs = _load()
    (tmp_path / "canzona" / "runtime").mkdir(parents=True)
    (tmp_path / "canzona" / "__init__.py").write_text('"""Two\nlines."""\n', encoding="utf-8")
    (tmp_path / "canzona" / "runtime" / "fsdp.py").write_text(
        '"""One line."""\n\n\nclass Engine:\n    def step(self):\n' + "        x = 1\n" * 70 + "\n\ndef short():\n    return 1\n", encoding="utf-8")
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "tp.py").write_text("def f():\n    def g():\n        pass\n", encoding="utf-8")
    stats = cs.code_stats(tmp_path)
    assert stats["lines"] == {"canzona": 2 + 79, "validation": 3}
    assert stats["canzona_subpackages"] == {"canzona/*.py": 2, "canzona/runtime": 79}
    assert stats["longest_functions"][0] == "canzona/runtime/fsdp.py:Engine.step:71"
    assert "validation/tp.py:f.g:2" in stats["longest_functions"] and stats["functions_over_60_lines"] == 1
    assert stats["modules_named"] == {"fsdp.py": ["canzona/runtime/fsdp.py"], "tp.py": ["validation/tp.py"]}
    assert stats["module_docstring_lines"] == 3 and stats["longest_module_docstrings"][0] == "canzona/__init__.py:2"
    assert cs.main([str(tmp_path)]) == 0 and "Engine.step:71" in capsys.readouterr().out
    assert cs.main([str(tmp_path / "validation")]) == 2
