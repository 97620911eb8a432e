"""Hardware profiles: every constant the step-time simulator uses, each with its source.

A profile is a JSON document under ``canzona/data/hardware/<name>.json`` (shipped inside the package) (``schema`` =
``canzona.hardware``, ``version`` = 1). Every constant is an object ``{"value": number,
"source": text}``; the source is a citation or starts with the word ``assumption`` and says why.
Files are data: parsing is strict (unknown, missing or mistyped keys are errors, never defaults).

Calibration (:func:`calibrate`) replaces assumed throughput constants by values fitted to measured
timings (CSV), so GPU measurements, when there are some, take over from assumptions; the fitted
constants carry a source naming the CSV and the fit.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from canzona.config import PACKAGE_DATA
from canzona.cost import matrix_flops
from canzona.optimizers import get_optimizer, optimizer_names
from canzona.fileio import loads_json

__all__ = [
    "HARDWARE_DIR",
    "SCHEMA",
    "VERSION",
    "FLOPS_PER_MAC",
    "DTYPES",
    "Constant",
    "HardwareProfile",
    "HardwareError",
    "available_hardware",
    "load_hardware",
    "parse_hardware",
    "ns_efficiency",
    "peak_flops",
    "calibrate",
    "fit_matrix_throughput",
    "read_timings_csv",
]

HARDWARE_DIR = PACKAGE_DATA / "hardware"
SCHEMA = "canzona.hardware"
VERSION = 1
#: canzona.cost counts a matrix-product "flop" as one multiply-add; a GPU's peak counts two.
FLOPS_PER_MAC = 2
#: precisions the optimizer's matrix products may run in
DTYPES: tuple[str, ...] = ("bf16", "tf32", "fp32")


class HardwareError(ValueError):
    """A hardware profile or calibration file that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class Constant:
    """One named number with where it comes from (a citation, or ``assumption: why``)."""

    value: float
    source: str

    @property
    def assumed(self) -> bool:
        return self.source.lower().startswith("assumption")


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One GPU cluster class: compute peaks, achieved efficiencies, link bandwidths and latencies.

    Bandwidths are per GPU and per direction (GB/s = 1e9 bytes/s); ``*_efficiency`` is the
    fraction of that line rate NCCL's bandwidth term achieves for large messages (bus bandwidth).
    ``*_alpha_us`` is the latency of one algorithm step (one ring hop) on that link class;
    ``collective_launch_us`` the fixed cost of issuing any collective (kernel launch, NCCL enqueue).
    """

    name: str
    description: str
    gpus_per_node: Constant
    peak_bf16_tflops: Constant
    peak_tf32_tflops: Constant
    peak_fp32_tflops: Constant
    hbm_gb: Constant
    hbm_gbps: Constant
    hbm_efficiency: Constant
    fwd_bwd_mfu: Constant
    ns_efficiency_max: Constant
    ns_efficiency_half_dim: Constant
    nvlink_gbps: Constant
    nvlink_efficiency: Constant
    nvlink_alpha_us: Constant
    net_gbps: Constant
    net_efficiency: Constant
    net_alpha_us: Constant
    collective_launch_us: Constant

    # ------------------------------------------------------------------ derived, in SI units
    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbps.value * 1e9 * self.nvlink_efficiency.value

    @property
    def net_bytes_per_s(self) -> float:
        return self.net_gbps.value * 1e9 * self.net_efficiency.value

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps.value * 1e9 * self.hbm_efficiency.value

    def constants(self) -> dict[str, Constant]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Constant)}

    def with_values(self, **values: float | Constant) -> HardwareProfile:
        """A copy with some constants replaced (a bare number keeps a source saying it was overridden)."""
        known = self.constants()
        changes: dict[str, Constant] = {}
        for k, v in values.items():
            if k not in known:
                raise HardwareError(f"unknown hardware constant {k!r}; known: {', '.join(known)}")
            c = v if isinstance(v, Constant) else Constant(float(v), f"override of {known[k].value:g} ({known[k].source})")
            _check_value(k, c.value, self.name)
            changes[k] = c
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"schema": SCHEMA, "version": VERSION, "name": self.name, "description": self.description}
        for k, c in self.constants().items():
            doc[k] = {"value": c.value, "source": c.source}
        return doc


_CONSTANT_NAMES = tuple(f.name for f in fields(HardwareProfile) if f.name not in ("name", "description"))
#: constants that are fractions of a peak
_FRACTIONS = ("hbm_efficiency", "fwd_bwd_mfu", "ns_efficiency_max", "nvlink_efficiency", "net_efficiency")


def _check_value(key: str, value: float, where: str) -> None:
    if not math.isfinite(value):
        raise HardwareError(f"{where}: {key} must be finite, got {value!r}")
    if key in _FRACTIONS:
        if not 0.0 < value <= 1.0:
            raise HardwareError(f"{where}: {key} is a fraction of peak and must be in (0, 1], got {value!r}")
    elif key in ("nvlink_alpha_us", "net_alpha_us", "collective_launch_us", "ns_efficiency_half_dim"):
        if value < 0:
            raise HardwareError(f"{where}: {key} must be >= 0, got {value!r}")
    elif value <= 0:
        raise HardwareError(f"{where}: {key} must be > 0, got {value!r}")


def parse_hardware(doc: Any, where: str = "hardware profile") -> HardwareProfile:
    """Build a profile from its JSON document, strictly (unknown or missing keys are errors)."""
    if not isinstance(doc, dict):
        raise HardwareError(f"{where}: a hardware profile must be a JSON object")
    if doc.get("schema") != SCHEMA:
        raise HardwareError(f"{where}: not a hardware profile (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
    if doc.get("version") != VERSION:
        raise HardwareError(f"{where}: unsupported hardware profile version {doc.get('version')!r} (this canzona reads {VERSION})")
    allowed = {"schema", "version", "name", "description", *_CONSTANT_NAMES}
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise HardwareError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}")
    missing = sorted(allowed - set(doc))
    if missing:
        raise HardwareError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    for k in ("name", "description"):
        if not isinstance(doc[k], str) or not doc[k].strip():
            raise HardwareError(f"{where}: {k} must be a non-empty string")
    consts: dict[str, Constant] = {}
    for k in _CONSTANT_NAMES:
        entry = doc[k]
        if not isinstance(entry, dict) or set(entry) != {"value", "source"}:
            raise HardwareError(f"{where}: {k} must be an object with exactly 'value' and 'source'")
        v, s = entry["value"], entry["source"]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise HardwareError(f"{where}: {k}.value must be a number, got {v!r}")
        if not isinstance(s, str) or not s.strip():
            raise HardwareError(f"{where}: {k}.source must be a non-empty string (a citation or 'assumption: why')")
        _check_value(k, float(v), where)
        consts[k] = Constant(float(v), s)
    return HardwareProfile(name=doc["name"], description=doc["description"], **consts)


def available_hardware() -> list[str]:
    """Names of the profiles shipped inside the package (``canzona/data/hardware``)."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def load_hardware(name_or_path: str | Path) -> HardwareProfile:
    """Load a shipped profile by name (``h800-ib400``) or a profile JSON file by path."""
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".json") or path.is_file()):
        path = HARDWARE_DIR / f"{text}.json"
        if not path.is_file():
            raise HardwareError(f"unknown hardware {text!r}; choose one of {', '.join(available_hardware())} or give a profile path")
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise HardwareError(f"cannot read hardware profile {path}: {exc.strerror or exc}") from None
    try:
        doc = loads_json(raw, str(path), max_bytes=1 << 20)
    except json.JSONDecodeError as exc:
        raise HardwareError(str(exc)) from None
    prof = parse_hardware(doc, str(path))
    if path.parent == HARDWARE_DIR and prof.name != path.stem:
        raise HardwareError(f"{path}: name {prof.name!r} differs from the file name")
    return prof



