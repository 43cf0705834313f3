"""Settings for every test process and the JVMs it starts.

``SPARK_SUBMIT_OPTS`` (unless set): the Spark driver JVMs the tests start (about 150,
each living seconds to minutes) run with the client JIT only and the serial
collector. On a 2-core machine the server JIT's compiler threads compete with the job
for the cores; a SparkSession with one small query starts in ~6 s instead of ~8.7 s
(docs/BENCHMARKS.md, *Test JVMs*). Production jobs keep the JVM's defaults: this file
configures tests only.
"""

from __future__ import annotations

import os

TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

os.environ.setdefault("SPARK_SUBMIT_OPTS", TEST_JVM_OPTIONS)
