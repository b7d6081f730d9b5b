"""Stragglers: a rank whose own work (compute, input) is slower than its peers'.

Design notes: docs/detectors.md, "detectors/straggler/detector.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import metric_evidence, num
from rankscope.detectors.frame import StepFrame, diverged, work_group
from rankscope.detectors.gpu.readings import gpu_context
from rankscope.detectors.signal import DetectorOutput, Signal
from rankscope.detectors.stats.consensus import (
    Z_CAP,
    excess_floor_s,
    group_min,
    peer_consensus,
    readings,
    step_reference_s,
    strict_majority,
)
from rankscope.detectors.stats.consensus_config import ConsensusConfig
from rankscope.detectors.stats.history import RankHistory
from rankscope.detectors.stats.history_state import PartsState, make_window
from rankscope.detectors.stats.peers import PeerCache
from rankscope.detectors.stats.persistence import FlagRate, StreakCounter, required_streak
from rankscope.detectors.straggler.expert_load import expert_busy
from rankscope.detectors.straggler.input_wait import waited_out
from rankscope.detectors.straggler.lead import leading
from rankscope.detectors.straggler.lead_chance import LeadChance
from rankscope.detectors.straggler.own_time import UsualWait, net_of_host_wait, own_time
from rankscope.detectors.straggler.pair import pair_named
from rankscope.detectors.straggler.pair_gap import PairGap, pair_gap_hits, pair_gap_signal
from rankscope.detectors.straggler.pipeline_victim import pipeline_victims
from rankscope.detectors.straggler.slowest_count import SlowestCount, slowest_hits, slowest_signal
from rankscope.detectors.straggler.sped_up import peers_sped_up
from rankscope.detectors.straggler.streaks import SlowStreaks
from rankscope.detectors.straggler.token_model import TokenModel, per_median_batch
from rankscope.detectors.straggler.window import noise_evidence, window_hits, window_signal

__all__ = ["StragglerConfig", "StragglerState", "detect"]

NAME = "straggler"


@dataclass(kw_only=True, slots=True)
class StragglerConfig(ConsensusConfig):
    """Settings of the straggler detector (times in seconds); the shared peer-consensus
    settings (z_min, floors, streaks, history, windows) come from ``ConsensusConfig``."""

    metrics: tuple[str, ...] = ("compute_s", "data_s")  # per-rank work times judged
    # of those, the ones judged by what they cost the step: an excess of at least
    # (min_ratio - 1) of the step time, not min_ratio of their own (tiny) peer median
    step_share_metrics: tuple[str, ...] = ("data_s",)
    input_wait_frac: float = 0.5  # and its peers' comm_s over its own by this share (0: off)
    min_ratio: float = 1.1  # and at least this multiple of the peer median
    strong_z: float = 7.0  # a step this far above its peers is clear: own chance rate, streak
    history_k_sigma: float = 4.0  # or this many robust sigmas above its own median
    window_metric: str = "compute_s"  # "" turns the windowed test off (straggler/window.py)
    per_token: bool = True  # expect compute from tokens when every rank reports them
    lead_steps: int = 2  # the fast rule (straggler/lead.py): steps in a row; 0 turns it off
    lead_ratio: float = 1.3  # compute at least this multiple of the group median...
    lead_over_peers: float = 1.25  # ...and of every other member's
    lead_mild_ratio: float = 1.2  # a mild lead: the other steps of the run may show this...
    lead_mild_over_peers: float = 1.1  # ...and this over every other member
    lead_after: int = 12  # judged steps before any lead counts (young spreads mislead)
    lead_mild_after: int = 16  # and before a mild one counts
    lead_wait_frac: float = 0.5  # peers' comm_s over its own by this share of its excess
    lead_step_frac: float = 0.1  # and its excess at least this share of the job's step time
    lead_z: float = 2.0  # and this many of the group's learnt spreads (0: not asked)
    lead_long_steps: int = 3  # a longer run of looser leads, one strong (0: off)...
    lead_long_alone: int = 4  # ...or this many of them with none strong (0: not enough)
    lead_long_ratio: float = 1.1  # ...at this multiple of the group median,
    lead_long_over_peers: float = 1.05  # this of every other member's,
    lead_long_wait_frac: float = 0.2  # this share of its excess waited by its peers,
    lead_long_step_frac: float = 0.07  # this share of the job's step,
    lead_long_z: float = 1.3  # and this many learnt spreads (at most lead_z's)
    lead_chance_quiet: int = 6  # a naming this short, then as long unnamed, was chance...
    lead_chance_cap: int = 2  # ...and each asks one more lead of every run, up to this
    pair_lead_over: float = 1.4  # two peers (straggler/pair_lead.py): a lead over the partner
    pair_lead_strong_over: float = 1.5  # ...and a strong one (0 turns the rule off)
    pair_gap_steps: int = 16  # two peers (straggler/pair_gap.py): window; 0 turns it off
    pair_gap_ratio: float = 1.2  # mean gap to the partner and over the usual gap, both
    slowest_steps: int = 16  # often the slowest (straggler/slowest_count.py): window; 0: off

    def __post_init__(self) -> None:
        ConsensusConfig.__post_init__(self)  # zero-argument super() fails on slotted dataclasses
        if not self.metrics:
            raise ValueError("metrics must name at least one column")
        if self.strong_z < self.z_min:
            raise ValueError("strong_z must be >= z_min")
        if self.min_ratio < 1.0 or self.history_ratio < 1.0:
            raise ValueError("min_ratio and history_ratio must be >= 1")
        if self.history_k_sigma < 0:
            raise ValueError("history_k_sigma must be >= 0")
        if self.lead_steps < 0 or self.lead_ratio < 1.0 or self.lead_over_peers < 1.0:
            raise ValueError("lead_steps must be >= 0, lead_ratio and lead_over_peers >= 1")
        if not (1.0 <= self.lead_mild_ratio <= self.lead_ratio
                and 1.0 <= self.lead_mild_over_peers <= self.lead_over_peers):  # fmt: skip
            raise ValueError("the mild lead margins must be in [1, the strong ones]")
        if not 0 <= self.lead_after <= self.lead_mild_after:
            raise ValueError("need 0 <= lead_after <= lead_mild_after")
        if self.lead_z < 0:
            raise ValueError("lead_z must be >= 0")
        if self.lead_long_alone and self.lead_long_alone <= self.lead_long_steps:
            raise ValueError("lead_long_alone must be 0 or more than lead_long_steps")
        if self.lead_chance_quiet < 1 or self.lead_chance_cap < 0:
            raise ValueError("lead_chance_quiet must be >= 1 and lead_chance_cap >= 0")
        if not (0 <= self.lead_long_steps and 1.0 <= self.lead_long_ratio <= self.lead_mild_ratio
                and 1.0 <= self.lead_long_over_peers <= self.lead_mild_over_peers
                and 0.0 <= self.lead_long_wait_frac <= self.lead_wait_frac
                and 0.0 <= self.lead_long_step_frac <= self.lead_step_frac
                and 0.0 <= self.lead_long_z):  # fmt: skip
            raise ValueError("the long-run lead margins must be in [their floor, the mild ones]")
        if not (0.0 <= self.lead_wait_frac <= 1.0 and 0.0 <= self.lead_step_frac <= 1.0):
            raise ValueError("lead_wait_frac and lead_step_frac must be in [0, 1]")
        if not 0.0 <= self.input_wait_frac <= 1.0:
            raise ValueError("input_wait_frac must be in [0, 1]")
        top = self.pair_lead_strong_over
        if top and not 1.0 <= self.pair_lead_over <= top:
            raise ValueError("need 1 <= pair_lead_over <= pair_lead_strong_over (or the latter 0)")
        if self.pair_gap_steps < 0 or self.pair_gap_ratio <= 1.0:
            raise ValueError("pair_gap_steps must be >= 0 and pair_gap_ratio > 1")
        if not 0 <= self.slowest_steps <= 256:
            raise ValueError("slowest_steps must be in [0, 256]")
        if self.window_metric and self.window_metric not in self.metrics:
            raise ValueError("window_metric must be one of metrics (or empty)")


class StragglerState(PartsState):
    """Peer index cache, per-rank clean history, slow streaks, windows and token model."""

    __slots__ = ("peers", "history", "streaks", "pair_streak", "pair_rate", "window", "tokens",
                 "lead", "lead_strong", "lead_long", "long_strong", "lead_chance", "pair_named",
                 "named_rate", "suspect", "pair_gap", "slowest", "usual_wait")  # fmt: skip
    PARTS = ("history", "streaks", "pair_streak", "pair_rate", "window", "tokens", "lead",
             "lead_strong", "lead_long", "long_strong", "lead_chance", "pair_named",
             "named_rate", "pair_gap", "slowest", "usual_wait")  # fmt: skip

    def __init__(self, cfg: StragglerConfig) -> None:
        self.peers = PeerCache()
        self.history = RankHistory(cfg.metrics, cfg.history_steps)
        self.streaks = SlowStreaks(cfg.metrics, cfg.history_steps)
        self.pair_streak = StreakCounter()
        self.pair_rate = FlagRate(cfg.history_steps)
        self.window = make_window(cfg)
        self.tokens = TokenModel()
        self.lead = StreakCounter()  # steps in a row a rank led its group (straggler/lead.py)
        self.lead_strong = StreakCounter()  # of those, the steps since the run's 1st strong one
        self.lead_long = StreakCounter()  # the same for the looser leads of a longer run
        self.long_strong = StreakCounter()
        self.lead_chance = LeadChance()  # its namings that came to nothing (lead_chance.py)
        self.pair_named = StreakCounter()  # leaky: steps its pair's histories named it (pair.py)
        self.named_rate = FlagRate(cfg.history_steps)  # how often chance ends such a streak
        self.suspect: tuple[int, np.ndarray] | None = None  # (step, rows its pair flagged)
        self.pair_gap = PairGap(cfg.pair_gap_steps, cfg.history_steps, cfg.history_min_steps,
                                cfg.pair_gap_ratio)  # fmt: skip
        self.slowest = SlowestCount(cfg.slowest_steps)  # slowest-of-group counts
        self.usual_wait = UsualWait()  # each rank's usual wait for a CPU (own_time.py)

    def learn(self, frame: StepFrame, clean_mask: np.ndarray) -> None:
        if diverged(frame):  # not the model's work: nothing to learn (``detect``)
            return
        own, frame = clean_mask, own_time(frame, self.usual_wait)  # what detect judged
        self.usual_wait.learn(frame)
        if self.suspect is not None and self.suspect[0] == frame.step:
            # a row its pair flagged this step does not teach its own history: the pair
            # rule judges it by that history, which would learn the fault within steps
            flagged = self.suspect[1]
            if flagged.shape == clean_mask.shape:
                own = clean_mask & ~flagged
        self.suspect = None
        self.history.learn(frame.rank, frame.m, own)
        self.tokens.learn(clean_mask)
        self.window.learn(float(np.mean(clean_mask)) if clean_mask.size else 0.0, frame.step)
        self.pair_gap.learn(clean_mask)


@net_of_host_wait  # compute at each rank's usual wait for a CPU (straggler/own_time.py)
def detect(frame: StepFrame, state: StragglerState, cfg: StragglerConfig) -> DetectorOutput:
    """A rank whose own compute or input time is persistently slower than its peers'."""
    out = DetectorOutput()
    n = frame.n
    if n == 0 or diverged(frame):  # NaN weights everywhere: timing blames no one
        return out
    idx = state.peers.get(work_group(frame))  # tp partners do the same work as dp peers
    x = readings(frame, cfg.metrics)
    c = peer_consensus(idx, x)
    out.scores = c.scores(cfg.metrics)
    floors = np.full((len(cfg.metrics), 1), cfg.min_excess_s)  # per metric: _floors
    few = int(c.count.min()) < 3  # some group has fewer than three reporting peers
    win = busy = None
    if cfg.window_metric:
        busy = expert_busy(frame, idx, c, cfg.metrics.index(cfg.window_metric), cfg,
                           state.history)  # fmt: skip
        win = window_hits(frame, idx, c, state.window, state.tokens, cfg, busy)
    wi = cfg.metrics.index(cfg.window_metric) if cfg.window_metric else 0
    most = None  # often its group's slowest (straggler/slowest_count.py)
    if cfg.window_metric and cfg.slowest_steps:
        rel = win.step_ratio if win is not None and win.per_token else None
        most = slowest_hits(frame, idx, c, wi, state.slowest, cfg, busy, state.window, rel)
    batched = None  # two peers: compute per median batch, and which rows the model scaled
    if few and win is not None and win.per_token:
        x, batched = per_median_batch(frame, idx, x, wi, state.tokens)
    gap = None
    if few and cfg.window_metric and cfg.pair_gap_steps:
        xw = x[cfg.metrics.index(cfg.window_metric)]
        gap = pair_gap_hits(frame, idx, xw, state.pair_gap, cfg, batched)
    with np.errstate(invalid="ignore"):
        slow = c.z > cfg.z_min  # the selective test first; the rest only if needed
        if slow.any():
            slow &= (x > cfg.min_ratio * c.median) & (x - c.median > floors)
        single = ((c.count == 1) & np.isfinite(x)) if few else np.zeros_like(slow)
        if slow.any() or few:  # the step floor costs a median
            floors = _floors(frame, cfg)
            slow &= x - c.median > floors
            slow = waited_out(frame, idx, c, slow, cfg)  # straggler/input_wait.py
        if win is not None and win.per_token:  # slow for its batch (own floors), and a
            slow[cfg.metrics.index(cfg.window_metric)] = win.step_hit  # long batch is not
        elif win is not None and win.step_hit.any():
            slow[cfg.metrics.index(cfg.window_metric)] |= win.step_hit
        hit = slow & strict_majority(idx, slow, c.count) if slow.any() else slow
        pair = np.zeros_like(hit)
        named = np.zeros_like(hit)  # pair rows their histories single out (straggler/pair.py)
        if few and (c.count == 2).any():
            low = group_min(idx, x)
            pair = (c.count == 2) & (x > cfg.min_ratio * low) & (x - low > floors)
            # two peers cannot outvote each other; the slower one must at least be slow
            # for itself too, or it is only the job's noise
            for i, rows in ((i, np.flatnonzero(pair[i])) for i in range(len(cfg.metrics))):
                if rows.size:
                    limit, hmed = state.history.slow_limit(
                        frame.rank[rows],
                        cfg.metrics[i],
                        ratio=cfg.history_ratio,
                        k_sigma=cfg.history_k_sigma,
                        min_count=cfg.history_min_steps,
                    )
                    if cfg.metrics[i] == cfg.window_metric:  # compute; input waits are noise
                        named[i, rows] = pair_named(frame, idx, state, cfg, i, rows, x, hmed)
                    pair[i, rows] = (x[i, rows] > limit) | named[i, rows]
        for i in np.flatnonzero(single.any(axis=1)):
            rows = np.flatnonzero(single[i])
            limit, hmed = state.history.slow_limit(
                frame.rank[rows],
                cfg.metrics[i],
                ratio=cfg.history_ratio,
                k_sigma=cfg.history_k_sigma,
                min_count=cfg.history_min_steps,
            )
            s = (x[i, rows] > limit) & (x[i, rows] - hmed > floors[i, 0])
            if s.sum() * 2 < rows.size:  # most peerless ranks fine: not a workload change
                hit[i, rows] |= s
    lead, lead_run = leading(frame, idx, c, state, cfg, win, (x[wi], batched))
    if lead.any():
        hit[cfg.metrics.index(cfg.window_metric), lead] = True
    victims = _victims(frame, c, hit | pair, win, state, cfg)
    if victims.any():  # a partner stage's slowness, not its own: the step does not count
        hit[:, victims] = False
        pair[:, victims] = False
        named[:, victims] = False
        lead &= ~victims
    dev = hit.any(axis=0)
    sped_up = _sped_up_of(frame, idx, c, state, cfg, busy)
    if dev.any() or state.streaks.open():  # else nothing to advance or reset
        strong = _strong(hit, win, cfg)
        confirmed, streak = state.streaks.update(frame.rank, hit, strong, cfg)
        fast = lead & ~confirmed  # the fast rule needs no chance-rate streak
        streak = np.where(fast, np.maximum(streak, lead_run), streak)  # onset: the lead's 1st step
        confirmed = (confirmed | lead) & ~sped_up(confirmed | lead)
        if win is not None and confirmed.any():  # the window holds it from now on
            state.window.hold(frame.rank[confirmed])
        for row in np.flatnonzero(confirmed):
            if fast[row] and c.count[wi, row] == 2:  # the fast rule on two peers (pair_lead.py)
                out.signals.append(_pair_signal(frame, x, wi, int(row), idx.peers_of(int(row)),
                                                state, cfg, int(streak[row]), "pair_lead"))
                continue
            out.signals.append(
                _signal(frame, idx, c, hit, int(row), state, cfg, int(streak[row]), win,
                        bool(fast[row]))  # fmt: skip
            )
    else:
        state.streaks.idle(n)
    if win is not None:
        said = {s.ranks[0] for s in out.signals}
        sped = sped_up(win.hit)
        for row in np.flatnonzero(win.hit & ~sped & ~victims):
            if int(frame.rank[row]) not in said:
                out.signals.append(window_signal(frame, idx, c, win, int(row), state, cfg))
    if most is not None and most.hit.any():
        said = {s.ranks[0] for s in out.signals}
        for row in np.flatnonzero(most.hit & ~sped_up(most.hit) & ~victims):
            if int(frame.rank[row]) not in said:
                out.signals.append(slowest_signal(frame, idx, c, wi, most, int(row), state, cfg))
    if gap is not None and gap.hit.any():  # the partner's speed-up is what this rule reads
        said = {s.ranks[0] for s in out.signals}
        # of two pipeline partners both trailing their replicas, the one that trails by
        # more is the cause: the other's gap is the echo of its late activations
        echo = pipeline_victims(frame, gap.hit[None, :], np.nan_to_num(gap.ratio),
                                np.zeros(frame.n, dtype=np.int64))  # fmt: skip
        for row in np.flatnonzero(gap.hit & ~victims & ~echo):
            if int(frame.rank[row]) not in said:
                out.signals.append(pair_gap_signal(frame, xw, int(row), gap, state, cfg))
    pair_any = pair.any(axis=0)
    if pair_any.any():
        state.suspect = (frame.step, pair_any)
    if not (pair_any.any() or state.pair_streak.count.any() or state.pair_named.count.any()):
        return out
    pprev = state.pair_streak.peek(frame.rank)
    pstreak = state.pair_streak.update(frame.rank, pair_any, leaky=True)
    named_any = (named & pair).any(axis=0)
    hprev = state.pair_named.peek(frame.rank)
    held = state.pair_named.update(frame.rank, named_any, leaky=True)
    pneed = required_streak(state.pair_rate, pprev, pair_any, n, cfg)
    # the named steps have their own, rarer chance streaks: their own rate sets their need
    hneed = required_streak(state.named_rate, hprev, named_any, n, cfg)
    done: set[int] = set()
    for row in np.flatnonzero(pair_any & ((pstreak >= pneed) | (held >= hneed))):
        members = idx.peers_of(int(row))
        key = int(idx.row_gid[row])
        if key in done:
            continue
        done.add(key)
        if gap is not None and gap.hit[members].any():
            continue  # the sustained gap names one of the two (straggler/pair_gap.py)
        with np.errstate(invalid="ignore", divide="ignore"):  # an idle metric's median is 0
            i = int(np.argmax(np.where(pair[:, row], x[:, row] / c.median[:, row], -np.inf)))
        if named[i, row] or held[row]:
            out.signals.append(_pair_signal(frame, x, i, int(row), members, state, cfg,
                                            int(pstreak[row])))  # fmt: skip
            continue
        out.signals.append(
            Signal(
                kind="straggler",
                ranks=tuple(int(r) for r in frame.rank[members]),
                detector=NAME,
                score=float(x[i, row] / c.median[i, row]),
                severity="transient",
                evidence=metric_evidence(
                    cfg.metrics[i],
                    x[i, row],
                    c.median[i, row],
                    x[i, members],
                    slower_rank=int(frame.rank[row]),
                    reason="two peers disagree; no majority to attribute",
                ),
                unattributed=True,
            )
        )
    return out


