"""A seeded, reproducible simulated plant: batch runs of a process for the demo, tests, benchmarks.

The process (per run, continuous time, simulated on a grid of ``dt = min sampling period / 2``)

* **Controls** (``FIC200_SP``, ``FIC201_SP``, ... kg/h, range [0, 50]): operator setpoints,
  piecewise constant. Each run starts at a random value in [15, 35]; steps arrive as a Poisson
  process (mean interval :data:`STEP_INTERVAL_S` s, the first after 30 s) with a normal step
  (sd :data:`STEP_SD`), clipped to [5, 45] and quantised to 0.5 kg/h.
* **Features / disturbances** (``TI900`` ambient temperature degC, ``AI910`` feed composition %,
  ...): slow mean-reverting random walks (Ornstein-Uhlenbeck: white noise through a first-order
  lag of ``tau_s``, stationary sd ``sd``) around a per-run offset.
* **Targets** (``TI101`` degC, ``QI301`` %, ...): first-order-plus-dead-time responses::

      v_i(t) = bias_i + sum_c K[i, c] * u_c(t - theta[i, c]) + sum_f G[i, f] * (d_f(t) - mean_f)
      tau_i * dy_i/dt = v_i(t) - y_i(t)          (exact zero-order-hold discretisation)

  starting at steady state. The constants for the first two targets are :data:`TARGET_DEFS`
  (TI101: K = [+1.2, -0.6] degC per kg/h, theta = [8, 15] s, G = [+0.4, +0.15], tau = 45 s;
  QI301: K = [+0.3, +0.5] % per kg/h, theta = [20, 30] s, G = [-0.1, -0.3], tau = 90 s).
  Further targets/controls/features get constants from a fixed structural generator (the same
  for every ``seed``: the seed varies runs, not the plant). Everything is linear, so a linear
  model on history + future controls can learn it.

What the historian records (each a knob of :func:`simulate_plant`)

* sampling per node: controls every ``base_rate_ms`` (1 s); the last ``on_change_controls``
  controls only on change plus a heartbeat every :data:`HEARTBEAT_MS` (spec: ``interp: hold``,
  ``hampelK: 0``, ``maxInterpMs`` above the heartbeat); targets alternately every 1x / 2x
  ``base_rate_ms``; features alternately every 2x / 0.5x ``base_rate_ms``;
* timestamp jitter: each node of each run draws an amplitude in ``jitter_ms`` (50-200 ms) and
  each sample is shifted uniformly within +-amplitude (less than half a period);
* gaussian sensor noise (controls are exact);
* on measured nodes (targets, features): spikes (+-4..8 % of the node's span, inside the range:
  Hampel's job), bad-quality bursts (state 1 = uncertain or 2 = bad, half of the bad ones with a
  NaN value), rare out-of-range sentinel readings (-9999 with state 0: the range check's job),
  dropouts (short: the gap between the surrounding points is 2.5-5 s, below the default
  ``maxInterpMs``; long: 8-60 s of samples removed),
  and re-sent duplicates (same run, node and ts, right after the original; half of them with a
  corrected value: dedup keeps the highest seq);
* runs: ``run_minutes`` long, 5-15 min apart, ``evidence_source="simulation"``, recipe version
  and content hash, ``context_confirmed`` except ``unconfirmed_runs``; with
  ``unfinished_last_run`` the last run is still in progress (``ended_at=None``) and has data for
  the first 60 % of its nominal length.

Ground truth comes with the plant: per-point ``labels`` (spike, bad_state, duplicate,
out_of_range), the noise-free ``true_value`` and the list of ``dropouts``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from aml_pipeline.tsdb.port import Node, PointColumns, Run

DEFAULT_START_MS = 1_735_718_400_000  # 2025-01-01T08:00:00Z
STEP_INTERVAL_S = 150.0  # mean time between setpoint steps
STEP_SD = 6.0  # kg/h, sd of a setpoint step
HEARTBEAT_MS = 10_000  # on-change logged setpoints are re-logged at least this often
CONTROL_OPERATING = (5.0, 45.0)  # setpoints stay inside; node range is [0, 50]
SETPOINT_QUANTUM = 0.5
SENTINEL = -9999.0  # what a failed transmitter reports (with state 0)
STATE_UNCERTAIN, STATE_BAD = 1, 2
UNFINISHED_FRACTION = 0.6
SHORT_DROPOUT_MS = (2500, 5000)  # gap between the points around a short dropout
LONG_DROPOUT_MS = (8000, 60000)  # removed span of a long dropout


@dataclass(frozen=True)
class TargetDef:
    node_id: str
    unit: str
    range: tuple[float, float]
    level: float  # mean output at mid-range inputs
    tau_s: float
    noise_sd: float
    gains: tuple[float, ...]  # K per control (first controls)
    dead_s: tuple[float, ...]  # theta per control
    dist_gains: tuple[float, ...]  # G per feature


@dataclass(frozen=True)
class FeatureDef:
    node_id: str
    unit: str
    range: tuple[float, float]
    mean: float
    sd: float  # stationary sd of the random walk within a run
    run_sd: float  # sd of the per-run offset
    tau_s: float  # correlation time of the random walk
    noise_sd: float


TARGET_DEFS = (
    TargetDef("TI101", "degC", (0.0, 150.0), 55.0, 45.0, 0.10, (1.2, -0.6), (8.0, 15.0), (0.4, 0.15)),
    TargetDef("QI301", "%", (0.0, 100.0), 70.0, 90.0, 0.20, (0.3, 0.5), (20.0, 30.0), (-0.1, -0.3)),
)
FEATURE_DEFS = (
    FeatureDef("TI900", "degC", (-30.0, 50.0), 15.0, 1.5, 3.0, 900.0, 0.05),
    FeatureDef("AI910", "%", (0.0, 100.0), 50.0, 2.0, 3.0, 300.0, 0.10),
)


@dataclass(frozen=True)
class Dropout:
    run_id: str
    node_id: str
    before_ts: int  # last point before the hole
    after_ts: int  # first point after it

    @property
    def gap_ms(self) -> int:
        return self.after_ts - self.before_ts


@dataclass
class SimulatedPlant:
    runs: list[Run]
    nodes: list[Node]
    points: PointColumns
    roles: dict[str, str]  # node_id -> "control" | "target" | "feature"
    period_ms: dict[str, int]  # nominal sampling period (heartbeat for on-change nodes)
    logging: dict[str, str]  # node_id -> "periodic" | "on_change"
    labels: dict[str, np.ndarray] = field(default_factory=dict)  # per point, bool
    true_value: np.ndarray | None = None  # noise-free value per point (NaN for sentinels)
    dropouts: list[Dropout] = field(default_factory=list)
    seed: int = 0

    @property
    def control_ids(self) -> list[str]:
        return [n for n, r in self.roles.items() if r == "control"]

    @property
    def target_ids(self) -> list[str]:
        return [n for n, r in self.roles.items() if r == "target"]

    @property
    def feature_ids(self) -> list[str]:
        return [n for n, r in self.roles.items() if r == "feature"]


# ---- plant structure -----------------------------------------------------------------------


def _control_ids(n: int) -> list[str]:
    return [f"FIC{200 + c}_SP" for c in range(n)]


def _target_defs(n_targets: int, n_controls: int, n_features: int) -> list[TargetDef]:
    out = []
    for i in range(n_targets):
        base = TARGET_DEFS[i % 2]
        rng = np.random.default_rng(10_007 + i)  # structural, independent of the seed
        gains = [
            base.gains[c] if i < 2 and c < 2 else float(rng.choice([-1, 1]) * rng.uniform(0.2, 1.0))
            for c in range(n_controls)
        ]
        dead = [
            base.dead_s[c] if i < 2 and c < 2 else float(rng.integers(5, 31)) for c in range(n_controls)
        ]
        dist = [
            base.dist_gains[f] if i < 2 and f < 2 else float(rng.choice([-1, 1]) * rng.uniform(0.05, 0.4))
            for f in range(n_features)
        ]
        prefix = base.node_id[:2]
        number = int(base.node_id[2:]) + i // 2
        out.append(
            TargetDef(
                f"{prefix}{number}",
                base.unit,
                base.range,
                base.level,
                base.tau_s if i < 2 else float(rng.uniform(30, 120)),
                base.noise_sd,
                tuple(gains),
                tuple(dead),
                tuple(dist),
            )
        )
    return out


def _feature_defs(n: int) -> list[FeatureDef]:
    out = []
    for f in range(n):
        base = FEATURE_DEFS[f % 2]
        prefix = base.node_id[:2]
        number = int(base.node_id[2:]) + f // 2
        out.append(
            FeatureDef(f"{prefix}{number}", base.unit, base.range, base.mean, base.sd, base.run_sd, base.tau_s, base.noise_sd)
        )
    return out


# ---- numerics ----------------------------------------------------------------------------


def first_order(v: np.ndarray, a: float, y0: float) -> np.ndarray:
    """``y[0] = y0; y[k] = a*y[k-1] + (1-a)*v[k-1]`` without a Python loop over steps.

    Uses ``y[s+m] = a^m (y[s] + (1-a) * sum_{j<m} a^-(j+1) v[s+j])`` in blocks short enough that
    ``a^-m`` stays far from overflow.
    """
    v = np.asarray(v, dtype=np.float64)
    n = v.shape[0]
    y = np.empty(n, dtype=np.float64)
    if n == 0:
        return y
    y[0] = y0
    if not 0.0 < a < 1.0:
        raise ValueError(f"filter coefficient must be in (0, 1), got {a}")
    block = max(1, min(n, int(300.0 / -math.log(a))))
    inv = a ** -np.arange(1, block + 1, dtype=np.float64)  # a^-(j+1)
    s = 0
    while s < n - 1:
        m = min(block, n - 1 - s)
        cums = np.cumsum(v[s : s + m] * inv[:m])
        y[s + 1 : s + m + 1] = (y[s] + (1.0 - a) * cums) / inv[:m]
        s += m
    return y


def _step_schedule(rng: np.random.Generator, start: int, end: int, init: float) -> tuple[np.ndarray, np.ndarray]:
    """Setpoint step times (first = run start) and values."""
    times, values = [start], [init]
    t = start + 30_000 + rng.exponential(STEP_INTERVAL_S * 1000)
    lo, hi = CONTROL_OPERATING
    while t < end:
        new = values[-1] + rng.normal(0.0, STEP_SD)
        new = float(np.clip(np.round(new / SETPOINT_QUANTUM) * SETPOINT_QUANTUM, lo, hi))
        if new != values[-1]:
            times.append(int(t))
            values.append(new)
        t += rng.exponential(STEP_INTERVAL_S * 1000)
    return np.asarray(times, dtype=np.int64), np.asarray(values, dtype=np.float64)


def _hold(times: np.ndarray, values: np.ndarray, t: np.ndarray) -> np.ndarray:
    idx = np.searchsorted(times, t, side="right") - 1
    return values[np.clip(idx, 0, None)]


def _periodic_times(rng: np.random.Generator, start: int, end: int, period: int, jitter: float) -> np.ndarray:
    phase = rng.uniform(0, period)
    nominal = start + phase + period * np.arange(int((end - start - phase) // period) + 1)
    ts = np.rint(nominal + rng.uniform(-jitter, jitter, nominal.shape[0])).astype(np.int64)
    return np.clip(ts, start, end)


# ---- the simulator -----------------------------------------------------------------------


def simulate_plant(
    *,
    n_runs: int = 12,
    run_minutes: float = 20,
    seed: int = 0,
    line_id: str = "L1",
    product_id: str = "P100",
    recipe_id: str = "R7",
    start_ms: int = DEFAULT_START_MS,
    n_controls: int = 2,
    n_targets: int = 2,
    n_features: int = 2,
    base_rate_ms: int = 1000,
    on_change_controls: int = 1,
    recipe_version: int = 3,
    unfinished_last_run: bool = True,
    unconfirmed_runs: Sequence[int] = (2,),
    jitter_ms: tuple[float, float] = (50.0, 200.0),
    noise: bool = True,
    spike_rate: float = 0.002,
    bad_state_rate: float = 0.001,
    out_of_range_rate: float = 0.0002,
    duplicate_rate: float = 0.0005,
    short_dropouts_per_hour: float = 6.0,
    long_dropouts_per_hour: float = 3.0,
    run_gap_minutes: tuple[float, float] = (5.0, 15.0),
) -> SimulatedPlant:
    """Simulate ``n_runs`` batch runs (see the module docstring for the process and artifacts).

    Reproducible: the same arguments give identical arrays. Rates are per recorded point of a
    measured node (targets, features); dropout counts are per run and hour (at least one short
    and one long per run when the rate is > 0). Set the rates to 0, ``noise=False`` and
    ``jitter_ms=(0, 0)`` for an ideal plant.
    """
    if n_runs < 1 or n_targets < 1 or n_controls < 0 or n_features < 0:
        raise ValueError("need n_runs >= 1, n_targets >= 1, n_controls >= 0, n_features >= 0")
    if base_rate_ms < 2:
        raise ValueError("base_rate_ms must be >= 2")
    rng = np.random.default_rng(seed)
    run_ms = int(round(run_minutes * 60_000))
    controls = _control_ids(n_controls)
    targets = _target_defs(n_targets, n_controls, n_features)
    features = _feature_defs(n_features)
    on_change = set(controls[len(controls) - max(0, min(on_change_controls, n_controls)) :])

    nodes: list[Node] = []
    roles: dict[str, str] = {}
    period: dict[str, int] = {}
    logging: dict[str, str] = {}
    for c in controls:
        nodes.append(Node(c, "kg/h", 0.0, 50.0))
        roles[c] = "control"
        period[c] = HEARTBEAT_MS if c in on_change else base_rate_ms
        logging[c] = "on_change" if c in on_change else "periodic"
    for i, t in enumerate(targets):
        nodes.append(Node(t.node_id, t.unit, *t.range))
        roles[t.node_id] = "target"
        period[t.node_id] = base_rate_ms * (1 if i % 2 == 0 else 2)
        logging[t.node_id] = "periodic"
    for f, d in enumerate(features):
        nodes.append(Node(d.node_id, d.unit, *d.range))
        roles[d.node_id] = "feature"
        period[d.node_id] = base_rate_ms * 2 if f % 2 == 0 else base_rate_ms // 2
        logging[d.node_id] = "periodic"
    node_index = {n.node_id: k for k, n in enumerate(nodes)}
    span = {n.node_id: float(n.range_hi - n.range_lo) for n in nodes}
    dt = max(1, min(period.values()) // 2)

    recipe_hash = hashlib.sha256(f"{recipe_id}:v{recipe_version}".encode()).hexdigest()
    unconfirmed = {i for i in unconfirmed_runs if 0 <= i < n_runs}

    runs: list[Run] = []
    parts: list[dict[str, np.ndarray]] = []
    dropouts: list[Dropout] = []
    t0 = int(start_ms)
    for r in range(n_runs):
        run_id = f"{line_id}-{product_id}-{r + 1:04d}"
        running = unfinished_last_run and r == n_runs - 1
        started = t0
        ended = None if running else started + run_ms
        data_end = started + (int(run_ms * UNFINISHED_FRACTION) if running else run_ms)
        runs.append(
            Run(
                run_id=run_id,
                line_id=line_id,
                product_id=product_id,
                recipe_id=recipe_id,
                recipe_version=recipe_version,
                recipe_content_hash=recipe_hash,
                started_at=started,
                ended_at=ended,
                evidence_source="simulation",
                context_confirmed=r not in unconfirmed,
            )
        )
        t0 = started + run_ms + int(rng.uniform(*run_gap_minutes) * 60) * 1000

        # -- latent signals on the simulation grid
        grid = started + dt * np.arange((data_end - started) // dt + 1, dtype=np.int64)
        steps = [
            _step_schedule(rng, started, data_end, float(np.round(rng.uniform(15, 35) / SETPOINT_QUANTUM) * SETPOINT_QUANTUM))
            for _ in controls
        ]
        dist: list[np.ndarray] = []
        for d in features:
            a = math.exp(-dt / (d.tau_s * 1000))
            w = rng.normal(0.0, 1.0, grid.shape[0]) * d.sd * math.sqrt((1 + a) / (1 - a))
            walk = first_order(w, a, rng.normal(0.0, d.sd))
            dist.append(d.mean + rng.normal(0.0, d.run_sd) + walk)
        signal: dict[str, np.ndarray] = {}
        for i, t in enumerate(targets):
            v = np.full(grid.shape[0], t.level - sum(k * 25.0 for k in t.gains))
            for c in range(n_controls):
                v += t.gains[c] * _hold(*steps[c], grid - int(t.dead_s[c] * 1000))
            for f, d in enumerate(features):
                v += t.dist_gains[f] * (dist[f] - d.mean)
            a = math.exp(-dt / (t.tau_s * 1000))
            signal[t.node_id] = first_order(v, a, float(v[0]))
        for f, d in enumerate(features):
            signal[d.node_id] = dist[f]

        # -- what the historian records
        for node in nodes:
            nid = node.node_id
            jit = rng.uniform(*jitter_ms) if jitter_ms[1] > 0 else 0.0
            jit = min(jit, period[nid] * 0.4)
            if roles[nid] == "control":
                c = controls.index(nid)
                times, values = steps[c]
                if nid in on_change:
                    beats = _periodic_times(rng, started, data_end, HEARTBEAT_MS, jit)
                    changes = np.clip(times + np.rint(rng.uniform(0, jit, times.shape[0])).astype(np.int64), started, data_end)
                    ts = np.unique(np.concatenate([beats, changes]))
                    val = _hold(times, values, ts)
                else:
                    ts = _periodic_times(rng, started, data_end, period[nid], jit)
                    val = _hold(times, values, ts)
                truth = val.copy()
                part = _part(ts, val, truth, node_index[nid])
            else:
                ts = _periodic_times(rng, started, data_end, period[nid], jit)
                truth = np.interp(ts, grid, signal[nid])
                sd = next(x.noise_sd for x in (*targets, *features) if x.node_id == nid)
                val = truth + (rng.normal(0.0, sd, ts.shape[0]) if noise else 0.0)
                part = _part(ts, val, truth, node_index[nid])
                _artifacts(
                    rng, part, span[nid], spike_rate, bad_state_rate, out_of_range_rate, duplicate_rate
                )
            parts.append(_with_run(part, r))

        # -- dropouts: cut holes into measured nodes of this run
        hours = (data_end - started) / 3_600_000
        measured = [n.node_id for n in nodes if roles[n.node_id] != "control"]
        run_parts = parts[-len(nodes) :]
        for kind, rate in (("short", short_dropouts_per_hour), ("long", long_dropouts_per_hour)):
            if rate <= 0 or not measured:
                continue
            count = max(1, int(rng.poisson(rate * hours)))
            for _ in range(count):
                nid = measured[int(rng.integers(len(measured)))]
                hole = _cut_dropout(rng, run_parts[node_index[nid]], kind, period[nid])
                if hole is not None:
                    run_parts[node_index[nid]] = hole[0]
                    dropouts.append(Dropout(run_id, nid, *hole[1]))
        parts[-len(nodes) :] = run_parts

    points, labels, truth = _assemble(parts, runs, nodes)
    return SimulatedPlant(
        runs=runs,
        nodes=nodes,
        points=points,
        roles=roles,
        period_ms=period,
        logging=logging,
        labels=labels,
        true_value=truth,
        dropouts=dropouts,
        seed=seed,
    )


_LABELS = ("spike", "bad_state", "out_of_range", "duplicate")


def _part(ts: np.ndarray, val: np.ndarray, truth: np.ndarray, node: int) -> dict[str, np.ndarray]:
    n = ts.shape[0]
    part = {
        "ts": ts.astype(np.int64),
        "value": np.asarray(val, dtype=np.float64),
        "truth": np.asarray(truth, dtype=np.float64),
        "state": np.zeros(n, dtype=np.int32),
        "node": np.full(n, node, dtype=np.int32),
    }
    for name in _LABELS:
        part[name] = np.zeros(n, dtype=bool)
    return part


def _with_run(part: dict[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
    part["run"] = np.full(part["ts"].shape[0], r, dtype=np.int32)
    return part


def _artifacts(
    rng: np.random.Generator,
    part: dict[str, np.ndarray],
    span: float,
    spike_rate: float,
    bad_rate: float,
    oor_rate: float,
    dup_rate: float,
) -> None:
    n = part["ts"].shape[0]
    if n < 30:
        return
    free = np.ones(n, dtype=bool)
    free[:10] = free[-10:] = False  # keep the ends clean (Hampel windows shrink there)

    def pick(rate: float) -> np.ndarray:
        k = int(rng.binomial(n, rate)) if rate > 0 else 0
        cand = np.flatnonzero(free)
        if k == 0 or cand.size == 0:
            return np.empty(0, dtype=np.int64)
        idx = np.sort(rng.choice(cand, size=min(k, cand.size), replace=False))
        # no two artifacts within 6 samples: each spike must stand alone in its Hampel window
        keep = np.concatenate([[True], np.diff(idx) > 6]) if idx.size else idx.astype(bool)
        idx = idx[keep]
        for d in range(-6, 7):
            free[np.clip(idx + d, 0, n - 1)] = False
        return idx

    spikes = pick(spike_rate)
    part["value"][spikes] += rng.choice([-1.0, 1.0], spikes.size) * rng.uniform(0.04, 0.08, spikes.size) * span
    part["spike"][spikes] = True

    oor = pick(oor_rate)
    part["value"][oor] = SENTINEL
    part["truth"][oor] = np.nan
    part["out_of_range"][oor] = True

    for i in pick(bad_rate):
        length = int(rng.integers(1, 6))
        sl = slice(i, min(n - 10, i + length))
        state = STATE_BAD if rng.random() < 0.5 else STATE_UNCERTAIN
        part["state"][sl] = state
        part["bad_state"][sl] = True
        if state == STATE_BAD and rng.random() < 0.5:
            part["value"][sl] = np.nan
        free[max(0, i - 6) : min(n, i + length + 6)] = False

    dups = pick(dup_rate)
    if dups.size:
        corrected = rng.random(dups.size) < 0.5
        new_val = part["value"][dups] + np.where(corrected, rng.normal(0, 0.5, dups.size) * span * 0.002, 0.0)
        for name, arr in list(part.items()):
            extra = arr[dups].copy()
            if name == "value":
                extra = new_val
            elif name in _LABELS:
                extra = np.zeros(dups.size, dtype=bool)
            part[name] = np.concatenate([arr, extra])
        part["duplicate"][n:] = True


def _cut_dropout(
    rng: np.random.Generator, part: dict[str, np.ndarray], kind: str, period: int
) -> tuple[dict[str, np.ndarray], tuple[int, int]] | None:
    """Remove a run of consecutive samples; short holes keep the gap < 5000 ms, long are 8-60 s."""
    order = np.argsort(part["ts"], kind="stable")
    ts = part["ts"][order]
    uniq = np.unique(ts)
    n = uniq.shape[0]
    if n < 40:
        return None
    if kind == "short":
        # gap ~ (m + 1) * period (+ jitter): between SHORT_DROPOUT_MS and 5000 ms, checked below
        min_remove = max(1, -(-SHORT_DROPOUT_MS[0] // period) - 1)
        max_remove = int(4600 // period) - 1
        if max_remove < min_remove:
            return None
        m = int(rng.integers(min_remove, max_remove + 1))
    else:
        m = max(1, int(rng.uniform(*LONG_DROPOUT_MS) // period))
    if n - 20 - m <= 20:
        return None
    first = int(rng.integers(20, n - 20 - m))
    lo, hi = uniq[first], uniq[first + m - 1]
    # never cut into a labelled artifact (keeps the ground truth simple)
    inside = (part["ts"] >= lo) & (part["ts"] <= hi)
    if any(part[name][inside].any() for name in _LABELS):
        return None
    before, after = int(uniq[first - 1]), int(uniq[first + m])
    if kind == "short" and not SHORT_DROPOUT_MS[0] <= after - before < SHORT_DROPOUT_MS[1]:
        return None
    keep = ~inside
    return {k: v[keep] for k, v in part.items()}, (before, after)


def _assemble(
    parts: list[dict[str, np.ndarray]], runs: list[Run], nodes: list[Node]
) -> tuple[PointColumns, dict[str, np.ndarray], np.ndarray]:
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    # File order: by run, then time, then node; a re-sent duplicate right after its original.
    order = np.lexsort((cat["duplicate"], cat["node"], cat["ts"], cat["run"]))
    cat = {k: v[order] for k, v in cat.items()}
    run_ids = np.asarray([r.run_id for r in runs], dtype=object)
    node_ids = np.asarray([n.node_id for n in nodes], dtype=object)
    points = PointColumns(
        run_id=run_ids[cat["run"]],
        node_id=node_ids[cat["node"]],
        ts=cat["ts"],
        value=cat["value"],
        state=cat["state"],
    )
    labels = {name: cat[name] for name in _LABELS}
    return points, labels, cat["truth"]


# ---- files and spec ----------------------------------------------------------------------


def plant_tables(plant: SimulatedPlant) -> dict[str, pa.Table]:
    """The plant as Arrow tables with the columns of docs/ingest.md (points, runs, nodes)."""
    p = plant.points
    points = pa.table(
        {
            "run_id": pa.array(p.run_id, type=pa.string()),
            "node_id": pa.array(p.node_id, type=pa.string()),
            "ts": pa.array(p.ts, type=pa.int64()),
            "value": pa.array(p.value, type=pa.float64()),
            "state": pa.array(p.state, type=pa.int32()),
        }
    )
    runs = pa.table(
        {
            "run_id": [r.run_id for r in plant.runs],
            "line_id": [r.line_id for r in plant.runs],
            "product_id": [r.product_id for r in plant.runs],
            "recipe_id": [r.recipe_id for r in plant.runs],
            "recipe_version": pa.array([r.recipe_version for r in plant.runs], type=pa.int32()),
            "recipe_content_hash": pa.array([r.recipe_content_hash for r in plant.runs], type=pa.string()),
            "started_at": pa.array([r.started_at for r in plant.runs], type=pa.int64()),
            "ended_at": pa.array([r.ended_at for r in plant.runs], type=pa.int64()),
            "evidence_source": [r.evidence_source for r in plant.runs],
            "context_confirmed": pa.array([r.context_confirmed for r in plant.runs], type=pa.bool_()),
        }
    )
    nodes = pa.table(
        {
            "node_id": [n.node_id for n in plant.nodes],
            "unit": [n.unit for n in plant.nodes],
            "range_lo": pa.array([n.range_lo for n in plant.nodes], type=pa.float64()),
            "range_hi": pa.array([n.range_hi for n in plant.nodes], type=pa.float64()),
        }
    )
    return {"points": points, "runs": runs, "nodes": nodes}


def write_plant_files(plant: SimulatedPlant, directory: str | Path, fmt: str = "csv") -> dict[str, Path]:
    """Write ``points``, ``runs`` and ``nodes`` files (``csv`` or ``parquet``) for ``ingest``."""
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"fmt must be 'csv' or 'parquet', got {fmt!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for name, table in plant_tables(plant).items():
        path = directory / f"{name}.{fmt}"
        if fmt == "csv":
            pacsv.write_csv(table, path)
        else:
            pq.write_table(table, path)
        out[name] = path
    return out


def plant_spec_dict(
    plant: SimulatedPlant,
    spec_id: str = "reactor_a",
    *,
    history_steps: int = 60,
    horizon_steps: int = 30,
    beat_ms: int = 1000,
    max_interp_ms: int = 5000,
    stride: int = 1,
    split: dict[str, Any] | None = None,
    cleaning: dict[str, Any] | None = None,
    extras: bool = False,
    note: str = "simulated plant",
) -> dict[str, Any]:
    """A dataset spec (camelCase, docs/spec.md) over the plant's nodes.

    Node order: targets, controls, features. Controls: ``interp: hold``, ``hampelK: 0``, their
    catalog range, and for on-change logged ones ``maxInterpMs`` just above the heartbeat.
    ``extras=True`` adds the v2 extras (recipe version/hash of the first run, and one variable
    per node: degC -> K, everything else identity).
    """
    first = plant.runs[0]
    catalog = {n.node_id: n for n in plant.nodes}
    spec_nodes: list[dict[str, Any]] = []
    for nid in plant.target_ids:
        spec_nodes.append({"nodeId": nid, "role": "target"})
    for nid in plant.control_ids:
        n = catalog[nid]
        entry: dict[str, Any] = {
            "nodeId": nid,
            "role": "control",
            "interp": "hold",
            "range": [n.range_lo, n.range_hi],
            "hampelK": 0,
        }
        if plant.logging[nid] == "on_change":
            entry["maxInterpMs"] = max(max_interp_ms, plant.period_ms[nid] + 1000)
        spec_nodes.append(entry)
    for nid in plant.feature_ids:
        spec_nodes.append({"nodeId": nid, "role": "feature"})
    spec: dict[str, Any] = {
        "id": spec_id,
        "lineId": first.line_id,
        "productId": first.product_id,
        "recipeId": first.recipe_id,
        "fromMs": None,
        "toMs": None,
        "beatMs": beat_ms,
        "maxInterpMs": max_interp_ms,
        "historySteps": history_steps,
        "horizonSteps": horizon_steps,
        "stride": stride,
        "nodes": spec_nodes,
        "cleaning": cleaning
        if cleaning is not None
        else {"hampelK": 5, "hampelSigma": 3.0, "hampelMinDev": 0.0, "goodStates": [0]},
        "split": split
        if split is not None
        else {"method": "chronological", "train": 0.7, "val": 0.15, "test": 0.15, "seed": 0},
        "note": note,
    }
    if extras:
        variables = []
        for entry in spec_nodes:
            n = catalog[entry["nodeId"]]
            kelvin = n.unit == "degC"
            variables.append(
                {
                    "id": n.node_id.lower(),
                    "nodeId": n.node_id,
                    "role": entry["role"],
                    "unit": n.unit,
                    "modelUnit": "K" if kelvin else n.unit,
                    "scale": 1.0,
                    "offset": 273.15 if kelvin else 0.0,
                    "delayMs": 0,
                }
            )
        spec["extras"] = {
            "specRef": f"specs/{spec_id}.yaml",
            "specVersion": 1,
            "trainerRef": "",
            "conditionId": f"{first.line_id}/{first.product_id}/{first.recipe_id}",
            "recipeVersion": first.recipe_version,
            "recipeContentHash": first.recipe_content_hash,
            "evidenceSource": first.evidence_source,
            "availabilityWatermark": None,
            "variables": variables,
        }
    return spec
