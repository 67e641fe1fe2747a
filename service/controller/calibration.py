"""How far the controller's forecasts of pass costs are from what happens, learned while it
runs — and unlearned when it stops being true.

Acceptance is not corrected here: the mixer's estimates (`drafting.mixer.RequestDrafts.observe`)
serve the controller as they are. A per-request realized/forecast factor would be learned only
where a request speculated, so a low one would keep the request plain and seldom be corrected
(docs/benchmarks.md, "Calibration").

Pass costs are observed on EVERY pass, speculative or plain, and split in two:
- the load `level` (a short horizon): other work on the machine slows every pass alike, and
  since the controller compares shapes with each other, a uniform slowdown changes no decision.
- per pass-shape `shape` factors, keyed like the profile by the pass's tokens AND its rows: what
  the profile got wrong about *relative* costs. Every pass decays all of them (lazily), so the
  factor of a shape no longer used returns to the profile's word instead of freezing at its last
  (perhaps spiked) value. Keyed by tokens alone, what one-row trees at C=1 taught would price
  the plain 4-row pass at C=4, and the server would then speculate at a loss there.

A request whose forecast keeps saying "plain" still probes speculation after `PROBE_EVERY`
rounds, so a pessimistic profile is measured again instead of believed forever; each probe that
does not change the forecast's mind doubles the wait (up to `PROBE_MAX_EVERY`), since where
drafts never pay every probe is a loss. A round the forecast chose to speculate resets the wait.
The engine lets at most one probe through every `PROBE_EVERY` passes, whatever the batch.
Symmetrically, when the all-plain pass size has gone unobserved that long, one pass is plain (a
slowdown that hits trees harder than plain passes shows that way). If the observed relative
costs stay far from the profile, `drifted()` asks the engine to measure the profile again when
it is idle.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

LEVEL_DECAY = 0.8  # horizon ≈ 5 passes: load changes show at once
# the load level is trusted like its prior (1) until about this many passes
LEVEL_PRIOR_ROUNDS = 4.0
SHAPE_DECAY = 0.9  # horizon ≈ 10 passes, applied to every size on every pass
SHAPE_PRIOR_ROUNDS = 0.25  # a fresh pass-time measurement outweighs the profile's word at once
PROBE_EVERY = 16  # plain rounds with drafts on offer before a request probes speculation
PROBE_MAX_EVERY = 128  # ... after probes that kept finding plain the better choice
# after this many plain rounds in a row, a request is drafted every this-many rounds,
QUIET_ROUNDS = 4
QUIET_MAX_EVERY = 16  # ... then every 8 from 8 plain rounds on, every 16 from 16 on
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # upper bounds of pass-size buckets
ROW_BUCKETS = (1, 4, 16, 64)  # upper bounds of row-count buckets (the profile's rows: 1, 4, 16)
HOST_WINDOW = 16  # steps whose drafting seconds per row give the host cost's median
DRIFT_LIMIT = 1.6  # relative costs of two sizes off by more than this from the profile's
DRIFT_ROUNDS = 3.0  # ... each with this many recent rounds: measure the profile again


@dataclass
class Ratio:
    """Decayed sums of predicted and realized amounts, and how many rounds fed them."""

    decay: float  # each round keeps this share of the sums: a horizon of 1 / (1 - decay) rounds
    prior_rounds: float  # the factor is trusted like its prior until about this many rounds
    predicted: float = 0.0
    realized: float = 0.0
    rounds: float = 0.0

    def fade(self, rounds: int = 1) -> None:
        """`rounds` rounds pass without an observation."""
        kept = self.decay if rounds == 1 else self.decay**rounds
        self.predicted *= kept
        self.realized *= kept
        self.rounds *= kept

    def add(self, predicted: float, realized: float) -> None:
        self.predicted += predicted
        self.realized += realized
        self.rounds += 1.0

    def observe(self, predicted: float, realized: float) -> None:
        self.fade()
        self.add(predicted, realized)

    def factor(self, prior: float = 1.0) -> float:
        """realized / predicted, shrunk toward `prior` while few rounds are in."""
        if self.predicted <= 0.0:
            return prior
        ratio = self.realized / self.predicted
        return (self.rounds * ratio + self.prior_rounds * prior) / (self.rounds + self.prior_rounds)


def size_bucket(tokens: int) -> int:
    return min(bisect.bisect_left(SIZE_BUCKETS, tokens), len(SIZE_BUCKETS) - 1)


# larger: the last
SIZE_BUCKET_OF = tuple(size_bucket(tokens) for tokens in range(SIZE_BUCKETS[-1] + 1))


def shape_bucket(tokens: int, rows: int) -> int:
    """The index of a pass of `tokens` tokens over `rows` rows among the shape factors."""
    row_bucket = min(bisect.bisect_left(ROW_BUCKETS, rows), len(ROW_BUCKETS) - 1)
    return row_bucket * len(SIZE_BUCKETS) + size_bucket(tokens)


@dataclass
class HostCost:
    """Host seconds that drafting one row adds to a step (its strategies' candidates): what a
    request that speculates costs beyond its share of the pass. The profile times passes alone;
    on a GPU, where a pass costs about the same whatever its size, this work decides whether a
    row's drafts pay. The median of the last `HOST_WINDOW` steps' per-row figure: a request's
    first drafting, or a pause of the interpreter, takes many times a typical round, and a
    decayed mean of such figures kept a lone request nearly plain (docs/benchmarks.md,
    "Calibration")."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=HOST_WINDOW))

    def observe(self, seconds: float, rows: int) -> None:
        """One step drafted `rows` rows in `seconds`."""
        if rows > 0:
            self.recent.append(seconds / rows)

    @property
    def row_seconds(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0


class ShapeRatios:
    """The per-shape ratios, every one faded on every pass, lazily: a ratio catches up with
    the passes it missed when it is next read or fed (`SHAPE_DECAY` to the power of them),
    since only the one shape a pass had changes; fading all of them on every pass cost a
    measurable share of every step, in every mode."""

    def __init__(self) -> None:
        self._ratios = [
            Ratio(SHAPE_DECAY, SHAPE_PRIOR_ROUNDS)
            for _ in range(len(ROW_BUCKETS) * len(SIZE_BUCKETS))
        ]
        self._faded_at = [0] * len(self._ratios)  # the pass count each ratio is faded up to
        self.passes = 0

    def __getitem__(self, index: int) -> Ratio:
        """The ratio of shape bucket `index`, faded up to now."""
        ratio, missed = self._ratios[index], self.passes - self._faded_at[index]
        if missed:
            ratio.fade(missed)
            self._faded_at[index] = self.passes
        return ratio

    def __iter__(self) -> Iterator[Ratio]:
        return (self[index] for index in range(len(self._ratios)))

    def observe(self, index: int, predicted: float, realized: float) -> None:
        """One pass, of shape bucket `index`: every ratio fades, that one learns."""
        self.passes += 1
        self[index].add(predicted, realized)


@dataclass
class Calibration:
    """The engine's factors: load level and relative pass costs."""

    level: Ratio = field(default_factory=lambda: _level_ratio())
    shapes: ShapeRatios = field(default_factory=ShapeRatios)
    passes_since_probe: int = PROBE_EVERY  # the engine-wide probe clock
    # what a speculating row costs outside the pass
    host: HostCost = field(default_factory=HostCost)
    # rows -> the size buckets' factors (`size_factor`), until the next pass changes them (the
    # controller asks per node)
    _factors: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False)

    @property
    def may_probe(self) -> bool:
        """A request due for a probe may take it in this pass (one probe per `PROBE_EVERY`)."""
        return self.passes_since_probe >= PROBE_EVERY

    def count_pass(self, probed: bool) -> None:
        self.passes_since_probe = 0 if probed else self.passes_since_probe + 1

    def for_request(self) -> RequestCalibration:
        return RequestCalibration(self)

    def shape_factor(self, tokens: int, rows: int = 1) -> float:
        """How much dearer (>1) or cheaper a pass of `tokens` tokens over `rows` rows is,
        relative to the others, than the profile says."""
        return self.size_factor(rows)(tokens)

    def size_factor(self, rows: int) -> Callable[[int], float]:
        """`shape_factor` at `rows` rows, as a function of the pass size. The controller prices
        tens of shapes a step: the factors of the size buckets are taken once, until the next
        pass changes them, and a size's bucket is one indexing, cheaper than bisecting for it."""
        factors = self._factors.get(rows)
        if factors is None:
            first = shape_bucket(0, rows)  # the row count's smallest size
            buckets = range(first, first + len(SIZE_BUCKETS))
            factors = self._factors[rows] = [self.shapes[index].factor() for index in buckets]
        largest = len(SIZE_BUCKET_OF) - 1
        return lambda tokens: factors[SIZE_BUCKET_OF[tokens if tokens < largest else largest]]

    def plain_is_stale(self, tokens: int, rows: int = 1) -> bool:
        """The all-plain pass (`tokens` over `rows` rows) has gone unobserved for about
        `PROBE_EVERY` passes: the next pass should be plain, so relative costs stay measured
        both ways."""
        return self.shapes[shape_bucket(tokens, rows)].rounds < SHAPE_DECAY**PROBE_EVERY

    def observe_pass(
        self, tokens: int, profiled_seconds: float, seconds: float, rows: int = 1
    ) -> None:
        """One pass of `tokens` tokens over `rows` rows that the profile priced at
        `profiled_seconds`."""
        self.level.observe(profiled_seconds, seconds)
        self._factors.clear()
        self.shapes.observe(
            shape_bucket(tokens, rows), profiled_seconds * self.level.factor(), seconds
        )

    def drifted(self) -> bool:
        """The observed relative costs of pass sizes disagree with the profile's, steadily."""
        factors = [r.factor() for r in self.shapes if r.rounds >= DRIFT_ROUNDS]
        return len(factors) >= 2 and max(factors) > DRIFT_LIMIT * min(factors)

    def reset_costs(self) -> None:
        """Forget the pass-cost factors (a new profile was measured)."""
        self.level = _level_ratio()
        self.shapes = ShapeRatios()
        self._factors.clear()


def _level_ratio() -> Ratio:
    return Ratio(LEVEL_DECAY, LEVEL_PRIOR_ROUNDS)


class RequestCalibration:
    """One request's probe clock and drafting schedule while the controller keeps it plain."""

    def __init__(self, shared: Calibration) -> None:
        self.shared = shared
        self.plain_rounds = 0  # rounds since it last speculated while drafts were on offer
        self.probe_every = PROBE_EVERY  # plain rounds before the next probe

    def observe_round(self, speculated: bool) -> None:
        """One auto round, speculative or plain."""
        if not speculated:
            self.plain_rounds += 1
            return
        probed = self.due_for_probe
        self.probe_every = min(2 * self.probe_every, PROBE_MAX_EVERY) if probed else PROBE_EVERY
        self.plain_rounds = 0

    @property
    def drafts_this_round(self) -> bool:
        """Whether drafting for this request is worth its time this round. Drafting and
        planning cost the same whether or not the controller then speculates; for a request
        it keeps plain they are pure overhead. So after `QUIET_ROUNDS` plain rounds in a row
        it is drafted only every 4th round, from 8 plain rounds on every 8th, from 16 on every
        16th (`QUIET_MAX_EVERY`), and when due for a probe the engine lets through this pass;
        a round that speculates brings it back to every round. At C=16 on a CPU, where the
        controller takes no node, drafting every round cost a visible share of each step
        (docs/benchmarks.md, "Calibration"). The probe condition matters: without it a request
        held back by the engine-wide gate stays due and drafts every round."""
        return self._drafts_after(self.plain_rounds)

    def drafts_next_round(self, speculates: bool) -> bool:
        """`drafts_this_round` as it will read after this round (one that `speculates` or
        not), the engine-wide probe gate taken as it stands now: whether this round's
        distributions are worth handing to the drafting layer."""
        return self._drafts_after(0 if speculates else self.plain_rounds + 1)

    def _drafts_after(self, plain_rounds: int) -> bool:
        every = (
            min(1 << (plain_rounds.bit_length() - 1), QUIET_MAX_EVERY)
            if plain_rounds >= QUIET_ROUNDS
            else 1
        )
        return plain_rounds % every == 0 or (
            self._due_after(plain_rounds) and self.shared.may_probe
        )

    @property
    def due_for_probe(self) -> bool:
        return self._due_after(self.plain_rounds)

    def _due_after(self, plain_rounds: int) -> bool:
        return plain_rounds >= self.probe_every