def _floors(frame, cfg) -> np.ndarray:
    """Per metric (a column), the excess in seconds a slow step needs. Input waits
    (``step_share_metrics``) must cost the step ``min_ratio - 1`` of its time: their peer
    median is a millisecond, and a ratio to it makes every few-millisecond hiccup of a
    loaded host's loader look like a slowdown."""
    floor = excess_floor_s(frame, cfg)
    share = max(floor, (cfg.min_ratio - 1.0) * step_reference_s(frame))
    col = [share if m in cfg.step_share_metrics else floor for m in cfg.metrics]
    return np.asarray(col, dtype=np.float64)[:, None]


def _pair_signal(frame, x, i, row, members, state, cfg, streak, rule="pair") -> Signal:
    """The slower of two peers, named on its own history (straggler/pair.py)."""
    other = members[members != row]
    _, hmed, _ = state.history.assess(frame.rank[[row]], cfg.metrics[i])
    with np.errstate(divide="ignore", invalid="ignore"):  # a partner idle in it: 0 s
        ratio = float(x[i, row] / x[i, other[0]])
    return Signal(
        kind="straggler",
        ranks=(int(frame.rank[row]),),
        detector=NAME,
        score=min(ratio, Z_CAP) if ratio == ratio else Z_CAP,
        severity="persistent",
        evidence=metric_evidence(
            cfg.metrics[i],
            x[i, row],
            x[i, other[0]],
            x[i, other],
            history_median=hmed[0],
            rule=rule,
            ratio=num(ratio),
            reason="two peers: it slowed down against its own history, the other did not "
            "and waited for it",
            streak_steps=streak,
            **(state.pair_gap.noise(int(frame.rank[row])) if cfg.metrics[i] == cfg.window_metric
               else {}),
            **({"gpu": g} if (g := gpu_context(frame, row)) else {}),
        ),
    )


