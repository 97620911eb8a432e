"""Model configurations: the shape facts a plan is built from.

A config file under ``canzona/data/models/`` (shipped inside the package) is JSON with Hugging Face ``config.json`` key names, plus a
``name`` and a ``sources`` map (key -> where the number comes from). Files are data: they are parsed
strictly (unknown keys, wrong types and non-positive sizes are errors), never executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "ModelConfig",
    "MoEConfig",
    "ConfigError",
    "DATA_DIR",
    "MODELS_DIR",
    "MAX_DIM",
    "MAX_LAYERS",
    "MAX_PARAMS",
    "PACKAGE_DATA",
    "available_models",
    "check_tp_degree",
    "load_model_config",
]

#: upper bounds on config sizes: far beyond any model trained today, low enough that planning a
#: config stays fast (a config with 1e6 layers or a 1e30 vocabulary is a typo, not a model)
MAX_LAYERS = 4096
MAX_DIM = 1 << 26  # hidden/intermediate/vocab/head sizes and counts (67 M)
MAX_PARAMS = 10**15  # total parameters (1000 T)

#: the repository's top-level ``data/`` folder: outputs written in a checkout, never read by default
#: except an old validation report (absent in a wheel)
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
#: data the package itself reads, shipped inside it (package data of the wheel): model configs,
#: hardware profiles, the sample trace summary and the sample validation report
PACKAGE_DATA = Path(__file__).resolve().parent / "data"
MODELS_DIR = PACKAGE_DATA / "models"


class ConfigError(ValueError):
    """A model config that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Mixture-of-experts part of a Qwen3-MoE config (every layer is an MoE layer)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"moe.{f.name} must be a positive integer, got {v!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError("moe.num_experts_per_tok cannot exceed moe.num_experts")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Qwen3-architecture decoder (dense or MoE). Field names follow Hugging Face ``config.json``."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    moe: MoEConfig | None = None
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        ints = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        )
        for key in ints:
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{self.name}: {key} must be a positive integer, got {v!r}")
            bound = MAX_LAYERS if key == "num_hidden_layers" else (1 << 40 if key == "max_position_embeddings" else MAX_DIM)
            if v > bound:
                raise ConfigError(f"{self.name}: {key} = {v} is above canzona's bound {bound}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"{self.name}: tie_word_embeddings must be true or false")
        for key in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
                raise ConfigError(f"{self.name}: {key} must be a finite positive number, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{self.name}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        # a rough count (attention + MLP + embeddings) is enough to refuse absurd sizes early
        h, L = self.hidden_size, self.num_hidden_layers
        per_layer = h * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 3 * h * self.intermediate_size
        if L * per_layer + 2 * self.vocab_size * h > MAX_PARAMS:
            raise ConfigError(f"{self.name}: about {L * per_layer + 2 * self.vocab_size * h:.3g} parameters, above canzona's bound {MAX_PARAMS:.0e}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("moe", "sources")}
        if self.moe is not None:
            out["moe"] = {f.name: getattr(self.moe, f.name) for f in fields(self.moe)}
        out["sources"] = dict(self.sources)
        return out

    @classmethod
    def from_dict(cls, data: Any, *, origin: str = "<dict>") -> ModelConfig:
        """Build a config from parsed JSON, rejecting unknown keys and wrong types."""
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: a model config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{origin}: unknown key(s) {', '.join(unknown)}")
        required = [
            "name",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "tie_word_embeddings",
        ]
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(f"{origin}: missing key(s) {', '.join(missing)}")
        if not isinstance(data["name"], str) or not data["name"]:
            raise ConfigError(f"{origin}: name must be a non-empty string")
        kwargs = dict(data)
        moe = kwargs.pop("moe", None)
        if moe is not None:
            if not isinstance(moe, dict):
                raise ConfigError(f"{origin}: moe must be an object")
            moe_known = {f.name for f in fields(MoEConfig)}
            if set(moe) != moe_known:
                raise ConfigError(f"{origin}: moe must have exactly the keys {', '.join(sorted(moe_known))}")
            try:
                kwargs["moe"] = MoEConfig(**moe)
            except ConfigError as exc:
                raise ConfigError(f"{origin}: {exc}") from None
        sources = kwargs.pop("sources", {})
        if not isinstance(sources, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
            raise ConfigError(f"{origin}: sources must map keys to strings")
        kwargs["sources"] = tuple(sorted(sources.items()))
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc}") from None


def check_tp_degree(cfg: ModelConfig, tp: int) -> None:
    """Raise :class:`ConfigError` when tensor parallelism of degree ``tp`` cannot split ``cfg`` on
    head and row boundaries (query and key/value heads, MLP rows, vocabulary rows must divide)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    if tp == 1:
        return
    for what, n in (
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("num_attention_heads", cfg.num_attention_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ):
        if n % tp:
            raise ConfigError(f"{cfg.name}: tp={tp} does not divide {what}={n} (attention needs whole heads per rank)")


def available_models() -> list[str]:
    """Names of the model configs shipped inside the package (``canzona/data/models/``)."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def _available_text() -> str:
    names = available_models()
    if not names:
        return f"none found in {MODELS_DIR} (the package's data is missing: reinstall canzona)"
    return ", ".join(names)


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """Load a shipped model by name (``qwen3-32b``) or a config file by path.

    Raises :class:`ConfigError` with one readable line for an unknown name or a malformed file.
    """
    path = Path(name_or_path)
    # A shipped name like "qwen3-0.6b" has a dot but is not a path: only names ending in .json or
    # containing a directory separator are files.
    text = str(name_or_path)
    if not (text.endswith(".json") or "/" in text or "\\" in text or path.is_file()):
        candidate = MODELS_DIR / f"{str(name_or_path).lower()}.json"
        if not candidate.exists():
            raise ConfigError(
                f"unknown model {str(name_or_path)!r}; available: {_available_text()} (or a path to a .json config)"
            )
        path = candidate
    if not path.is_file():
        raise ConfigError(f"model config file not found: {path}")
    from canzona.fileio import JSONLimitError, read_json

    try:
        data = read_json(path, max_bytes=1 << 20)
    except JSONLimitError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read model config {path}: {exc.strerror or exc}") from None
    return ModelConfig.from_dict(data, origin=str(path))
