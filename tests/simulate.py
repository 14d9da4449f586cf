"""Autoscaling policies side by side on one simulated fleet and one bursty request trace.

    python tests/simulate.py --json --plot out.png [--seed 1] [--duration 1800]

Not part of the shipped operator: a test and docs tool (tests/test_simulate.py imports it), run
from a checkout with the package installed (`pip install -e '.[operator]'`).

A fleet of continuously batching workers (throughput by batch size, a KV-block pool that limits
concurrency, a bounded queue answering 429, model load time for new workers, drain on removal)
serves a seeded trace with bursts and long-tailed prompt and output lengths. The same trace is
served under each policy:

- `kvscale`: the operator's own autoscaler, the `kvscale.operator.autoscaler.policy.Autoscaler` object
  operator/autoscaler/scaler.py drives (history, startups measured per pod, the look-ahead, `decide`),
  with the defaults of `AutoscalingSpec` (what a user gets without tuning);
- `request-count`: KubeAI's algorithm: replicas = ceil(moving average of active requests /
  targetRequests), averaged over its default 10-minute window, sampled every 10 s, scale-down
  after a 30 s delay;
- `hpa-utilisation`: a HorizontalPodAutoscaler on accelerator utilisation (busy share x the
  throughput the batch reaches, as DCGM's SM activity reports it) with target 70 %, its 15 s
  sync, 10 % tolerance, 300 s scale-down stabilisation and its default scale-up rate;
- `static-peak`: the fewest fixed workers that meet the TTFT SLO on this trace (searched);
- `oracle`: a bound, not a policy: it knows the arrival rate one model load ahead and a worker's
  capacity (static peak's), so the distance to it is what forecasting could still win.

Requests reach the workers through the router's own picking function
(`kvscale.router.picker.pick`: its filter, bounded-load guard and KV/queue scores; the
simulated prompts carry no text, so no prefix affinity) and, when no worker can take one, wait in
a router queue (its 256 bound and 60 s timeout), whose length and arrival count the operator's
autoscaler reads as it reads the real router's. The `kvscale-round-robin` row is our autoscaler
behind a round-robin Service instead (`pick_round_robin`: every request to the next worker).

Reported per policy: SLO attainment (share of all requests whose time to first token is under
the bound; a 429 or an aborted request counts as a miss), replica-seconds (workers loading, ready
or draining), requests dropped (429) or aborted (drain timeout), and scaling actions.
Deterministic for a seed; pure Python, no dependencies beyond the standard library (the plot
needs matplotlib, imported only with --plot).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvscale.operator.api.autoscaling import AutoscalingSpec
from kvscale.operator.autoscaler.policy import Autoscaler, Params, PodLoad, PodTiming, RouterLoad, Sample
from kvscale.router.picker import Candidate, PickerConfig, pick, pick_round_robin

# -- the worker model -------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerModel:
    """One worker's capacity. Throughput by batch size and the prefill rate come from
    docs/benchmarks.md (serving, issue 4: tokens/s at 1, 8, 32 and 64 concurrent streams; the
    64-stream TTFT gives the prefill rate); the rest are the worker's own defaults or stated
    assumptions (see docs/autoscaling.md)."""

    decode_tps: tuple[tuple[int, float], ...] = ((1, 119.2), (8, 457.2), (32, 729.4), (64, 760.8))
    prefill_tps: float = 6_000.0  # 9,793 prompt tokens of 64 streams prefilled within ~1.6 s
    max_num_batched_tokens: int = 2048  # the engine's default step budget
    max_num_seqs: int = 64
    kv_blocks: int = 1024
    block_size: int = 16
    max_queued: int = 256  # kvscale-worker --max-queued-requests: beyond it, 429
    load_time_s: float = 30.0  # scale-up to Ready (serving on the eager forward)
    # Ready to compiled steps (issue 29: the compiled CPU forward built behind the eager one; 0: a
    # new worker serves compiled from Ready, as with a compile cache or a GPU). Until then its
    # steps run at these shares of the compiled speed: docs/benchmarks.md, "Forward steps,
    # compiled against eager" (eager/compiled 2.43 for decodes, median of the decode cases; 1.30
    # for a prefill chunk).
    compile_time_s: float = 0.0
    eager_decode_share: float = 1 / 2.43
    eager_prefill_share: float = 1 / 1.30
    drain_timeout_s: float = 30.0

    def decode_rate(self, batch: int) -> float:
        """Generated tokens/s of the whole batch (piecewise linear between the measured points)."""
        pts = self.decode_tps
        if batch <= pts[0][0]:
            return pts[0][1] * batch / pts[0][0]
        for (b0, r0), (b1, r1) in itertools.pairwise(pts):
            if batch <= b1:
                return r0 + (r1 - r0) * (batch - b0) / (b1 - b0)
        return pts[-1][1]

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size


@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    first_token: float | None = None
    finished: float | None = None
    dropped: str | None = None  # "429" or "aborted"


@dataclass
class _Seq:
    req: Request
    prefill_left: float  # tokens still to prefill (prompt, plus output so far after a preemption)
    generated: float = 0.0


class Worker:
    def __init__(
        self,
        name: str,
        model: WorkerModel,
        ready_at: float,
        started_at: float,
        compiled_at: float | None = None,
    ) -> None:
        self.name, self.model = name, model
        self.started_at, self.ready_at = started_at, ready_at
        self.compiled_at = ready_at + model.compile_time_s if compiled_at is None else compiled_at
        self.draining_since: float | None = None
        self.gone_at: float | None = None
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy_time = 0.0  # for the utilisation metric: seconds x (batch throughput / peak)
        self.busy_log: deque[tuple[float, float]] = deque()
        # The counters the worker exports (kvscale_requests_finished_total, _rejected_total{queue_full}).
        self.finished_count, self.refused_count = 0, 0

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and self.draining_since is None and self.gone_at is None

    def compile_s(self, now: float) -> float | None:
        """kvscale_forward_compile_seconds once the worker runs compiled (None before): its build
        behind the eager forward, from Ready on."""
        return self.compiled_at - self.ready_at if now >= self.compiled_at else None

    def alive(self) -> bool:
        return self.gone_at is None

    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def arrivals(self) -> int:
        """Requests received so far, as the operator reads it from the worker's metrics."""
        return self.finished_count + self.refused_count + self.in_flight()

    def kv_used(self) -> float:
        # Tokens held, rounded up to whole blocks per sequence (half a block of waste on average).
        bs = self.model.block_size
        return (
            sum(math.ceil((s.req.prompt - s.prefill_left + s.generated) / bs + 1e-9) for s in self.running)
            * bs
        )

    def kv_usage(self) -> float:
        return min(1.0, self.kv_used() / self.model.kv_tokens)

    def submit(self, req: Request) -> bool:
        if len(self.waiting) >= self.model.max_queued:
            self.refused_count += 1
            return False
        self.waiting.append(_Seq(req, float(req.prompt)))
        return True

    def step(self, now: float, dt: float) -> None:
        """Advance dt seconds of continuous batching (a fluid model of engine steps)."""
        m = self.model
        # Admission: FIFO while a sequence slot and the KV blocks of its prompt are free.
        used = self.kv_used()
        while self.waiting and len(self.running) < m.max_num_seqs:
            seq = self.waiting[0]
            need = math.ceil((seq.req.prompt + seq.generated) / m.block_size + 1e-9) * m.block_size
            if used + need > m.kv_tokens:
                break
            self.waiting.popleft()
            self.running.append(seq)
            used += need
        if not self.running:
            self.busy_log.append((now, 0.0))
            return
        decoding = [s for s in self.running if s.prefill_left <= 0]
        prefilling = [s for s in self.running if s.prefill_left > 0]
        d = len(decoding)
        # Eager steps until the compiled forward is in (a fresh worker, issue 29): slower.
        eager = now < self.compiled_at
        decode_share = m.eager_decode_share if eager else 1.0
        prefill_share = m.eager_prefill_share if eager else 1.0
        # One engine step: every decode advances one token, prefill fills the rest of the budget.
        t_decode = d / (m.decode_rate(d) * decode_share) if d else 0.0
        chunk = min(sum(s.prefill_left for s in prefilling), max(0, m.max_num_batched_tokens - d))
        t_prefill = chunk / (m.prefill_tps * prefill_share)
        step_time = t_decode + t_prefill
        steps = dt / step_time
        budget = chunk * steps  # prefill tokens this tick, FIFO
        for s in prefilling:
            take = min(s.prefill_left, budget)
            s.prefill_left -= take
            budget -= take
            if s.prefill_left <= 1e-9:
                s.prefill_left = 0.0
                if s.req.first_token is None:
                    # first token when its prefill ends, within this tick
                    s.req.first_token = now + dt * (1 - budget / max(chunk * steps, 1e-9))
            if budget <= 0:
                break
        finished = []
        for s in decoding:
            s.generated += steps
            if s.generated >= s.req.output:
                s.req.finished = now + dt
                finished.append(s)
        if finished:
            self.running = [s for s in self.running if s not in finished]
            self.finished_count += len(finished)
        # Out of KV blocks as sequences grow: preempt the newest, to recompute later (the engine's rule).
        while self.running and self.kv_used() > m.kv_tokens:
            victim = self.running.pop()
            victim.prefill_left = victim.req.prompt + victim.generated
            self.waiting.appendleft(victim)
        self.busy_log.append((now, m.decode_rate(max(1, d)) / m.decode_rate(m.max_num_seqs)))

    def utilisation(self, now: float, window: float) -> float:
        while self.busy_log and self.busy_log[0][0] < now - window:
            self.busy_log.popleft()
        return sum(u for _, u in self.busy_log) / len(self.busy_log) if self.busy_log else 0.0


