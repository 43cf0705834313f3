"""Modern ClickHouse semantics we support when the server has them, checked in-process with chdb
(ClickHouse 2x as a Python package; no stack needed, so no ``integration`` marker): a plain
MergeTree with ``non_replicated_deduplication_window`` drops a retried insert carrying the same
``insert_deduplication_token`` and keeps an identical one with a different token."""

from __future__ import annotations

import pytest

chdb_session = pytest.importorskip("chdb.session")


def test_chdb_mergetree_drops_retry_with_same_dedup_token_keeps_new_token() -> None:
    s = chdb_session.Session()
    try:
        s.query("CREATE DATABASE IF NOT EXISTS dd")
        s.query("DROP TABLE IF EXISTS dd.t")
        s.query(
            "CREATE TABLE dd.t (id UInt64, v String) ENGINE = MergeTree ORDER BY id "
            "SETTINGS non_replicated_deduplication_window = 100"
        )
        insert = "INSERT INTO dd.t SETTINGS insert_deduplication_token = '{tok}' VALUES (1, 'a')"
        s.query(insert.format(tok="topic-0-block-1"))
        s.query(insert.format(tok="topic-0-block-1"))  # the retry
        assert str(s.query("SELECT count() FROM dd.t", "CSV")).strip() == "1"
        s.query(insert.format(tok="topic-0-block-2"))  # same rows, another block
        assert str(s.query("SELECT count() FROM dd.t", "CSV")).strip() == "2"
    finally:
        s.close()
