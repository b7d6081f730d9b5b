"""rankscope's service side: record schema, trace I/O, bus, step assembly, store, CLI.

Kept import-light: ``rankscope.collectors.schema.records`` is what collectors and detectors use,
and importing it must not pull in pandas, DuckDB or Kafka.
"""

__all__ = ["records", "trace_io"]
