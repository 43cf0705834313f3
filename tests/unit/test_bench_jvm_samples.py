"""bench.jvm_samples: JFR samples split by the read path's parts, inside a window."""

from __future__ import annotations

from bench.jvm_samples import Sample, part_of, summarize


def test_a_sample_belongs_to_its_topmost_known_part() -> None:
    crc_in_parser = ("java.util.zip.CRC32C.updateBytes",
                     "org.apache.kafka.common.record.DefaultRecordBatch.ensureValid",
                     "org.apache.kafka.clients.consumer.internals.Fetcher.fetchRecords")
    assert part_of(crc_in_parser) == "record CRC"
    assert part_of(("net.jpountz.lz4.LZ4JavaSafeFastDecompressor.decompress",
                    "org.apache.kafka.common.record.DefaultRecordBatch.iterator")
                   ) == "lz4 decompression"
    assert part_of(("java.lang.String.length",)) == "other"


def test_summary_counts_only_the_window() -> None:
    samples = [Sample(1.0, "Executor task launch worker for task 0.0",
                      ("org.apache.spark.sql.execution.arrow.ArrowWriter.write",)),
               Sample(2.0, "Executor task launch worker for task 1.0",
                      ("org.apache.kafka.common.record.DefaultRecord.readFrom",)),
               Sample(3.0, "stdout writer for python3", ("java.io.DataOutputStream.write",))]
    summary = summarize(samples, since=1.5, until=3.0)
    assert summary["samples"] == 1
    assert summary["parts"] == {"Kafka record parsing": 1}
    assert summary["threads"] == {"task": 1}
