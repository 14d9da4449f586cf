"""The autoscaling policy: per-worker KV-cache usage and queue depth over a window -> replicas.

Pure: dataclasses in, a dataclass out, no clock and no I/O. `decide` is a pure function of the
samples; `Autoscaler` is the little state the decisions need (the samples of the windows, each
pod's measured startup). The operator (operator/autoscaler/scaler.py) and the simulator
(tests/simulate.py) drive the same `Autoscaler`: `observe` each scrape, then `decide`.

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
starting (within their startup budget) or terminating. A pod that is not coming is not
"starting": one the scheduler cannot place (`unschedulable`), one whose container crash-loops
(`crashlooping`), or one that cannot start or has not become Ready within the startup budget
(`stalled`) neither freezes scale-down, scale to zero nor the queue signal; it is the first pod a
scale-down removes (the ReplicaSet controller removes unscheduled and not-ready pods before
ready ones whatever their deletion cost, so the victims named are the ones that go).

A new worker serves only after it has loaded its model, so a rising load is met where it will be
then: the KV demand is scaled by the growth of the arrival rate (the workers' request counters),
whose least-squares trend over the last `trend_window_s` is projected `lookahead_s` ahead (the
startup time measured on the pods, plus the part of their wait for compiled steps that their eager
forward does not cover, at most the startup budget). Arrivals, unlike KV usage, do
not grow when saturated workers slow down and hold their blocks longer or drain a backlog, so the
projection does not feed on the overload it is meant to prevent. Workers without the counters
fall back to the KV demand's own trend.

The router in front of the workers (router/) sees demand first: its arrivals counter
is the arrival signal when it was read (it counts requests no worker has seen yet; the workers'
count where they see more, from clients that bypass it), and the
requests held in its queue are waiting requests like the workers' own (no worker reports them).
With minReplicas 0, a resource idle for `scale_to_zero_after_s` (nothing arrived, nothing
queued at the router or a worker, nothing running) goes to zero; at zero the autoscaler holds
and the router asks for the first worker when a request arrives (router/wake.py), so
that one write is the only scale-up from zero. A trend counts only when it is significant: its slope
must clear `trend_t` standard errors, the error taken from the scatter of the points around the
line but never under the Poisson noise of the counts, so a flat load's noise adds no workers.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

PodState = Literal["ready", "starting", "terminating", "unschedulable", "crashlooping", "stalled"]
# Pods that are not coming: not capacity on its way, never a reason to hold.
STUCK: frozenset[str] = frozenset({"unschedulable", "crashlooping", "stalled"})
EPS = 1e-9  # float noise must not turn "exactly at target" into one more worker
# One-sided: a flat Poisson load's slope clears 3.5 standard errors about 2 times in 10,000
# windows, so its noise practically never adds a worker, even projected over the whole startup
# budget (tests/test_autoscaler_runaway.py, tests/test_simulate.py). 2.5 let a flat load add
# workers at a 600 s look-ahead, 2.0 even at 30 s (docs/autoscaling.md).
TREND_T = 3.5
# A new CPU worker's capacity on its eager forward, as a share of its compiled one, while the
# compiled forward is built behind (issue 29): a decode step took 2.43x as long eagerly (the median
# of the decode cases of `bench steps`, docs/benchmarks.md, "Forward steps, compiled against eager").
EAGER_SHARE = 1 / 2.43
# A first Ready comes at most one startup-probe period (1 s) and one readiness period (2 s),
# plus timestamps' whole seconds, after the startup budget; anything later is no startup.
STARTUP_SLACK_S = 10.0


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
    # Carries the victim's pod-deletion-cost: a scale-down named it a tick ago (scaler._scale).
    marked: bool = False
    # Seconds its compiled forward took (kvscale_forward_compile_seconds), once it runs it.
    compile_s: float | None = None


@dataclass(frozen=True)
class RouterLoad:
    """One router pod at one scrape (its kvscale_router_* metrics summed over models); None: not
    read."""

    name: str
    queued: float | None = None  # held in the router's queue: demand no worker reports
    in_flight: float | None = None  # sent to a worker, not finished
    arrivals: float | None = None  # requests that arrived at the router (a counter)


@dataclass(frozen=True)
class Sample:
    time: float  # seconds, any monotonic origin
    pods: tuple[PodLoad, ...]
    routers: tuple[RouterLoad, ...] = ()

    @property
    def router_queued(self) -> float:
        return sum(r.queued or 0.0 for r in self.routers)


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
    # 40 s: a slope's standard error falls as the window^1.5, so a burst's ramp clears the
    # significance test sooner over 40 s than over 20 (SLO 94.5-96.4 % against 91.0-94.3 % on
    # the simulator's seeds 1-3); 60 s reacted later again (docs/autoscaling.md).
    trend_window_s: float = 40.0
    # A trend is projected only when its slope is at least this many standard errors above 0.
    trend_t: float = TREND_T
    # The look-ahead never exceeds this: a worker that does not start within it is restarted by
    # its startup probe (spec.server.startupTimeoutSeconds).
    startup_budget_s: float = 600.0
    # With min_replicas 0: idle (no arrivals, nothing queued or running) this long -> zero.
    scale_to_zero_after_s: float = 300.0
    # A new worker's capacity on its eager forward, as a share of its compiled one, while its
    # compiled forward is built behind (issue 29): the look-ahead counts the rest of the wait
    # for compiled steps (`lookahead_of`).
    eager_share: float = EAGER_SHARE

    @classmethod
    def from_spec(cls, spec, startup_budget_s: float = 600.0) -> Params:
        """From an AutoscalingSpec (operator/api/) and the spec's startup budget."""
        return cls(
            startup_budget_s=startup_budget_s,
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            target_kv_usage=spec.target_kv_cache_usage,
            target_queue=spec.target_queue_length,
            up_window_s=spec.scale_up_stabilization_seconds,
            down_window_s=spec.scale_down_stabilization_seconds,
            max_up_step=spec.max_scale_up_step,
            max_down_step=spec.max_scale_down_step,
            scale_to_zero_after_s=spec.scale_to_zero_after_seconds,
        )


