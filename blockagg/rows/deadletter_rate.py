"""The dead-letter rate threshold: stop the job when too many messages are diverted.

Pure helpers, no I/O: the Spark driver feeds them each micro-batch's counts (the
tasks' ``dead_letters`` reasons and message counts) and stops the query on
:class:`~aggregator.clickhouse.exceptions.DeadLetterRateExceeded`. Checking *after*
a batch committed is safe for exactly-once: the batch's dead letters are already in
the dead-letter table, once, and a restart resumes after them.

* :func:`check_rate` decides for one set of counts;
* :class:`RateWindow` keeps the last ``window`` batches and decides over their sum,
  so one bad batch among many good ones does not stop the job when ``window`` > 1,
  and a trickle of small batches is judged on enough messages.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from blockagg.exceptions import ConfigError
from blockagg.rows.deadletters import DEFAULT_TABLE
from blockagg.rows.exceptions import DeadLetterRateExceeded

TOP_REASONS = 3


@dataclass(frozen=True)
class RateThreshold:
    """``max_rate``: the largest tolerated share of dead letters (0..1; 1 disables
    the check). ``min_messages``: the check applies only from this many messages
    (in the window), so a handful of bad messages in a quiet batch doesn't stop the
    job. ``window``: how many batches :class:`RateWindow` sums."""

    max_rate: float = 1.0
    min_messages: int = 100
    window: int = 1
    table: str = DEFAULT_TABLE

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_rate <= 1.0:
            raise ConfigError(f"dead_letters.max_rate = {self.max_rate}: expected a fraction "
                              "between 0 and 1 (e.g. 0.01 for 1%)")
        if self.min_messages < 0 or self.window < 1:
            raise ConfigError(f"dead_letters: min_messages = {self.min_messages} must be >= 0 "
                              f"and window = {self.window} >= 1")


def exceeds(dead: int, total: int, threshold: RateThreshold) -> bool:
    """True when ``dead`` of ``total`` is over the threshold (and it applies)."""
    if threshold.max_rate >= 1.0 or total <= 0 or total < threshold.min_messages:
        return False
    return dead / total > threshold.max_rate


def check_rate(dead: int, total: int, reasons: Mapping[str, int], threshold: RateThreshold,
               scope: str = "") -> None:
    """Raise :class:`DeadLetterRateExceeded` when ``dead`` of ``total`` messages is
    over ``threshold``; ``reasons`` (reason -> count) names the top reasons."""
    if dead < 0 or total < 0 or dead > total:
        raise ValueError(f"bad counts: {dead} dead letters of {total} messages")
    if exceeds(dead, total, threshold):
        top = sorted(((r, int(n)) for r, n in reasons.items() if n),
                     key=lambda rn: (-rn[1], rn[0]))[:TOP_REASONS]
        raise DeadLetterRateExceeded(dead / total, threshold.max_rate, dead, total, top, scope,
                                     threshold.min_messages, threshold.table)


@dataclass
class RateWindow:
    """The last ``threshold.window`` batches' counts; :meth:`add` checks their sum."""

    threshold: RateThreshold
    _batches: deque[tuple[int, int, Counter[str]]] = field(default_factory=deque)

    def add(self, dead: int, total: int, reasons: Mapping[str, int] | None = None,
            label: str = "") -> None:
        """Record one batch (``label``, e.g. "batch 12", goes into the error) and
        raise :class:`DeadLetterRateExceeded` when the window is over the threshold."""
        self._batches.append((dead, total, Counter(reasons or {})))
        while len(self._batches) > self.threshold.window:
            self._batches.popleft()
        d, t, r = self.totals()
        n = len(self._batches)
        scope = (f" in {label}" if n == 1 and label else
                 f" in the last {n} batches" + (f", up to {label}" if label else ""))
        check_rate(d, t, r, self.threshold, scope)

    def totals(self) -> tuple[int, int, Counter[str]]:
        reasons: Counter[str] = Counter()
        for _, _, r in self._batches:
            reasons.update(r)
        return (sum(b[0] for b in self._batches), sum(b[1] for b in self._batches), reasons)
