"""blockagg: exactly-once delivery of multi-table Kafka topics into ClickHouse.

Every import name lives under ``blockagg.`` so the project installs beside any other
(proto-plus, for one, owns the top-level name ``proto``). The subpackages follow the
design: ``aggregator`` (the pure core and its Kafka and ClickHouse adapters), ``proto``
(the envelope, the schema registry, ``ba-schema``), ``spark`` (the ``spark-submit``
job) and ``verifier`` (``arv``).
"""