# -- the trace ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceConfig:
    duration_s: float = 3600.0
    base_rps: float = 2.0  # the quiet rate
    peak_rps: float = 14.0  # the rate inside a burst
    burst_every_s: float = 600.0  # mean gap between bursts (exponential)
    burst_len_s: float = 120.0  # mean burst length (exponential)
    ramp_s: float = 90.0  # bursts ramp up and down over this long
    quiet_start_s: float = 180.0  # the fleet starts in a steady state: no burst before this
    prompt_median: int = 350
    prompt_sigma: float = 1.0
    output_median: int = 120
    output_sigma: float = 0.9
    max_model_len: int = 4096


def make_trace(cfg: TraceConfig, rng: random.Random) -> tuple[list[Request], Callable[[float], float]]:
    """Poisson arrivals whose rate follows bursts (a smooth ramp in and out of each), log-normal
    prompt and output lengths capped at max_model_len."""
    bursts, t = [], cfg.quiet_start_s + rng.expovariate(1 / cfg.burst_every_s) * 0.5
    while t < cfg.duration_s:
        length = max(30.0, rng.expovariate(1 / cfg.burst_len_s))
        bursts.append((t, t + length, rng.uniform(0.6, 1.0)))
        t += length + rng.expovariate(1 / cfg.burst_every_s)

    def rate(at: float) -> float:
        r = cfg.base_rps
        for start, end, height in bursts:
            if start - cfg.ramp_s <= at <= end + cfg.ramp_s:
                ramp = min(1.0, (at - start + cfg.ramp_s) / cfg.ramp_s, (end + cfg.ramp_s - at) / cfg.ramp_s)
                r = max(r, cfg.base_rps + (cfg.peak_rps - cfg.base_rps) * height * ramp)
        return r

    requests, t, top = [], 0.0, cfg.peak_rps
    while True:  # thinning: candidate arrivals at the top rate, each kept with rate(t) / top
        t += rng.expovariate(top)
        if t >= cfg.duration_s:
            break
        if rng.random() * top > rate(t):
            continue
        prompt = int(
            min(
                cfg.max_model_len // 2,
                max(8, rng.lognormvariate(math.log(cfg.prompt_median), cfg.prompt_sigma)),
            )
        )
        output = int(
            min(
                cfg.max_model_len - prompt,
                max(4, rng.lognormvariate(math.log(cfg.output_median), cfg.output_sigma)),
            )
        )
        requests.append(Request(t, prompt, output))
    return requests, rate


