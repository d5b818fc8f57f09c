"""Adaptive draft length: each step verifies K drafts per slot or none, whichever the slots' recent
acceptance says produces more tokens per second.

A step of k = K costs c times a step of k = 0 (c measured: the median wall time of each variant's last
TIMED steps at each batch bucket: single steps on a shared machine stray by tens of percent, while c is
1.1-1.4 at batch 1 on 2 CPU cores) and yields, for every slot, one token plus the drafts it accepts.
With a_s the recent accepted drafts per step of slot s (a moving average over its steps that verified
fresh drafts), the batch of n slots produces n + sum(a_s) tokens in time c against n tokens in time 1, so
it drafts when

    sum(a_s) > (c - 1) * n.

Each slot's estimate counts for itself: one slot whose drafts are accepted carries a batch whose others
are not. Both variants are compiled (or captured) at start-up (Shapes.variants), so a switch never
compiles. Tokens stay plain decoding's either way (greedy: identical; sampled: the same distribution),
but a sampled token is drawn differently by a drafting step and by one that drafts nothing, so a batch
holding a request that samples with a seed always drafts: its tokens stay the same alone or batched. A
step of k = 0 keeps every drafter's state whole (the draft's keys at the new position, written 16 steps
at a time: speculative/deferred_keys.py; n-gram proposals from the updated history), so acceptance is
whole again from the second drafting step on (the first verifies what the step without drafts left
pending: with an EAGLE-3 draft, the bonus token copied).

Estimates of slots that have not drafted lately go stale: after `probe` steps without drafting the
batch drafts for two steps (the first verifies what a step without drafts left pending, the bonus token
copied, so only the second measures), and the gap doubles until drafting pays again. Two drafting steps
cost 2 (c - 1) steps more than two without, so both ends of the gap scale with c: the first is
max(PROBE_MIN, 2 (c - 1) / PROBE_FIRST_SHARE) (8 at c = 1.3, the batch-1 cost; 40 at c = 2.5, batch 16's,
where 16 slots draft only when their acceptance averages over 1.5 of 3), the longest max(PROBE_MAX,
2 (c - 1) / PROBE_SHARE) (128 at c = 1.3, 600 at c = 2.5), where probes take PROBE_SHARE of the time. Steps
that share their plan with a prefill are not timed, so a bucket seen only while requests are admitted (8
on the way to 16) takes its gaps from the nearest bucket timed, not from DEFAULT_COST's short ones.

A stale estimate (a new slot's, which starts from the prior, or one whose batch chose not to draft since
its last measure) takes its first new measure with weight STALE_SMOOTHING rather than SMOOTHING: a slot
whose drafts are accepted recovers at its first probe (0.1 -> 1.55 on 3 accepted) and one whose drafts are
not stops sooner. The other way round, a batch that has drafted PLAIN_PROBE steps in a row takes one step
without drafts, so c is timed anew (c is never taken below 1, and steps that shared their plan with a
prefill are not timed).

Each path is timed apart: a step on the logits path (a slot samples, asks for log-probs, penalties or
allowed_token_ids) costs more than an argmax step, and with compile_sampling off it runs eagerly beside
built argmax steps (runner/model_runner.py), so c, the bounds of the probes' gaps and the plain steps taken
to time c are each path's own (the counters of steps since drafting and of drafting steps in a row are the
batch's).

Example, K = 3, c = 1.3: two slots with a = 1.2 and 0.1 give 1.3 > 0.6, so the batch drafts; with
a = 0.2 and 0.1 it does not (0.3 < 0.6).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

SMOOTHING = 0.25  # weight of a new observation in a slot's acceptance average
STALE_SMOOTHING = 0.5  # its weight when the slot's average is stale (new slot, or steps without drafts)
TIMED = 15  # step times kept per (batch bucket, k, path): c is the ratio of their medians
PRIOR_SMOOTHING = 0.1  # weight of a slot's observation in the prior new slots start from
DEFAULT_COST = 1.3  # c before both variants were timed at a bucket on a path (for the gaps: at any)
PROBE_MIN, PROBE_MAX = 8, 128  # steps without drafting before a probe: the first gap, the longest (c <= 1.3)
PROBE_FIRST_SHARE = 0.075  # the share of the time probes take at the first gap (2 x 0.3 / PROBE_MIN)
PROBE_SHARE = 0.005  # with a draft that never pays, the share of the time its probes may take (gaps grow)
PLAIN_PROBE = 256  # drafting steps in a row before one without drafts (c timed anew)


@dataclass
class DraftLength:
    k: int  # the drafts a step verifies when it drafts
    adaptive: bool  # False: every step verifies K
    fresh_without_drafting: bool = False  # a k = 0 step still proposes (n-gram alone): nothing goes stale
    prior: float = 1.0  # where a new slot's estimate starts: the average over past slots' observations
    rate: dict[int, float] = field(default_factory=dict)  # slot -> accepted drafts per step
    fresh: set[int] = field(default_factory=set)  # slots whose pending drafts were proposed for them
    stale: set[int] = field(default_factory=set)  # not measured since admitted or since drafting did not pay
    seconds: dict[tuple[int, int, bool], deque[float]] = field(default_factory=dict)  # (rows, k, logits path)
    since_drafting: int = 0  # steps without drafting
    since_plain: int = 0  # drafting steps in a row
    probe: int = PROBE_MIN  # steps without drafting before the next probe (within the bucket's gaps)
    probing: int = 0  # probe steps still to run
    runner: int = 0  # the runner the times are of

    def admit(self, slot: int) -> None:
        """A request entered the slot: its prefill proposes fresh drafts; its estimate starts at the prior."""
        self.rate[slot] = self.prior
        self.fresh.add(slot)
        self.stale.add(slot)

    def release(self, slot: int) -> None:
        self.rate.pop(slot, None)
        self.fresh.discard(slot)
        self.stale.discard(slot)

    def cost(self, rows: int, borrow: bool = False, logits: bool = False) -> float:
        """c: a drafting step's time over a step without drafts at this batch bucket on this path (logits:
        the logits path's steps, else argmax ones), DEFAULT_COST before both were timed there. borrow (the
        probes' gaps): at a bucket not timed both ways, the nearest bucket's that is (by powers of 2, the
        larger of two as near: buckets 1 and 16 timed, 8 takes 16's, 4 too), DEFAULT_COST before any is.
        The choice to draft never borrows: c grows with the batch, and a larger bucket's c at a smaller one
        would keep a lone slot from drafting where it pays."""
        both = [r for r, k, path in self.seconds if (k, path) == (self.k, logits)]
        timed = [r for r in both if (r, 0, logits) in self.seconds]
        if not borrow:
            timed = [r for r in timed if r == rows]
        if not timed:
            return DEFAULT_COST
        nearest = min(timed, key=lambda r: (abs(r.bit_length() - rows.bit_length()), -r))
        drafting, plain = self.seconds[(nearest, self.k, logits)], self.seconds[(nearest, 0, logits)]
        return max(1.0, median(drafting) / median(plain))

    def choose(self, rows: int, slots: list[int], seeded: bool = False, logits: bool = False) -> int:
        """The drafts the next step over `slots` (batch bucket `rows`) verifies: K or 0. seeded: some slot
        samples with a seed (the step drafts); logits: the step is on the logits path (see cost)."""
        if not self.adaptive or not slots or seeded:
            return self.k
        if self.probing:
            self.probing -= 1
            self.since_drafting = 0
            return self.k
        gain = sum(self.rate.get(s, self.prior) for s in slots)
        if gain > (self.cost(rows, logits=logits) - 1.0) * len(slots):
            self.probe = PROBE_MIN  # drafting pays: the next probes start close again
            return self._drafting(rows, logits)
        self.stale |= set(slots)  # not drafting because it does not pay: their next measure weighs more
        self.since_drafting += 1
        # the gap at this bucket: one grown at another is raised to this one's shortest, cut to its longest
        gap = min(max(self.probe, self.shortest_gap(rows, logits)), self.longest_gap(rows, logits))
        if self.since_drafting <= gap:
            return 0
        self.probing = 1  # this step and the next
        self.probe = min(2 * gap, self.longest_gap(rows, logits))
        self.since_drafting = 0
        return self.k

    def shortest_gap(self, rows: int, logits: bool = False) -> int:
        """The fewest steps without drafting between probes at this batch bucket: PROBE_MIN, or more where a
        probe's two drafting steps cost over PROBE_FIRST_SHARE of that many steps (c borrowed: see cost)."""
        return max(PROBE_MIN, _steps_for_share(self.cost(rows, True, logits), PROBE_FIRST_SHARE))

    def longest_gap(self, rows: int, logits: bool = False) -> int:
        """The most steps without drafting between probes at this batch bucket: PROBE_MAX, or more where a
        probe's two drafting steps cost over PROBE_SHARE of that many steps (c borrowed: see cost)."""
        return max(PROBE_MAX, _steps_for_share(self.cost(rows, True, logits), PROBE_SHARE))

    def _drafting(self, rows: int, logits: bool) -> int:
        """K, or 0 once every PLAIN_PROBE drafting steps in a row, and early while steps without drafts at
        this bucket on this path have been timed fewer than 3 times (so c is measured, not assumed)."""
        self.since_drafting = 0
        self.since_plain += 1
        untimed = len(self.seconds.get((rows, 0, logits), ())) < 3 and self.since_plain > PROBE_MIN
        if self.since_plain > PLAIN_PROBE or untimed:
            self.since_plain = 0
            return 0
        return self.k

    def observe(
        self,
        rows: int,
        k: int,
        seconds: float | None,
        accepted: dict[int, int],
        runner: int = 0,
        logits: bool = False,
    ) -> None:
        """A decode step's result: its variant, wall time (None: not timed alone), each slot's accepted
        drafts, which runner ran it (a compiled twin taking over from an eager runner: times anew) and
        whether it was on the logits path (see cost)."""
        if runner != self.runner:
            self.runner = runner
            self.seconds.clear()
        key = (rows, k, logits)
        if seconds is not None:
            self.seconds.setdefault(key, deque(maxlen=TIMED)).append(seconds)
        if k == 0:
            self.since_plain = 0
            if not self.fresh_without_drafting:
                self.fresh -= set(accepted)
            return
        for slot, n in accepted.items():
            if slot in self.fresh:
                weight = STALE_SMOOTHING if slot in self.stale else SMOOTHING
                self.rate[slot] = _mix(self.rate.get(slot, self.prior), n, weight)
                self.prior = _mix(self.prior, n, PRIOR_SMOOTHING)
                self.stale.discard(slot)
            self.fresh.add(slot)


def _steps_for_share(cost: float, share: float) -> int:
    """The steps without drafting in which a probe's extra 2 (c - 1) steps are `share` of the time, rounded
    up (after rounding off float noise: c = 1.3 at 0.075 is 8, not 9)."""
    return math.ceil(round(2.0 * (cost - 1.0) / share, 6))


def _mix(old: float, new: float, weight: float) -> float:
    return (1.0 - weight) * old + weight * new
