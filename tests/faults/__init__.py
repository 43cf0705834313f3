"""Fault injection for blockagg's exactly-once claim (issue 7).

Tools that don't depend on the job: :mod:`.proxy` (a loopback TCP proxy that forwards,
drops answers, refuses or blackholes), :mod:`.stack` (kill -9 / restart / pause the
services of a private local stack), :mod:`.workload` (a multi-table producer with
unique row ids, whose schemas can change while the job runs) and :mod:`.checker`
(exactly once per table, values where a schema changed, dead letters exactly once,
``arv verify`` clean). The scenarios that run the real job live in ``test_*.py``.
"""