# -- the policies --------------------------------------------------------------------------------


class Policy:
    name = ""
    interval_s = 2.0
    routing = "router"  # or "round-robin": how requests reach the workers
    router_view: RouterLoad | None = None  # what the router's /metrics says, set before decide

    def decide(self, now: float, workers: list[Worker], current: int) -> tuple[int, tuple[str, ...]]:
        raise NotImplementedError


class KvscalePolicy(Policy):
    """The operator's autoscaler: the same `Autoscaler` object operator/autoscaler/scaler.py drives, fed
    what the operator reads from each pod (its status and its /metrics)."""

    name = "kvscale"

    def __init__(self, params: Params) -> None:
        self.params = params
        self.scaler = Autoscaler(interval_s=self.interval_s)

    def decide(self, now, workers, current):
        pods, timings = [], []
        for w in workers:
            if w.draining_since is not None:
                pods.append(PodLoad(w.name, "terminating"))
            elif not w.ready(now):
                pods.append(PodLoad(w.name, "starting"))
            else:
                pods.append(
                    PodLoad(w.name, "ready", w.kv_usage(), len(w.waiting), len(w.running), w.arrivals())
                )
            ready = w.ready(now)
            timings.append(
                PodTiming(
                    w.name, w.started_at, w.ready_at if ready else None, w.compile_s(now) if ready else None
                )
            )
        routers = (self.router_view,) if self.router_view is not None else ()
        self.scaler.observe(Sample(now, tuple(pods), routers), timings, self.params)
        d = self.scaler.decide(current, self.params)
        return d.replicas, d.victims


