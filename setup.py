"""The compiled parts, both optional: ``blockagg.proto._wirescan`` (the row decoder's wire
scan) and ``blockagg.aggregator.clickhouse._native`` (the Native String encoding). Without a C
compiler the install goes on and the same bytes come from numpy (``docs/architecture.md``,
*The compiled parts*)."""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(ext_modules=[
    Extension("blockagg.proto._wirescan", ["blockagg/proto/_wirescan.c"],
              extra_compile_args=FLAGS, optional=True),
    Extension("blockagg.aggregator.clickhouse._native",
              ["blockagg/aggregator/clickhouse/_native.c"], extra_compile_args=FLAGS,
              optional=True),
])
