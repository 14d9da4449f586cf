"""The autoscaling policy: per-worker KV-cache usage and queue depth over a window -> replicas.

Pure: dataclasses in, a dataclass out, no clock and no I/O. The operator's autoscaler
(operator/autoscaler.py) and the simulator (operator/simulate.py) both call `decide`.

Each scrape of the workers gives two recommendations, computed from the *total* load on the
ready workers (never from the current replica count times a ratio, which runs away while new
workers load):

- `up`: the fewest workers that keep both signals at or under target
  (total KV usage / target KV usage, total waiting / target queue length);
- `down`: the same with a hysteresis margin under the targets: the fewest workers the load still
  fits on with room to spare ("the N-1 fit": a worker is only removed if the rest stay well
  under target after taking its share).

As the HPA does, scaling up takes the *lowest* `up` of the short up-window (the signals must stay
above target, not spike once) and scaling down the *highest* `down` of the long down-window (the
load must have fitted on fewer workers the whole time). Between them, the replica count holds:
load that oscillates around a threshold cannot flap it.

While workers are still loading the model, their capacity is on its way: the queue is a backlog
they will absorb, so only KV usage (work in flight, which a backlog cannot inflate past 1 per
worker) may add more, and only beyond the replicas already asked for. The same holds while the
queue shrinks over the up-window: requests queued on a worker are served by that worker, so a
backlog being worked off is no reason for more workers. Nothing scales down while workers are
starting or terminating.

A new worker serves only after it has loaded its model, so a rising load is met where it will be
then: the KV demand is scaled by the growth of the arrival rate (the workers' request counters),
whose least-squares trend over the last `trend_window_s` is projected `lookahead_s` ahead (the
autoscaler sets it to the startup time it observes on its pods). Arrivals, unlike KV usage, do
not grow when saturated workers slow down and hold their blocks longer or drain a backlog, so the
projection does not feed on the overload it is meant to prevent. Workers without the counters
fall back to the KV demand's own trend.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

PodState = Literal["ready", "starting", "terminating"]
EPS = 1e-9  # float noise must not turn "exactly at target" into one more worker


@dataclass(frozen=True)
class PodLoad:
    """One worker at one scrape. Metrics are None when the scrape failed (or the pod is not ready)."""

    name: str
    state: PodState
    kv_usage: float | None = None  # 0-1
    waiting: float | None = None  # requests queued for admission
    running: float | None = None  # requests in the running batch
    # Requests received so far (finished + refused for a full queue + in flight): a counter whose
    # rate is the demand on the worker, whether it keeps up or not. None: not exported.
    arrivals: float | None = None


@dataclass(frozen=True)
class Sample:
    time: float  # seconds, any monotonic origin
    pods: tuple[PodLoad, ...]


@dataclass(frozen=True)
class Params:
    min_replicas: int = 1
    max_replicas: int = 10
    target_kv_usage: float = 0.5
    target_queue: float = 2.0  # 0: the queue signal is off
    up_window_s: float = 4.0
    down_window_s: float = 60.0
    max_up_step: int = 4
    max_down_step: int = 1
    margin: float = 0.2  # scale down only to where both signals stay under (1 - margin) x target
    # Scale for the load expected when a new worker is ready: the arrival rate's trend (the KV
    # demand's without counters) over trend_window_s, projected this far ahead (the workers'
    # observed startup time; 0: off).
    lookahead_s: float = 0.0
    # 20 s: a burst's ramp shows in the arrival rate's trend within ~10 s; longer windows react
    # later (30 s: more misses at burst onsets), shorter ones follow Poisson noise (more cost).
    trend_window_s: float = 20.0

    @classmethod
    def from_spec(cls, spec) -> Params:
        """From an AutoscalingSpec (operator/models.py)."""
        return cls(
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            target_kv_usage=spec.target_kv_cache_usage,
            target_queue=spec.target_queue_length,
            up_window_s=spec.scale_up_stabilization_seconds,
            down_window_s=spec.scale_down_stabilization_seconds,
            max_up_step=spec.max_scale_up_step,
            max_down_step=spec.max_scale_down_step,
        )


@dataclass(frozen=True)
class Signals:
    """What one sample says about the fleet."""

    ready: int
    starting: int
    terminating: int
    known: int  # ready workers whose metrics were read
    total_kv: float
    total_waiting: float
    up: int | None  # fewest workers at or under target (None: nothing known)
    up_kv: int | None  # the same from KV usage alone
    demand_kv: float  # workers needed at the KV target, unrounded
    down: int | None  # fewest workers the load fits on with the margin (None: cannot tell)

    @property
    def mean_kv(self) -> float | None:
        return self.total_kv / self.known if self.known else None

    @property
    def mean_waiting(self) -> float | None:
        return self.total_waiting / self.known if self.known else None


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    signals: Signals | None = None
    # Pods to remove first (least loaded), when scaling down: marked with a low deletion cost.
    victims: tuple[str, ...] = field(default_factory=tuple)

    def changed(self, current: int) -> bool:
        return self.replicas != current


def _needed(total: float, per_worker: float) -> int:
    return max(1, math.ceil(total / per_worker - EPS)) if per_worker > 0 else 1


def signals(sample: Sample, params: Params) -> Signals:
    ready = [p for p in sample.pods if p.state == "ready"]
    known = [p for p in ready if p.kv_usage is not None and p.waiting is not None]
    total_kv = sum(p.kv_usage or 0.0 for p in known)
    total_waiting = sum(p.waiting or 0.0 for p in known)
    up = up_kv = down = None
    if known:
        up_kv = _needed(total_kv, params.target_kv_usage)
        down_kv = _needed(total_kv, params.target_kv_usage * (1 - params.margin))
        up, down = up_kv, down_kv
        if params.target_queue > 0:
            up = max(up, _needed(total_waiting, params.target_queue))
            down = max(down, _needed(total_waiting, params.target_queue * (1 - params.margin)))
        if len(known) < len(ready):
            down = None  # a ready worker we could not read may be busy: never scale down blind
    return Signals(
        ready=len(ready),
        starting=sum(p.state == "starting" for p in sample.pods),
        terminating=sum(p.state == "terminating" for p in sample.pods),
        known=len(known),
        total_kv=total_kv,
        total_waiting=total_waiting,
        up=up,
        up_kv=up_kv,
        demand_kv=total_kv / params.target_kv_usage,
        down=down,
    )


def _window(history: Sequence[Sample], now: float, seconds: float) -> tuple[list[Sample], bool]:
    """Samples of the last `seconds` (the newest always), and whether history covers the window."""
    inside = [s for s in history if s.time >= now - seconds - EPS]
    if not inside and history:
        inside = [history[-1]]
    covered = bool(history) and history[0].time <= now - seconds + EPS
    return inside, covered


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line through the points: (its value at the last x, its slope)."""
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var > 0 else 0.0
    return my + slope * (points[-1][0] - mx), slope