class RoundRobinServicePolicy(KvscalePolicy):
    """Our autoscaler with the workers behind a round-robin Service instead of the router: no
    router queue (a request goes to the next worker, which queues or refuses it), no router view."""

    name = "kvscale-round-robin"
    routing = "round-robin"


class RequestCountPolicy(Policy):
    """KubeAI: replicas = ceil(average active requests over timeWindow / targetRequests)."""

    name = "request-count"
    interval_s = 10.0

    def __init__(
        self, lo: int, hi: int, target_requests: float, window_s: float = 600.0, delay_s: float = 30.0
    ):
        self.lo, self.hi, self.target, self.delay = lo, hi, target_requests, delay_s
        self.samples: deque[float] = deque(maxlen=max(1, int(window_s / self.interval_s)))
        self.below_since: float | None = None

    def decide(self, now, workers, current):
        self.samples.append(sum(w.in_flight() for w in workers if w.draining_since is None))
        want = min(self.hi, max(self.lo, math.ceil(sum(self.samples) / len(self.samples) / self.target)))
        if want >= current:
            self.below_since = None
            return want, ()
        self.below_since = now if self.below_since is None else self.below_since
        return (want, ()) if now - self.below_since >= self.delay else (current, ())


class HpaUtilisationPolicy(Policy):
    """A HorizontalPodAutoscaler (autoscaling/v2 defaults) on accelerator utilisation."""

    name = "hpa-utilisation"
    interval_s = 15.0

    def __init__(self, lo: int, hi: int, target: float = 0.7, metric_window_s: float = 30.0):
        self.lo, self.hi, self.target, self.window = lo, hi, target, metric_window_s
        self.recs: deque[tuple[float, int]] = deque()

    def decide(self, now, workers, current):
        ready = [w for w in workers if w.ready(now)]
        if not ready:
            return current, ()
        util = sum(w.utilisation(now, self.window) for w in ready) / len(ready)
        ratio = util / self.target
        # Pods not yet ready count at 0 % when scaling up would follow; the HPA skips them.
        rec = current if abs(ratio - 1) <= 0.1 else math.ceil(len(ready) * ratio)
        rec = min(self.hi, max(self.lo, rec))
        self.recs.append((now, rec))
        while self.recs and self.recs[0][0] < now - 300:
            self.recs.popleft()
        if rec > current:  # default scale-up: max(+4 pods, +100 %) per 15 s, no stabilisation
            return min(rec, max(current + 4, 2 * current)), ()
        return min(current, max(r for _, r in self.recs)), ()  # 300 s scale-down stabilisation


