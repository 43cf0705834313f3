"""The ``spark-submit`` entry point: reads the Kafka source with Structured
Streaming, hands each Kafka partition's rows, in offset order and with the batch's
planned offset range, to one aggregator task, and reports per-batch figures to the
driver.
"""