def arrival_rates(samples: Sequence[Sample]) -> list[tuple[float, float]]:
    """(time, requests/s arriving at the ready workers) for each scrape interval, from the workers'
    `arrivals` counters (pods read at both ends of the interval; a counter reset counts as 0)."""
    out = []
    for a, b in itertools.pairwise(samples):
        before = {p.name: p.arrivals for p in a.pods if p.state == "ready" and p.arrivals is not None}
        deltas = [
            max(0.0, p.arrivals - before[p.name])
            for p in b.pods
            if p.state == "ready" and p.arrivals is not None and p.name in before
        ]
        if deltas and b.time > a.time:
            out.append((b.time, sum(deltas) / (b.time - a.time)))
    return out


def _projected(history: Sequence[Sample], now: float, params: Params, demand: float) -> tuple[float, str]:
    """The KV demand (workers at target) expected `lookahead_s` ahead, from `demand` now; and how
    it was projected. Demand is scaled with the trend of the arrival rate: unlike KV usage, arrivals
    do not grow when a saturated worker slows down and its requests hold their blocks longer, nor
    while a backlog drains. Without arrival counters, the KV demand's own trend is projected."""
    if params.lookahead_s <= 0:
        return demand, ""
    samples, covered = _window(history, now, params.trend_window_s)
    if not covered:
        return demand, ""
    rates = arrival_rates(samples)
    if len(rates) >= 3:
        level, slope = _line(rates)
        if slope <= 0 or level <= 0:
            return demand, ""
        growth = (level + slope * params.lookahead_s) / level
        return demand * growth, f", arrivals {level:.1f}/s rising {slope * 60:.0f}/s per min"
    points = [(s.time, sig.demand_kv) for s in samples if (sig := signals(s, params)).known]
    if len(points) < 3:
        return demand, ""
    _, slope = _line(points)
    if slope <= 0:
        return demand, ""
    return demand + slope * params.lookahead_s, f", rising {slope * 60:.1f} workers/min"


