"""The record contract between training jobs and the service: record shapes, the
format version, Kafka URLs and topics, signed control messages.

Standard library only; every other part of rankscope imports it, it imports none of them.
"""

from rankscope.collectors.schema.records import (
    ACTIONS,
    FORMAT_VERSION,
    LABEL_KINDS,
    PHASES,
    RECORD_TYPES,
    SCHEMA,
    BeatRecord,
    CheckRecord,
    Collective,
    GpuRecord,
    RecordError,
    StepRecord,
    record_key,
    validate_label,
    validate_record,
)

__all__ = [
    "ACTIONS",
    "FORMAT_VERSION",
    "LABEL_KINDS",
    "PHASES",
    "RECORD_TYPES",
    "SCHEMA",
    "BeatRecord",
    "CheckRecord",
    "Collective",
    "GpuRecord",
    "RecordError",
    "StepRecord",
    "record_key",
    "validate_label",
    "validate_record",
]
