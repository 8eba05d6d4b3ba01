"""Overlap stages and the cost model that sizes them.

Each rank's remote keys are split into ``degree`` stages of about equal size (in global key order). The
distributed layer runs, per rank: host FFA || fetch stage 0; then FFA on stage i-1 || fetch stage i; then FFA
on the last stage. The collectives run back to back on their own stream from the start (none depends on an
attention call) and end together on every rank; a rank's stage-i call starts once its previous call is done
and stage i's keys have landed:

    land_i = sum_{j<=i} comm_j;   t_r = host_r;   t_r = max(t_r, land_i) + comp_{r,i} for i = 0..d-1
    T = max_r t_r

with ``comm_i = latency + key_seconds * max_r max(received_r,i, sent_r,i)`` and ``comp = launch +
cell_seconds * area``. No rank waits for another's compute: a rank whose host part is large and one whose
remote part is large overlap in time (a bulk-synchronous sum of per-stage maxima would not see that, and
would wrongly prefer degree 0). Degree 0 fetches everything first and runs one fused call:
``T = comm_all + max_r (host_r + remote_r)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

MAX_DEGREE = 8


@dataclass(frozen=True)
class CostModel:
    """Calibratable constants. Defaults: one H200, bf16 (PEERS.md: FFA-class kernels reach 450-600 TFLOP/s
    forward on masked cells; all_to_all moves 266 GB/s per rank over NVLink). Measured ones, per mask
    class: bench/calibrate.py writes them to a file that ``CostModel.load`` reads."""

    flops_per_s: float = 450e12          # attention forward, counting unmasked cells only
    bytes_per_s: float = 250e9           # per rank, inter-GPU
    collective_latency_s: float = 25e-6  # fixed cost of one collective
    launch_s: float = 10e-6              # fixed cost of one attention call
    dtype_bytes: int = 2

    def cell_seconds(self, num_heads_q: int, head_dim: int, head_dim_v: int | None = None) -> float:
        """Forward seconds per unmasked cell: q k^T at head_dim, p v at head_dim_v (default head_dim)."""
        dv = head_dim if head_dim_v is None else head_dim_v
        return 2.0 * num_heads_q * (head_dim + dv) / self.flops_per_s

    def key_seconds(self, num_heads_kv: int, head_dim: int, head_dim_v: int | None = None) -> float:
        """Seconds per key moved: K and V travel packed, both at the wider of the two head dims."""
        width = head_dim if head_dim_v is None else max(head_dim, head_dim_v)
        return 2.0 * num_heads_kv * width * self.dtype_bytes / self.bytes_per_s

    @classmethod
    def calibrated(cls, *, attn_cells: float, attn_seconds: float, num_heads_q: int, head_dim: int,
                   comm_bytes: float, comm_seconds: float, head_dim_v: int | None = None, **kw) -> "CostModel":
        """From one measured attention call (cells, seconds; v at head_dim_v, default head_dim) and one
        measured transfer (bytes per rank, seconds); ``kw`` overrides the remaining fields."""
        if min(attn_cells, attn_seconds, comm_bytes, comm_seconds) <= 0:
            raise ValueError("calibrated: cells, bytes and seconds must be positive")
        dv = head_dim if head_dim_v is None else head_dim_v
        return cls(flops_per_s=2.0 * num_heads_q * (head_dim + dv) * attn_cells / attn_seconds,
                   bytes_per_s=comm_bytes / comm_seconds, **kw)

    @classmethod
    def load(cls, path: str | os.PathLike, mask_class: str | None = None) -> "CostModel":
        """The model of ``mask_class`` in a calibration file (``save_calibration``, written by
        bench/calibrate.py); ``mask_class`` may be left out when the file holds one class."""
        classes = load_calibration(path)[0]
        if mask_class is None:
            if len(classes) == 1:
                return next(iter(classes.values()))
            raise ValueError(f"mask_class: calibration file {path} holds {sorted(classes)}; name one")
        if mask_class not in classes:
            raise ValueError(f"mask_class: {mask_class!r} is not in calibration file {path} "
                             f"(it holds {sorted(classes)})")
        return classes[mask_class]

    def save(self, path: str | os.PathLike, mask_class: str, **meta: Any) -> pathlib.Path:
        """Writes a calibration file holding this model as ``mask_class`` (and ``meta``)."""
        return save_calibration(path, {mask_class: self}, **meta)


_COST_FIELDS = tuple(f.name for f in dataclasses.fields(CostModel))


def save_calibration(path: str | os.PathLike, models: Mapping[str, CostModel], **meta: Any) -> pathlib.Path:
    """Writes ``{"classes": {mask class: CostModel fields}, **meta}`` as JSON (folders created); ``meta``
    records where the numbers come from (device, versions, date, command, measurements)."""
    if not models:
        raise ValueError("models: at least one mask class is needed")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"classes": {name: dataclasses.asdict(m) for name, m in models.items()}, **meta}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


# Calibrations measured on the lent machines (bench/calibrate.py), loadable by name: "NVIDIA_H200_x2".
STORED_CALIBRATIONS = pathlib.Path(__file__).parent / "calibration"


def stored_calibrations() -> list[str]:
    """The names of the calibration files shipped with the package."""
    return sorted(p.stem for p in STORED_CALIBRATIONS.glob("*.json"))


def load_calibration(path: str | os.PathLike) -> tuple[dict[str, CostModel], dict[str, Any]]:
    """(models by mask class, the other top-level entries) of a file written by ``save_calibration``, or of a
    stored one named without folder or suffix (``stored_calibrations()``); a missing file, bad JSON or a
    missing, unknown or non-positive field is a ValueError naming the file."""
    if not pathlib.Path(path).exists() and str(path) in stored_calibrations():
        path = STORED_CALIBRATIONS / f"{path}.json"
    where = f"calibration file {path}"
    try:
        doc = json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: not found (stored ones: {stored_calibrations()})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: not readable as JSON ({e})") from None
    classes = doc.get("classes") if isinstance(doc, dict) else None
    if not isinstance(classes, dict) or not classes:
        raise ValueError(f"{where}: expected an object with a non-empty \"classes\" object")
    models = {name: _cost_model(fields, f"{where}: classes.{name}") for name, fields in classes.items()}
    return models, {k: v for k, v in doc.items() if k != "classes"}


def _cost_model(fields: Any, where: str) -> CostModel:
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: expected an object of {list(_COST_FIELDS)}")
    missing = [f for f in _COST_FIELDS if f not in fields]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    unknown = sorted(set(fields) - set(_COST_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown} (expected {list(_COST_FIELDS)})")
    for name, v in fields.items():
        fixed_cost = name in ("collective_latency_s", "launch_s")      # may be 0; rates and sizes may not
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
              and (v >= 0 if fixed_cost else v > 0))
        if not ok or (name == "dtype_bytes" and v != int(v)):
            raise ValueError(f"{where}.{name}: expected a {'non-negative' if fixed_cost else 'positive'} "
                             f"{'integer' if name == 'dtype_bytes' else 'number'}, got {v!r}")
    return CostModel(**{**fields, "dtype_bytes": int(fields["dtype_bytes"])})


@dataclass(frozen=True)
class StageTiming:
    """Predicted seconds of one stage split (arrays per stage i = 0..d-1, per rank r)."""

    degree: int
    total: float               # time of the whole forward call (the slowest rank)
    host: np.ndarray           # [cp] host compute
    comm: np.ndarray           # [d] collective of stage i
    comp: np.ndarray           # [d, cp] compute of stage i
    per_rank: np.ndarray       # [cp] each rank's finish time


def assign_stages(dst: np.ndarray, start: np.ndarray, tokens: np.ndarray, cp: int, degree: int
                  ) -> np.ndarray:
    """Stage of every remote piece: each rank's pieces in global order cut into ``degree`` parts of about
    equal key count (a piece goes where its middle falls). Rank r starts at stage ``degree * r / cp`` and
    wraps around: keys many ranks need (a long document's first chunks) then leave their owner spread
    over the stages instead of all in stage 0."""
    if degree <= 1 or len(dst) == 0:
        return np.zeros(len(dst), np.int64)
    order = np.lexsort((start, dst))
    d, tok = dst[order], tokens[order].astype(np.float64)
    total = np.bincount(d, weights=tok, minlength=cp)
    before = np.cumsum(tok) - tok
    before -= before[np.searchsorted(d, d, side="left")]      # keys of the same rank placed before
    frac = ((before + tok / 2) / total[d] + d / cp) % 1.0
    stage = np.minimum(degree - 1, np.floor(degree * frac).astype(np.int64))
    out = np.empty(len(dst), np.int64)
    out[order] = stage
    return out


def stage_timing(degree: int, cp: int, host_area: np.ndarray, dst: np.ndarray, src: np.ndarray,
                 tokens: np.ndarray, area: np.ndarray, stage: np.ndarray, cell_s: float, key_s: float,
                 model: CostModel) -> StageTiming:
    host = model.launch_s + cell_s * host_area
    d = max(degree, 1)
    recv = np.zeros((d, cp))
    send = np.zeros((d, cp))
    comp_area = np.zeros((d, cp))
    np.add.at(recv, (stage, dst), tokens)
    np.add.at(send, (stage, src), tokens)
    np.add.at(comp_area, (stage, dst), area)
    if len(dst) == 0:                     # nothing to fetch: one call on host slices
        z = np.zeros(0)
        return StageTiming(0, float(host.max()), host, z, np.zeros((0, cp)), host)
    rank_comm = model.collective_latency_s + key_s * np.maximum(recv, send)      # [d, cp]
    comm = rank_comm.max(axis=1)
    comp = cell_s * comp_area if degree == 0 else model.launch_s + cell_s * comp_area
    per_rank = finish_times(host, comm, comp, fused=degree == 0)
    return StageTiming(degree, float(per_rank.max()), host, comm, comp, per_rank)


def finish_times(host: np.ndarray, comm: np.ndarray, comp: np.ndarray, fused: bool) -> np.ndarray:
    """Each rank's finish time from the seconds of its parts (the module docstring's recurrence): host [cp],
    comm [d], comp [d, cp]. ``fused`` (degree 0): one fetch, then one call of host + comp[0] seconds.
    Also composes measured parts (bench/calibrate.py), to tell a wrong rate from a wrong schedule."""
    if fused:
        return comm[0] + host + comp[0]
    landed = np.cumsum(comm)
    per_rank = host
    for i in range(len(comm)):
        per_rank = np.maximum(per_rank, landed[i]) + comp[i]
    return per_rank