@dataclass(frozen=True)
class Signals:
    """What one sample says about the fleet."""

    ready: int
    starting: int
    terminating: int
    known: int  # ready workers whose metrics were read
    total_kv: float  # of the known workers
    total_waiting: float  # of the known workers, and the router's queue
    up: int | None  # fewest workers at or under target (None: nothing known)
    up_kv: int | None  # the same from KV usage alone
    demand_kv: float  # workers needed at the KV target, unrounded
    down: int | None  # fewest workers the load fits on with the margin (None: cannot tell)
    router_queued: float = 0.0  # of total_waiting: held at the router
    unschedulable: int = 0
    crashlooping: int = 0
    stalled: int = 0

    @property
    def stuck(self) -> int:
        """Pods that are not coming (STUCK)."""
        return self.unschedulable + self.crashlooping + self.stalled

    @property
    def unreadable(self) -> int:
        """Ready workers whose metrics could not be read (counted at target, see `signals`)."""
        return self.ready - self.known

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
    """The fleet's load in one sample. A ready worker whose metrics could not be read (a failed or
    timed-out scrape: often a worker too busy to answer) counts as exactly at target: it needs its
    own worker, and its capacity is not spare room for the others' load (left out, it would be).
    It never lends room to a scale-down either: while any is unreadable, `down` is unknown."""
    ready = [p for p in sample.pods if p.state == "ready"]
    known = [p for p in ready if p.kv_usage is not None and p.waiting is not None]
    unread = len(ready) - len(known)
    total_kv = sum(p.kv_usage or 0.0 for p in known)
    # Requests held at the router wait for a worker as much as those queued on one.
    total_waiting = sum(p.waiting or 0.0 for p in known) + sample.router_queued
    demand_kv = total_kv / params.target_kv_usage + unread
    up = up_kv = down = None
    if known:
        up_kv = _needed(demand_kv, 1.0)
        down_kv = _needed(total_kv, params.target_kv_usage * (1 - params.margin))
        up, down = up_kv, down_kv
        if params.target_queue > 0:
            up = max(up, _needed(total_waiting / params.target_queue + unread, 1.0))
            down = max(down, _needed(total_waiting, params.target_queue * (1 - params.margin)))
        if unread:
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
        demand_kv=demand_kv,
        down=down,
        router_queued=sample.router_queued,
        unschedulable=sum(p.state == "unschedulable" for p in sample.pods),
        crashlooping=sum(p.state == "crashlooping" for p in sample.pods),
        stalled=sum(p.state == "stalled" for p in sample.pods),
    )