def _victims(frame, c, hit, win, state, cfg) -> np.ndarray:
    """Rows slow only as the echo of a slower pipeline partner (straggler/pipeline_victim.py)."""
    slow = hit.copy()
    if win is not None and cfg.window_metric:
        slow[cfg.metrics.index(cfg.window_metric)] |= win.hit
    if not slow.any():
        return np.zeros(frame.n, dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.nan_to_num(np.where(slow, c.x / c.median, 0.0), nan=0.0).max(axis=0)
    metric = cfg.window_metric or cfg.metrics[0]
    standing = state.streaks.streak[(metric, "slow")].peek(frame.rank)
    return pipeline_victims(frame, slow, rel, np.asarray(standing))


def _sped_up_of(frame, idx, c, state, cfg, busy):
    """``of(rows)``: of ``rows``, those whose lead on the windowed metric is their peers'
    speed-up, or their experts' share of the tokens (``busy``, from ``expert_load.py``).
    Computed once a step, on the first call that needs it (the step asks twice, for the
    confirmed rows and the window's; nothing it reads changes in between)."""
    memo: list[np.ndarray] = []

    def of(rows: np.ndarray) -> np.ndarray:
        if not (rows.any() and cfg.window_metric):
            return np.zeros(frame.n, dtype=bool)
        if not memo:
            i = cfg.metrics.index(cfg.window_metric)
            memo.append(peers_sped_up(frame, idx, c, state, i, cfg) | busy)
        return rows & memo[0]

    return of


def _strong(hit, win, cfg) -> np.ndarray:
    """Per metric and row: a slow step far out on a calibrated scale.

    Only the windowed metric's per-step z counts: it is in units of the
    group's spread learnt over many clean steps, and its tail is what the
    chance rate measures. A raw peer z of one step uses that step's MAD, which
    for a near-constant metric (input waits of a fraction of a millisecond)
    makes every hiccup look 100 sigmas out.
    """
    strong = np.zeros_like(hit)
    if win is not None and win.step_hit.any():
        i = cfg.metrics.index(cfg.window_metric)
        with np.errstate(invalid="ignore"):
            strong[i] = hit[i] & win.step_hit & (win.step_z > cfg.strong_z)
    return strong


def _expected(win, row: int, value: float, ratio: float) -> dict:
    """Evidence of a per-step token-aware hit: the rule and what the peers predicted."""
    return {"rule": "step_expected", "per_token": win.per_token, "expected_s": num(value / ratio)}


def _signal(frame, idx, c, hit, row, state, cfg, streak, win, lead=False) -> Signal:
    """Signal for one confirmed slow row, on its most deviating metric."""
    with np.errstate(invalid="ignore", divide="ignore"):  # idle metrics: 0 / 0 off the hit
        ratio = np.where(hit[:, row], c.x[:, row] / c.median[:, row], -np.inf)
    tokens = win is not None and bool(win.step_hit[row])
    if tokens:  # slow for its batch: the ratio that counts is to what its peers predict
        ratio[cfg.metrics.index(cfg.window_metric)] = win.step_ratio[row]
    peerless = not np.isfinite(ratio).any() or np.all(c.count[:, row] == 1)
    i = int(np.argmax(ratio)) if not peerless else int(np.flatnonzero(hit[:, row])[0])
    metric = cfg.metrics[i]
    _, hmed = state.history.median(frame.rank[row : row + 1], metric)
    peers = idx.peers_of(row)
    peers = peers[peers != row]
    value = c.x[i, row]
    by_tokens = tokens and metric == cfg.window_metric
    with np.errstate(invalid="ignore", divide="ignore"):  # an idle peer median: inf
        rel = value / hmed[0] if peerless else value / c.median[i, row]
    if by_tokens:
        rel = win.step_ratio[row]
    if peerless:
        score = float(value / hmed[0]) if hmed[0] > 0 else 0.0
    else:
        score = float(min(win.step_z[row] if by_tokens else c.z[i, row], Z_CAP))
    gpu = gpu_context(frame, row)  # a throttling GPU behind the slowness shows here
    return Signal(
        kind="straggler",
        ranks=(int(frame.rank[row]),),
        detector=NAME,
        score=score,
        severity="persistent",
        evidence=metric_evidence(
            metric,
            value,
            c.median[i, row],
            c.x[i, peers],
            history_median=hmed[0],
            z=win.step_z[row] if by_tokens else c.z[i, row],
            ratio=num(rel),
            slow_metrics=[cfg.metrics[j] for j in np.flatnonzero(hit[:, row])],
            streak_steps=streak,
            **{**(_expected(win, row, value, rel) if by_tokens else {}),
               **({"rule": "lead"} if lead else {}),
               **(noise_evidence(win, row) if metric == cfg.window_metric else {})},
            **({"gpu": gpu} if gpu else {}),
        ),
    )


CONFIG = StragglerConfig
STATE = StragglerState