class OraclePolicy(Policy):
    """A bound, not a policy anyone can run: it knows the trace's arrival rate one model load
    ahead and how many requests/s one worker takes (the trace's peak rate over static peak's
    workers), and sizes for the higher of now and then, never under `lo` workers (the simulator
    uses 2: one worker alone has no one to share a burst with). What separates a policy from this
    row is what a better forecast and a known capacity could still win."""

    name = "oracle"

    def __init__(self, rate: Callable[[float], float], per_worker: float, lead_s: float, lo: int, hi: int):
        self.rate, self.per_worker, self.lead, self.lo, self.hi = rate, per_worker, lead_s, lo, hi

    def decide(self, now, workers, current):
        demand = max(self.rate(now), self.rate(now + self.lead)) / self.per_worker
        return min(self.hi, max(self.lo, math.ceil(demand - 1e-9))), ()


class StaticPolicy(Policy):
    name = "static-peak"
    interval_s = 3600.0

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def decide(self, now, workers, current):
        return self.replicas, ()


# -- the simulation ---------------------------------------------------------------------------


@dataclass
class Result:
    policy: str
    slo_attainment: float
    replica_seconds: float
    requests: int
    dropped_429: int
    aborted: int
    scaling_actions: int
    ttft_p50_s: float
    ttft_p99_s: float
    max_replicas: int
    timeline: list[tuple[float, int, float]] = field(default_factory=list)  # (t, workers, rate)


def run(
    policy: Policy,
    requests: list[Request],
    rate: Callable[[float], float],
    model: WorkerModel,
    duration: float,
    slo_s: float,
    initial: int = 1,
    dt: float = 0.05,
) -> Result:
    reqs = [Request(r.arrival, r.prompt, r.output) for r in requests]  # fresh copies per policy
    counter = 0

    def new_worker(now: float, load: bool) -> Worker:
        nonlocal counter
        counter += 1
        return Worker(f"w{counter:03d}", model, now + (model.load_time_s if load else 0.0), now)

    workers = [new_worker(0.0, load=False) for _ in range(initial)]
    for w in workers:  # already running (and compiled) at the start, having started like any other
        w.started_at = -model.load_time_s - model.compile_time_s
        w.ready_at, w.compiled_at = -model.compile_time_s, 0.0
    desired, actions, replica_seconds = initial, 0, 0.0
    next_decision, i, t, timeline = 0.0, 0, 0.0, []
    held: deque[Request] = deque()  # the router's queue
    routed, turn = 0, 0
    arrivals = [r.arrival for r in reqs]
    end = duration + 120.0  # let the last requests finish
    while t < end:
        if t >= next_decision and t < duration:
            live = [w for w in workers if w.alive()]
            current = sum(1 for w in live if w.draining_since is None)
            policy.router_view = (
                RouterLoad("router", len(held), sum(w.in_flight() for w in live), routed)
                if policy.routing == "router"
                else None
            )
            want, victims = policy.decide(t, live, current)
            if want != current:
                actions += 1
            if want > current:
                workers += [new_worker(t, load=True) for _ in range(want - current)]
            elif want < current:
                serving = [w for w in live if w.draining_since is None]
                named = [w for w in serving if w.name in victims]
                # Without a deletion cost the ReplicaSet removes not-ready pods, then the newest.
                rest = sorted(
                    (w for w in serving if w.name not in victims),
                    key=lambda w: (w.ready(t), -w.ready_at),
                )
                for w in (named + rest)[: current - want]:
                    w.draining_since = t
            desired = want
            next_decision = t + policy.interval_s
        # Route what waits at the router, then this tick's arrivals, through the router's picker.
        j = bisect.bisect_left(arrivals, t + dt, lo=i)
        ready = {w.name: w for w in workers if w.ready(t)}
        while held and t - held[0].arrival > ROUTER_QUEUE_TIMEOUT_S:
            held.popleft().dropped = "429"  # the router's 503 after its queue timeout
        pending = [*held, *reqs[i:j]]
        held.clear()
        routed += j - i
        for r in pending:
            if policy.routing == "round-robin":
                name = pick_round_robin(_candidates(ready.values()), turn, ROUTER_PICKER)
                turn += 1
                if name is None or not ready[name].submit(r):
                    r.dropped = "429"
                continue
            name = None if held else pick(_candidates(ready.values()), 0, routed + len(held), ROUTER_PICKER)
            if name is None:  # nobody can take it (or others wait first): the router holds it
                if len(held) >= ROUTER_MAX_QUEUED:
                    r.dropped = "429"
                else:
                    held.append(r)
            elif not ready[name].submit(r):
                r.dropped = "429"
        i = j
        alive = 0
        for w in workers:
            if not w.alive():
                continue
            alive += 1
            w.step(t, dt)
            if w.draining_since is not None and (
                not w.in_flight() or t - w.draining_since > model.drain_timeout_s
            ):
                for s in [*w.running, *w.waiting]:
                    s.req.dropped = "aborted"
                w.gone_at = t
        replica_seconds += alive * dt
        if round(t / dt) % round(5.0 / dt) == 0:
            timeline.append(
                (round(t, 1), sum(w.alive() and w.draining_since is None for w in workers), rate(t))
            )
        workers = [w for w in workers if w.alive()]
        t += dt
    del desired
    ttfts = sorted(r.first_token - r.arrival for r in reqs if r.first_token is not None and not r.dropped)
    good = sum(
        1 for r in reqs if not r.dropped and r.first_token is not None and r.first_token - r.arrival <= slo_s
    )

    def pct(q: float) -> float:
        return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 3) if ttfts else float("nan")

    return Result(
        policy=policy.name,
        slo_attainment=good / len(reqs) if reqs else 1.0,
        replica_seconds=round(replica_seconds, 1),
        requests=len(reqs),
        dropped_429=sum(r.dropped == "429" for r in reqs),
        aborted=sum(r.dropped == "aborted" for r in reqs),
        scaling_actions=actions,
        ttft_p50_s=pct(0.5),
        ttft_p99_s=pct(0.99),
        max_replicas=max((n for _, n, _ in timeline), default=initial),
        timeline=timeline,
    )