# --------------------------------------------------------------------------- throughput model
def peak_flops(hw: HardwareProfile, dtype: str) -> float:
    """Peak FLOP/s (two per multiply-add) of the matrix units in ``dtype``."""
    if dtype == "bf16":
        return hw.peak_bf16_tflops.value * 1e12
    if dtype == "tf32":
        return hw.peak_tf32_tflops.value * 1e12
    if dtype == "fp32":
        return hw.peak_fp32_tflops.value * 1e12
    raise HardwareError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def ns_efficiency(hw: HardwareProfile, shape: tuple[int, ...]) -> float:
    """Achieved fraction of peak for the optimizer's matrix products on a matrix of ``shape``.

    The products of Newton-Schulz (and of Shampoo / SOAP) are Gram-type GEMMs whose inner and
    outer sizes are the matrix's two dimensions; their smallest dimension b bounds the tile
    occupancy. Efficiency saturates with b:

        eff(b) = ns_efficiency_max * b / (b + ns_efficiency_half_dim)

    (a Michaelis-Menten form: half of the maximum at b = half_dim). Both constants come from the
    profile, or from :func:`calibrate` when measured timings exist.
    """
    b = min(shape) if len(shape) >= 2 else 1
    half = hw.ns_efficiency_half_dim.value
    return hw.ns_efficiency_max.value * b / (b + half)