def _window(history: Sequence[Sample], now: float, seconds: float) -> tuple[list[Sample], bool]:
    """Samples of the last `seconds` (the newest always), and whether history covers the window."""
    inside = [s for s in history if s.time >= now - seconds - EPS]
    if not inside and history:
        inside = [history[-1]]
    covered = bool(history) and history[0].time <= now - seconds + EPS
    return inside, covered


@dataclass(frozen=True)
class Trend:
    """A least-squares line through a window of points."""

    level: float  # the line's value at the last point
    slope: float  # per second
    stderr: float  # the slope's standard error (inf: too few points to tell)

    def significant(self, t: float) -> bool:
        """Rising by more than `t` standard errors (one-sided)."""
        return self.slope > 0 and self.slope >= t * self.stderr


def fit_trend(points: Sequence[tuple[float, float]], noise_var: float = 0.0) -> Trend:
    """The least-squares line through (x, y) points and its slope's standard error: from the
    scatter of the points around the line (n - 2 degrees of freedom), but never from less than
    `noise_var` per point (the variance the points must have, e.g. Poisson noise: a few points
    that happen to lie on a line do not make their slope certain)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if n < 3 or sxx <= 0:
        return Trend(my, 0.0, math.inf)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    scatter = sum((y - my - slope * (x - mx)) ** 2 for x, y in points) / (n - 2)
    return Trend(my + slope * (points[-1][0] - mx), slope, math.sqrt(max(scatter, noise_var) / sxx))


def _arrival_deltas(a: Sample, b: Sample, routers: bool) -> list[float]:
    """Each counter's increase between two samples (read at both ends; a reset counts as 0)."""
    if routers:
        before = {r.name: r.arrivals for r in a.routers if r.arrivals is not None}
        now = [(r.name, r.arrivals) for r in b.routers if r.arrivals is not None]
    else:
        before = {p.name: p.arrivals for p in a.pods if p.state == "ready" and p.arrivals is not None}
        now = [(p.name, p.arrivals) for p in b.pods if p.state == "ready" and p.arrivals is not None]
    return [max(0.0, v - before[n]) for n, v in now if n in before]


def arrival_rates(samples: Sequence[Sample]) -> list[tuple[float, float]]:
    """(time, requests/s arriving) for each scrape interval: the router's `arrivals` counters when
    they were read, as they count what no worker has seen yet (requests it holds; at zero workers,
    every request), or the ready workers' where those count more (clients that bypass the router:
    the workers' Service, an InferencePool gateway); the workers' alone without a router."""
    out = []
    for a, b in itertools.pairwise(samples):
        routed, direct = _arrival_deltas(a, b, routers=True), _arrival_deltas(a, b, routers=False)
        if (routed or direct) and b.time > a.time:
            out.append((b.time, max(sum(routed), sum(direct)) / (b.time - a.time)))
    return out


def idle(sample: Sample) -> bool:
    """Nothing queued or running anywhere at this scrape (unread counts as busy)."""
    ready = [p for p in sample.pods if p.state == "ready"]
    if any(p.waiting is None or p.running is None or p.waiting + p.running > 0 for p in ready):
        return False
    return all(r.queued == 0 and r.in_flight == 0 for r in sample.routers)


def idle_for(history: Sequence[Sample], now: float, seconds: float) -> bool:
    """Idle at every scrape of the last `seconds` (history covering them), with no arrival in
    between, at the router or any worker."""
    samples, covered = _window(history, now, seconds)
    if not covered or not all(idle(s) for s in samples):
        return False
    return not any(
        sum(_arrival_deltas(a, b, routers=True)) + sum(_arrival_deltas(a, b, routers=False)) > 0
        for a, b in itertools.pairwise(samples)
    )


def confirms_idle(decided: Sample, fresh: Sample) -> bool:
    """Whether a scrape taken just before writing 0 (`fresh`) confirms the idleness `decided` was
    judged on: idle now, every router and worker of the decision read again (an unread one is
    busy), and no arrival counter moved in between. The scale-to-zero decision rests on samples
    2-4 s old; a request that reached the router in that gap would otherwise be cut by the drain."""
    if not idle(fresh):
        return False
    if {r.name for r in decided.routers} - {r.name for r in fresh.routers if r.arrivals is not None}:
        return False  # a router of the decision that could not be read again
    return not (
        sum(_arrival_deltas(decided, fresh, routers=True))
        + sum(_arrival_deltas(decided, fresh, routers=False))
    )


