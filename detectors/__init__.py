"""Pure detectors over assembled steps: no I/O, only the record schema and numpy."""

from rankscope.detectors.frame import COORD_NAMES, METRIC_COLUMNS, StepFrame
from rankscope.detectors.signal import DetectorOutput, Signal

__all__ = ["StepFrame", "METRIC_COLUMNS", "COORD_NAMES", "Signal", "DetectorOutput"]