ROUTER_PICKER = PickerConfig()  # the router's defaults (--max-waiting 32, --max-kv-usage 0.95, ...)
ROUTER_MAX_QUEUED, ROUTER_QUEUE_TIMEOUT_S = 256, 60.0


def _candidates(ready) -> list[Candidate]:
    """What the router knows of each ready worker: its scraped KV usage and counts (fresh here)
    and its own requests there (all of them: every request goes through the router)."""
    return [
        Candidate(w.name, kv_usage=w.kv_usage(), waiting=len(w.waiting), running=len(w.running),
                  in_flight=w.in_flight())
        for w in ready
    ]  # fmt: skip


def simulate(
    seed: int = 1,
    duration: float = 3600.0,
    slo_s: float = 1.0,
    max_replicas: int = 16,
    model: WorkerModel | None = None,
    trace: TraceConfig | None = None,
    policies: tuple[str, ...] = (
        "kvscale",
        "kvscale-round-robin",
        "request-count",
        "hpa-utilisation",
        "oracle",
        "static-peak",
    ),
    autoscaling: dict | None = None,
) -> dict:
    """`autoscaling`: AutoscalingSpec fields (snake_case) overriding its defaults for our policy."""
    model = model or WorkerModel()
    trace = trace or TraceConfig(duration_s=duration)
    requests, rate = make_trace(trace, random.Random(seed))
    spec = AutoscalingSpec(min_replicas=1, max_replicas=max_replicas, **(autoscaling or {}))
    # KubeAI's default targetRequests (100) is for vLLM's 256 sequences; the same share of ours.
    target_requests = 100 / 256 * model.max_num_seqs
    makers: dict[str, Callable[[], Policy]] = {
        "kvscale": lambda: KvscalePolicy(Params.from_spec(spec)),
        "kvscale-round-robin": lambda: RoundRobinServicePolicy(Params.from_spec(spec)),
        "request-count": lambda: RequestCountPolicy(1, max_replicas, target_requests),
        "hpa-utilisation": lambda: HpaUtilisationPolicy(1, max_replicas),
    }
    results = []
    for name in policies:
        if name in ("static-peak", "oracle"):
            continue
        results.append(run(makers[name](), requests, rate, model, trace.duration_s, slo_s))
    if "static-peak" in policies or "oracle" in policies:
        static = None
        for n in range(1, max_replicas + 1):  # the fewest fixed workers that meet the SLO
            static = run(StaticPolicy(n), requests, rate, model, trace.duration_s, slo_s, initial=n)
            if static.slo_attainment >= 0.99:
                break
        assert static is not None
        if "oracle" in policies:
            peak = max(rate(t) for t in range(int(trace.duration_s)))
            # Its lead: until a new worker's capacity is all there (Ready, then the compiled steps).
            lead = model.load_time_s + model.compile_time_s
            oracle = OraclePolicy(rate, peak / static.max_replicas, lead, 2, max_replicas)
            results.append(run(oracle, requests, rate, model, trace.duration_s, slo_s))
        if "static-peak" in policies:
            results.append(static)
    return {
        "seed": seed,
        "slo_ttft_s": slo_s,
        "worker": asdict(model),
        "trace": asdict(trace),
        "autoscaling_spec": spec.model_dump(by_alias=True),
        "requests": len(requests),
        "results": [asdict(r) for r in results],
    }


