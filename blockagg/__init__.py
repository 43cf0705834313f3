"""blockagg: exactly-once delivery of multi-table Kafka topics into ClickHouse.

Every import name lives under ``blockagg.`` so the project installs beside any other
(proto-plus, for one, owns the top-level name ``proto``). The subpackages follow the
data path: ``proto`` (the envelope, the schema registry, ``ba-schema``), ``rows`` (a
message's typed columns and dead-letter decisions, pure), ``aggregator`` (the pure core
and its Kafka and ClickHouse adapters), ``spark`` (the ``spark-submit`` job) and
``verifier`` (``arv``). The modules at this root (``exceptions``, ``config``, ``logs``,
``tls``, ``cli_tls``) are shared by every layer; ``tests/unit/test_layers.py`` holds
the imports to that order.
"""