def _projected(history: Sequence[Sample], now: float, params: Params, demand: float) -> tuple[float, str]:
    """The KV demand (workers at target) expected `lookahead_s` ahead, from `demand` now; and how
    it was projected. Demand is scaled with the trend of the arrival rate: unlike KV usage, arrivals
    do not grow when a saturated worker slows down and its requests hold their blocks longer, nor
    while a backlog drains. Without arrival counters, the KV demand's own trend is projected.

    Only a significant trend counts (`Params.trend_t` standard errors). The arrival rate of an
    interval of `dt` seconds is a Poisson count / dt, whose variance is rate / dt: the slope's
    error is never taken as smaller than that noise gives. Only windows in which every ready worker
    was read count: a worker dropping out of (or back into) the sums is no trend."""
    lookahead = min(params.lookahead_s, params.startup_budget_s)
    if lookahead <= 0:
        return demand, ""
    samples, covered = _window(history, now, params.trend_window_s)
    if not covered:
        return demand, ""
    sigs = [signals(s, params) for s in samples]
    if any(sig.unreadable for sig in sigs):
        return demand, ""
    rates = arrival_rates(samples)
    if len(rates) >= 3:
        mean_rate = sum(r for _, r in rates) / len(rates)
        dt = (samples[-1].time - samples[0].time) / (len(samples) - 1)
        trend = fit_trend(rates, noise_var=mean_rate / dt if dt > 0 else 0.0)
        if trend.level <= 0 or not trend.significant(params.trend_t):
            return demand, ""
        growth = (trend.level + trend.slope * lookahead) / trend.level
        t = f"{trend.slope / trend.stderr:.1f}" if trend.stderr > 0 else "inf"
        return demand * growth, (
            f", arrivals {trend.level:.1f}/s rising {trend.slope * 60:.0f}/s per min ({t} s.e.)"
        )
    points = [(s.time, sig.demand_kv) for s, sig in zip(samples, sigs, strict=True) if sig.known]
    if len(points) < 3:
        return demand, ""
    trend = fit_trend(points)
    if not trend.significant(params.trend_t):
        return demand, ""
    return demand + trend.slope * lookahead, f", rising {trend.slope * 60:.1f} workers/min"


def least_loaded(pods: Sequence[PodLoad], count: int, window: Sequence[Sample] = ()) -> tuple[str, ...]:
    """The `count` pods to remove: first those that are not coming (STUCK: the ReplicaSet
    controller removes unscheduled and not-ready pods first anyway), then the ready workers with
    the least work in flight: fewest requests (running and waiting: what its drain must finish),
    then least KV usage. Pods already marked come first among the ready: a scale-down marks its
    victims one tick and writes the count the next (scaler._scale), so a ranking that shifted in
    between must not name new victims and put the write off again.

    `window`: the samples the decision rests on (the down-window). A worker's load is its mean over
    the samples that read it: one scrape of short requests can catch a busy worker between two
    of them, and an instant's ranking then names the wrong victim."""

    def reading(p: PodLoad) -> tuple[float, float]:  # (requests in flight, KV usage) at one scrape
        return (p.running or 0.0) + (p.waiting or 0.0), p.kv_usage or 0.0

    readings: dict[str, list[tuple[float, float]]] = {}
    for sample in window:
        for p in sample.pods:
            if p.state == "ready" and p.running is not None:
                readings.setdefault(p.name, []).append(reading(p))

    def load(p: PodLoad) -> tuple[float, float]:
        seen = readings.get(p.name) or [reading(p)]
        return sum(r for r, _ in seen) / len(seen), sum(kv for _, kv in seen) / len(seen)

    stuck = sorted(p.name for p in pods if p.state in STUCK)
    ready = [p for p in pods if p.state == "ready"]
    ranked = sorted(ready, key=lambda p: (not p.marked, *load(p), p.name))
    return tuple([*stuck, *(p.name for p in ranked)][:count])


