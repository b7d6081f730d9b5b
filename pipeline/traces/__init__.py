"""Trace files: reading and writing JSONL (plain or gzip) and Parquet (``files``), and the
one validation entry every input lane uses, files, Kafka and the embedded bus (``validate``)."""
