"""Trace files: reading and writing JSONL (plain or gzip) and Parquet."""
