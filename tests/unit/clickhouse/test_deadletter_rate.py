from __future__ import annotations

import pytest

from blockagg.exceptions import BlockaggError, ConfigError
from blockagg.rows.deadletter_rate import (
    RateThreshold,
    RateWindow,
    check_rate,
    exceeds,
)
from blockagg.rows.exceptions import DeadLetterRateExceeded


@pytest.mark.parametrize(("dead", "total", "max_rate", "min_messages", "over"), [
    (0, 0, 0.0, 0, False),          # nothing to judge
    (10, 100, 0.1, 0, False),       # at the threshold: allowed
    (11, 100, 0.1, 0, True),
    (11, 100, 0.1, 101, False),     # not enough messages yet
    (100, 100, 1.0, 0, False),      # 1.0 disables the check
    (1, 1000, 0.0, 0, True),        # 0: any dead letter stops
])
def test_exceeds(dead: int, total: int, max_rate: float, min_messages: int, over: bool) -> None:
    assert exceeds(dead, total, RateThreshold(max_rate, min_messages)) is over


def test_error_names_rate_threshold_reasons_and_what_to_do() -> None:
    with pytest.raises(DeadLetterRateExceeded) as info:
        check_rate(80, 100, {"unregistered_table": 70, "bad_row": 9, "schema": 1, "other": 0},
                   RateThreshold(0.05, 10, table="db.dl"), " in batch 7")
    err = info.value
    assert isinstance(err, BlockaggError)
    assert (err.rate, err.dead, err.total) == (0.8, 80, 100)
    assert err.reasons == [("unregistered_table", 70), ("bad_row", 9), ("schema", 1)]
    text = str(err)
    for part in ("80.0%", "80 of 100 messages in batch 7", "max_rate = 5.0%",
                 "unregistered_table (70)", "db.dl", "ba-schema", "raise dead_letters.max_rate"):
        assert part in text


def test_window_sums_the_last_batches() -> None:
    window = RateWindow(RateThreshold(max_rate=0.3, min_messages=100, window=3))
    window.add(40, 50, {"bad_row": 40}, "batch 1")     # 80% but only 50 messages
    window.add(0, 100, {}, "batch 2")                  # 40 of 150
    window.add(10, 50, {"bad_row": 10}, "batch 3")     # 50 of 200
    with pytest.raises(DeadLetterRateExceeded, match="in the last 3 batches, up to batch 4"):
        window.add(90, 100, {"schema": 90}, "batch 4")  # batch 1 left: 100 of 250 = 40%
    assert window.totals()[:2] == (100, 250)


def test_bad_settings_and_counts() -> None:
    with pytest.raises(ConfigError, match="fraction"):
        RateThreshold(max_rate=5)
    with pytest.raises(ConfigError):
        RateThreshold(window=0)
    with pytest.raises(ValueError):
        check_rate(3, 2, {}, RateThreshold())