def fit_matrix_throughput(rows: list[tuple[str, int, int, str, float]], hw: HardwareProfile) -> tuple[float, float, float]:
    """Fit (ns_efficiency_max, ns_efficiency_half_dim) to measured optimizer-step timings.

    ``rows`` are (optimizer, m, n, dtype, seconds): the wall time of one matrix optimizer update
    of an m x n matrix. Achieved efficiency per row is ``FLOPS_PER_MAC * matrix_flops / seconds /
    peak(dtype)`` with FLOPs from :mod:`canzona.cost`; the fit minimises the squared relative
    error of predicted time over a log grid of half_dim with the closed-form best maximum for each
    (weighted least squares on 1/eff). Returns (eff_max, half_dim, rms relative error).
    """
    if not rows:
        raise HardwareError("calibration needs at least one timing row")
    effs, bs = [], []
    for opt, m, n, dtype, sec in rows:
        flops = FLOPS_PER_MAC * matrix_flops(opt, (m, n))
        effs.append(flops / sec / peak_flops(hw, dtype))
        bs.append(min(m, n))
    best: tuple[float, float, float] | None = None
    grid = [0.0] + [2 ** (k / 4) for k in range(0, 4 * 14 + 1)]  # 0 and 1 .. 16384
    for half in grid:
        # predicted time ∝ 1/eff_pred = (1 + half/b) / emax; measured ∝ 1/eff. Relative error
        # r_i = eff_i * (1 + half/b_i) / emax - 1; least squares in 1/emax is closed form.
        x = [e * (1 + half / b) for e, b in zip(effs, bs)]
        inv = sum(x) / sum(v * v for v in x)
        emax = 1 / inv
        if not 0 < emax <= 1:
            continue
        err = math.sqrt(sum((v * inv - 1) ** 2 for v in x) / len(x))
        if best is None or err < best[2] - 1e-12:
            best = (emax, half, err)
    if best is None:
        raise HardwareError("measured timings imply an efficiency above peak for every fit; check the dtype column")
    return best


_CSV_COLUMNS = ("optimizer", "m", "n", "dtype", "seconds")


def read_timings_csv(path: str | Path) -> list[tuple[str, int, int, str, float]]:
    """Read a timing CSV with header ``optimizer,m,n,dtype,seconds`` (strictly)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise HardwareError(f"cannot read calibration file {p}: {exc.strerror or exc}") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != _CSV_COLUMNS:
        raise HardwareError(f"{p}: header must be {','.join(_CSV_COLUMNS)}")
    matrix_keys = tuple(get_optimizer(n).cost_key for n in optimizer_names(matrix=True))
    rows = []
    for i, rec in enumerate(reader, start=2):
        if not rec or all(not c.strip() for c in rec):
            continue
        if len(rec) != len(_CSV_COLUMNS):
            raise HardwareError(f"{p}:{i}: expected {len(_CSV_COLUMNS)} fields, got {len(rec)}")
        opt, m, n, dt, sec = (c.strip() for c in rec)
        if opt not in matrix_keys:
            raise HardwareError(f"{p}:{i}: optimizer must be a matrix optimizer ({', '.join(matrix_keys)}), got {opt!r}")
        if dt not in DTYPES:
            raise HardwareError(f"{p}:{i}: dtype must be one of {', '.join(DTYPES)}, got {dt!r}")
        try:
            mi, ni, s = int(m), int(n), float(sec)
        except ValueError:
            raise HardwareError(f"{p}:{i}: m, n must be integers and seconds a number") from None
        if mi < 1 or ni < 1 or not (s > 0 and math.isfinite(s)):
            raise HardwareError(f"{p}:{i}: m, n must be >= 1 and seconds > 0")
        rows.append((opt, mi, ni, dt, s))
    if not rows:
        raise HardwareError(f"{p}: no timing rows")
    return rows


def calibrate(hw: HardwareProfile, csv_path: str | Path) -> HardwareProfile:
    """Replace the assumed optimizer-matmul efficiency constants by a fit to measured timings."""
    rows = read_timings_csv(csv_path)
    emax, half, err = fit_matrix_throughput(rows, hw)
    src = f"fitted to {len(rows)} measured timings in {Path(csv_path).name} (rms relative error {err:.1%})"
    return hw.with_values(
        ns_efficiency_max=Constant(emax, src),
        ns_efficiency_half_dim=Constant(half, src),
    )