def _fmt(s: Signals, params: Params) -> str:
    kv = "?" if s.mean_kv is None else f"{s.mean_kv:.2f}"
    q = "?" if s.mean_waiting is None else f"{s.mean_waiting:.1f}"
    unread = f", {s.unreadable} unreadable (counted at target)" if s.unreadable else ""
    stuck = ", ".join(
        f"{n} {what}"
        for n, what in (
            (s.unschedulable, "unschedulable"),
            (s.crashlooping, "crash-looping"),
            (s.stalled, "stalled"),
        )
        if n
    )
    unread += f", {stuck}" if stuck else ""
    held = f" ({s.router_queued:g} at the router)" if s.router_queued else ""
    return (
        f"KV usage {kv} (target {params.target_kv_usage:g}), waiting {q}/worker{held} "
        f"(target {params.target_queue:g}), {s.ready} ready, {s.starting} starting{unread}"
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
    if current == 0:  # the router asks for the first worker when a request arrives (wake.py)
        return Decision(0, "at zero: the router asks for a worker when a request arrives", latest)
    if latest.ready == 0:
        stuck = f", {latest.stuck} not coming" if latest.stuck else ""
        return Decision(current, f"holding: no worker ready ({latest.starting} starting{stuck})", latest)
    text = _fmt(latest, params)

    # Up: the lowest recommendation of the up-window, so the signals must *stay* above target.
    up_samples, up_covered = _window(history, now, params.up_window_s)
    # Capacity on its way: pods starting, or pods asked for that no sample shows yet. Pods that
    # are not coming (unschedulable, crash-looping, stalled) are none: they never hold.
    loading = latest.starting > 0 or latest.ready + latest.terminating + latest.stuck < current
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
    if loading or latest.terminating:  # a pod not yet Ready is never what is scaled away
        why = "workers starting" if loading else "workers terminating"
        return Decision(current, f"holding ({why}): {text}", latest)
    if lo == 0 and idle_for(history, now, params.scale_to_zero_after_s):
        victims = least_loaded(history[-1].pods, current)
        return Decision(
            0, f"scale to zero {current} -> 0: idle for {params.scale_to_zero_after_s:g}s", latest, victims
        )
    down_samples, down_covered = _window(history, now, params.down_window_s)
    downs = [signals(s, params).down for s in down_samples]
    if down_covered and downs and all(d is not None for d in downs):
        fit = max(d for d in downs if d is not None)
        if fit < current:
            target = max(lo, fit, current - params.max_down_step)
            if target < current:
                victims = least_loaded(history[-1].pods, current - target, down_samples)
                return Decision(
                    target,
                    f"scale down {current} -> {target}: load fits on {fit} for "
                    f"{params.down_window_s:g}s: {text}",
                    latest,
                    victims,
                )
    return Decision(current, f"steady: {text}", latest)


# -- startup time: the look-ahead -----------------------------------------------------------------


@dataclass(frozen=True)
class PodTiming:
    """What a pod's status says about its startup, as seconds on one clock (the operator: Unix
    time from the API server's timestamps; the simulator: its own), and what its worker's metrics
    say about its compiled forward."""

    uid: str
    # When the worker container now running started (containerStatuses[].state.running.startedAt):
    # after a restart, the restarted container, whose model load is what the look-ahead wants.
    container_started: float | None
    # When the Ready condition last turned True (its lastTransitionTime); None: not Ready now.
    ready_since: float | None
    # Once the worker runs its compiled forward (kvscale_forward_compiled 1): the seconds it took
    # to get it (kvscale_forward_compile_seconds: its build behind the eager forward, which starts
    # right after the weights are in, before Ready; or its load before Ready when a package was
    # found). None: still eager, one that never compiles (GPUs, enforceEager), or not read.
    compile_s: float | None = None


def startup_of(pod: PodTiming, budget_s: float) -> float | None:
    """How long this pod took from its container's start to Ready, or None when its status cannot
    say: not Ready, no running container, a Ready transition from before this container started,
    or one later than a startup can be. The startup probe restarts a container that is not ready
    within the budget, so a Ready transition later than that (plus the probes' periods) is a
    readiness flap, not a startup: the span up to it is the pod's age, not its startup time.
    The result is clamped to the budget. Call it once per pod, the first time it is Ready
    (`Autoscaler` does): a later flap moves `ready_since` again."""
    if pod.ready_since is None or pod.container_started is None:
        return None
    span = pod.ready_since - pod.container_started
    if span < 0 or span > budget_s + STARTUP_SLACK_S:
        return None
    return min(span, budget_s)


def compiled_of(startup: float | None, pod: PodTiming, budget_s: float) -> float | None:
    """How long this pod took from its container's start to compiled steps: its measured startup
    plus its compile seconds (the build began before Ready, so this is late by the seconds between
    the build's start and Ready: under one on the fixture model). None without both."""
    if startup is None or pod.compile_s is None or pod.compile_s < 0:
        return None
    return min(budget_s, startup + pod.compile_s)


def lookahead_of(ready: float | None, compiled: float | None, eager_share: float) -> float | None:
    """The look-ahead from the median startup (to Ready) and the median time to compiled steps: a
    new worker serves from Ready, at `eager_share` of its compiled capacity until it switches, so
    the capacity it lacks until then counts as that share of the wait. Pure."""
    if ready is None:
        return None
    if compiled is None or compiled <= ready:
        return ready
    return ready + (1.0 - eager_share) * (compiled - ready)


def startup_estimate(startups: Iterable[float | None], budget_s: float) -> float | None:
    """The median measured startup (None: none measured yet), never above the budget."""
    measured = sorted(s for s in startups if s is not None)
    if not measured:
        return None
    return min(budget_s, max(0.0, measured[len(measured) // 2]))


@dataclass
class Autoscaler:
    """One resource's autoscaler: the samples its windows need and each pod's startup, measured
    once. The operator and the simulator both drive it: `observe` every scrape, then `decide`."""

    history: deque[Sample] = field(default_factory=deque)
    # Pod uid -> its startup in seconds, measured the first time it was seen Ready (None: its
    # status could not tell). Never measured again: a readiness flap or a restart later is not a
    # startup. Pods that are gone are forgotten.
    startups: dict[str, float | None] = field(default_factory=dict)
    # Pod uid -> its time from container start to compiled steps (`compiled_of`), measured the
    # first time its worker reports the compiled forward. Pods that never compile have none.
    compiled: dict[str, float | None] = field(default_factory=dict)
    interval_s: float = 2.0  # the scrape interval: history keeps one more on each side
    last_lookahead_s: float = 0.0  # the look-ahead of the last decision (for status)

    def observe(self, sample: Sample, timings: Iterable[PodTiming], params: Params) -> None:
        timings = list(timings)
        for t in timings:
            if t.uid not in self.startups and t.ready_since is not None:
                self.startups[t.uid] = startup_of(t, params.startup_budget_s)
            if t.uid not in self.compiled and t.compile_s is not None and t.uid in self.startups:
                self.compiled[t.uid] = compiled_of(self.startups[t.uid], t, params.startup_budget_s)
        alive = {t.uid for t in timings}
        for measured in (self.startups, self.compiled):
            for uid in [u for u in measured if u not in alive]:
                del measured[uid]
        if self.history and sample.time < self.history[-1].time:
            self.history.clear()  # a clock that went back: the windows are meaningless
        self.history.append(sample)
        windows = (params.up_window_s, params.down_window_s, params.trend_window_s)
        zero = params.scale_to_zero_after_s if params.min_replicas == 0 else 0.0
        keep = max(*windows, zero) + 2 * self.interval_s
        while len(self.history) > 1 and self.history[1].time <= sample.time - keep:
            self.history.popleft()

    def lookahead_s(self, params: Params) -> float:
        """The look-ahead: the pods' median startup, lengthened by the wait for compiled steps
        (`lookahead_of`) where the pods measured one; at most the budget (params' own: none
        measured)."""
        budget = params.startup_budget_s
        ready = startup_estimate(self.startups.values(), budget)
        compiled = startup_estimate(self.compiled.values(), budget)
        measured = lookahead_of(ready, compiled, params.eager_share)
        return params.lookahead_s if measured is None else measured

    def decide(self, current: int, params: Params) -> Decision:
        self.last_lookahead_s = min(self.lookahead_s(params), params.startup_budget_s)
        params = replace(params, lookahead_s=self.last_lookahead_s)
        now = self.history[-1].time if self.history else None
        return decide(self.history, current, params, now)
