"""spark.driver.last_progress: the query's last progress from the JVM's JSON in one
call, as the wait loop reads it twice a second."""

from __future__ import annotations

import json
from typing import Any

from blockagg.spark.driver import last_progress

PROGRESS = {"batchId": 3, "sources": [{"endOffset": {"t": {"0": 5}},
                                       "latestOffset": {"t": {"0": 7}}}]}


class JavaProgress:
    def json(self) -> str:
        return json.dumps(PROGRESS)


class JavaQuery:
    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.calls = 0

    def lastProgress(self) -> Any:
        self.calls += 1
        return self.progress


class PySparkQuery:
    def __init__(self, progress: Any) -> None:
        self._jsq = JavaQuery(progress)

    @property
    def lastProgress(self) -> Any:
        raise AssertionError("PySpark's field-by-field progress object must not be built")


def test_the_jvm_json_in_one_call() -> None:
    query = PySparkQuery(JavaProgress())
    assert last_progress(query) == PROGRESS
    assert query._jsq.calls == 1


def test_no_progress_yet() -> None:
    assert last_progress(PySparkQuery(None)) is None


def test_another_query_object_gives_its_own_progress() -> None:
    class Plain:
        lastProgress = PROGRESS

    assert last_progress(Plain()) == PROGRESS