def least_loaded(pods: Sequence[PodLoad], count: int) -> tuple[str, ...]:
    """The `count` ready workers with the least work in flight: fewest requests (running and
    waiting: what its drain must finish), then least KV usage."""
    ready = [p for p in pods if p.state == "ready"]
    ranked = sorted(ready, key=lambda p: ((p.running or 0.0) + (p.waiting or 0.0), p.kv_usage or 0.0, p.name))
    return tuple(p.name for p in ranked[:count])


def _fmt(s: Signals, params: Params) -> str:
    kv = "?" if s.mean_kv is None else f"{s.mean_kv:.2f}"
    q = "?" if s.mean_waiting is None else f"{s.mean_waiting:.1f}"
    return (
        f"KV usage {kv} (target {params.target_kv_usage:g}), waiting {q}/worker "
        f"(target {params.target_queue:g}), {s.ready} ready, {s.starting} starting"
    )


def decide(history: Sequence[Sample], current: int, params: Params, now: float | None = None) -> Decision:
    """The replica count to ask for, given the samples so far (oldest first) and the current count.

    `history` needs to reach back over the longer window; older samples are ignored."""
    lo, hi = params.min_replicas, max(params.min_replicas, params.max_replicas)
    if current < lo:
        return Decision(lo, f"below minReplicas {lo}: {current} -> {lo}")
    if current > hi:
        return Decision(hi, f"above maxReplicas {hi}: {current} -> {hi}")
    if not history:
        return Decision(current, "no metrics yet")
    now = history[-1].time if now is None else now
    latest = signals(history[-1], params)
    if latest.ready == 0:
        return Decision(current, f"holding: no worker ready ({latest.starting} starting)", latest)
    text = _fmt(latest, params)

    # Up: the lowest recommendation of the up-window, so the signals must *stay* above target.
    up_samples, up_covered = _window(history, now, params.up_window_s)
    loading = latest.starting > 0 or latest.ready + latest.terminating < current
    up_signals = [signals(s, params) for s in up_samples]
    # A queue counts only while it is not being worked off: while workers load (they will absorb
    # it) or while it shrinks (a backlog the ready workers are draining), only KV usage may add
    # workers. Requests queued on one worker stay there; more workers would not serve them.
    shrinking = up_signals[-1].total_waiting < max(sig.total_waiting for sig in up_signals)
    kv_only = loading or shrinking
    ups = [sig.up_kv if kv_only else sig.up for sig in up_signals]
    if up_covered and ups and all(u is not None for u in ups):
        want = min(u for u in ups if u is not None)
        ahead, trend = _projected(history, now, params, min(sig.demand_kv for sig in up_signals))
        want = max(want, math.ceil(ahead - EPS))
        if want > current:
            target = min(hi, want, current + params.max_up_step)
            if target > current:
                return Decision(target, f"scale up {current} -> {target}: {text}{trend}", latest)
            return Decision(current, f"at maxReplicas {hi}: {text}", latest)

    # Down: the highest recommendation of the down-window, so the load must have fitted on fewer
    # workers the whole time, with the margin under target ("the N-1 fit").
    if loading or latest.terminating:
        why = "workers starting" if loading else "workers terminating"
        return Decision(current, f"holding ({why}): {text}", latest)
    down_samples, down_covered = _window(history, now, params.down_window_s)
    downs = [signals(s, params).down for s in down_samples]
    if down_covered and downs and all(d is not None for d in downs):
        fit = max(d for d in downs if d is not None)
        if fit < current:
            target = max(lo, fit, current - params.max_down_step)
            if target < current:
                victims = least_loaded(history[-1].pods, current - target)
                return Decision(
                    target,
                    f"scale down {current} -> {target}: load fits on {fit} for "
                    f"{params.down_window_s:g}s: {text}",
                    latest,
                    victims,
                )
    return Decision(current, f"steady: {text}", latest)