def table(report: dict) -> str:
    rows = report["results"]
    static = next((r for r in rows if r["policy"] == "static-peak"), None)
    lines = [
        f"| policy | TTFT ≤ {report['slo_ttft_s']:g} s | TTFT p50 / p99 (s) | replica-seconds | "
        "vs static peak | 429 / aborted | scaling actions | most workers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = f"{r['replica_seconds'] / static['replica_seconds']:.0%}" if static else "-"
        lines.append(
            f"| {r['policy']} | {r['slo_attainment']:.2%} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
            f"{r['replica_seconds']:,.0f} | {share} | {r['dropped_429']} / {r['aborted']} | "
            f"{r['scaling_actions']} | {r['max_replicas']} |"
        )
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    for r in report["results"]:
        xs = [p[0] / 60 for p in r["timeline"]]
        ax.step(xs, [p[1] for p in r["timeline"]], where="post", label=f"{r['policy']} (workers)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("workers serving")
    rate_ax = ax.twinx()
    first = report["results"][0]["timeline"]
    rate_ax.fill_between(
        [p[0] / 60 for p in first], [p[2] for p in first], color="grey", alpha=0.2, label="arrival rate"
    )
    rate_ax.set_ylabel("requests/s offered (grey)")
    ax.set_zorder(rate_ax.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(
        f"Autoscaling policies on one trace (seed {report['seed']}, TTFT SLO {report['slo_ttft_s']:g} s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _overrides(pairs: list[str]) -> dict:
    fields = {f.alias or name: name for name, f in AutoscalingSpec.model_fields.items()}
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[fields.get(key, key)] = json.loads(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/simulate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of trace")
    parser.add_argument("--slo", type=float, default=1.0, help="TTFT bound in seconds")
    parser.add_argument("--max-replicas", type=int, default=16)
    parser.add_argument(
        "--load-time", type=float, default=WorkerModel.load_time_s, help="seconds from scale-up to Ready"
    )
    parser.add_argument(
        "--compile-time",
        type=float,
        default=WorkerModel.compile_time_s,
        help="seconds from Ready to compiled steps (eager steps until then; 0: compiled from Ready)",
    )
    parser.add_argument("--kv-blocks", type=int, default=WorkerModel.kv_blocks)
    parser.add_argument(
        "--policies", default="kvscale,kvscale-round-robin,request-count,hpa-utilisation,oracle,static-peak"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override an autoscaling field of our policy, e.g. targetKvCacheUsage=0.4 (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument("--timeline", action="store_true", help="keep the timelines in the JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw workers and load over time (needs matplotlib)")
    args = parser.parse_args(argv)
    model = WorkerModel(
        load_time_s=args.load_time, compile_time_s=args.compile_time, kv_blocks=args.kv_blocks
    )
    report = simulate(
        seed=args.seed,
        duration=args.duration,
        slo_s=args.slo,
        max_replicas=args.max_replicas,
        model=model,
        policies=tuple(args.policies.split(",")),
        autoscaling=_overrides(args.set),
    )
    if args.plot:
        plot(report, args.plot)
    if not args.timeline:
        for r in report["results"]:
            r.pop("timeline")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
