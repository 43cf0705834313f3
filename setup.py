"""The one compiled part: ``blockagg.proto._wirescan``, the wire scan of
``blockagg.proto.decode`` in C. It is optional: without a C compiler the install goes on
and the decoder runs its numpy scan, with the same results (``tests/unit/proto``)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "blockagg.proto._wirescan", ["blockagg/proto/_wirescan.c"],
    extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    optional=True)])
