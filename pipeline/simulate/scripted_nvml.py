"""A scripted NVML: pynvml's function names over GPUs whose readings a script sets.

``ScriptedNvml`` looks like the ``pynvml`` module to
``rankscope.collectors.gpu.nvml.NvmlBackend``: it has every function in
``NVML_FUNCTIONS`` with pynvml's signature, and it raises pynvml's own
exception classes (``NVMLError_NotSupported``, ``NVMLError_GpuIsLost``, ...)
so the backend's error handling runs exactly as on a real driver. Two users:
the ``gpu`` fault of the simulator (a rank's GPU overheats, throws an XID or
an ECC error while the real collector samples it) and the tests
(tests/support/fake_nvml.py), which inject it at the module boundary.

A script edits ``ScriptedGpu`` fields between samples, makes a function
unsupported on one GPU (``gpu.unsupported``), loses a GPU (``gpu.lost =
True``), makes the driver vanish (``vanish()``) or raises an XID
(``inject_xid(index, 79)``); ``nvmlEventSetWait`` really blocks for its
timeout, like the driver, so the collector's loop is timed as in production.
``calls`` counts calls per function name.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
from rankscope.collectors.gpu.nvml import NVML_FUNCTIONS

__all__ = ["ScriptedGpu", "ScriptedNvml"]


@dataclass
class ScriptedGpu:
    """One scripted GPU; readings in NVML's own units (mW, bytes, MHz)."""

    util_pct: int = 97
    mem_used_bytes: int = 60 * 2**30
    mem_total_bytes: int = 80 * 2**30
    temp_c: int = 62
    power_mw: int = 650_000
    sm_clock_mhz: int = 1980
    clock_event_mask: int = 0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    remap_pending: int = 0
    remap_failed: int = 0
    pcie_replay: int = 0
    nvlink_active: tuple[int, ...] = (0, 1, 2, 3)
    nvlink_max: int = 18
    nvlink_errors: dict = field(default_factory=dict)  # (link, counter) -> count
    temp_slowdown_c: int = 87
    temp_shutdown_c: int = 92
    supports_xid_events: bool = True
    unsupported: set = field(default_factory=set)  # NVML function names answering NotSupported
    lost: bool = False
    uuid: str = ""
    name: str = "NVIDIA H100 80GB HBM3"


class _Handle:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class ScriptedNvml:
    """Stands in for the ``pynvml`` module; one instance is one host."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: int | list[ScriptedGpu] = 8, *, driver: bool = True):
        self.gpus = [ScriptedGpu() for _ in range(gpus)] if isinstance(gpus, int) else list(gpus)
        for i, g in enumerate(self.gpus):
            g.uuid = g.uuid or f"GPU-scripted-{i:04d}"
        self.driver = driver  # False: the library is not there at all
        self.initialized = False
        self.calls: Counter = Counter()
        self.missing: set[str] = set()  # functions this (old) driver lacks: FunctionNotFound
        self._xids: deque = deque()
        self._cond = threading.Condition()
        self._registered: set[int] = set()

    # -- scripting -------------------------------------------------------------

    def inject_xid(self, index: int, xid: int) -> None:
        """Deliver a critical-XID event for GPU ``index`` to the event set."""
        with self._cond:
            self._xids.append((index, xid))
            self._cond.notify_all()

    def vanish(self) -> None:
        """The driver goes away: every later call fails as after a driver unload."""
        with self._cond:
            self.driver = False
            self.initialized = False
            self._cond.notify_all()

    # -- helpers ---------------------------------------------------------------

    def _enter(self, name: str) -> None:
        self.calls[name] += 1
        if not self.driver:
            raise pynvml.NVMLError_Uninitialized() if name != "nvmlInit" else (
                pynvml.NVMLError_LibraryNotFound())
        if not self.initialized and name != "nvmlInit":
            raise pynvml.NVMLError_Uninitialized()

    def _gpu(self, name: str, handle: _Handle) -> ScriptedGpu:
        self._enter(name)
        if name in self.missing:
            raise pynvml.NVMLError_FunctionNotFound()
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if name in gpu.unsupported:
            raise pynvml.NVMLError_NotSupported()
        return gpu

    # -- the pynvml functions the backend uses ------------------------------------

    def nvmlInit(self):
        self._enter("nvmlInit")
        self.initialized = True

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return "550.54.15-fake"

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle):
        self._gpu("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetUUID(self, handle):
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle):
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUtilizationRates(self, handle):
        g = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=g.util_pct, memory=g.util_pct // 2)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        g = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(total=g.mem_total_bytes, used=g.mem_used_bytes,
                               free=g.mem_total_bytes - g.mem_used_bytes)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._gpu("nvmlDeviceGetTemperature", handle).temp_c

    def nvmlDeviceGetTemperatureThreshold(self, handle, threshold):
        g = self._gpu("nvmlDeviceGetTemperatureThreshold", handle)
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return g.temp_slowdown_c
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
            return g.temp_shutdown_c
        raise pynvml.NVMLError_NotSupported()

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetClockInfo(self, handle, clock_type):
        g = self._gpu("nvmlDeviceGetClockInfo", handle)
        if clock_type != pynvml.NVML_CLOCK_SM:
            raise pynvml.NVMLError_NotSupported()
        return g.sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_event_mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_event_mask

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        g = self._gpu("nvmlDeviceGetTotalEccErrors", handle)
        if counter_type != pynvml.NVML_VOLATILE_ECC:
            raise pynvml.NVMLError_NotSupported()
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return g.ecc_dbe
        return g.ecc_sbe

    def nvmlDeviceGetRemappedRows(self, handle):
        g = self._gpu("nvmlDeviceGetRemappedRows", handle)
        return (0, 0, g.remap_pending, g.remap_failed)

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        return self._gpu("nvmlDeviceGetPcieReplayCounter", handle).pcie_replay

    def nvmlDeviceGetNvLinkState(self, handle, link):
        g = self._gpu("nvmlDeviceGetNvLinkState", handle)
        if link >= g.nvlink_max:
            raise pynvml.NVMLError_InvalidArgument()
        return pynvml.NVML_FEATURE_ENABLED if link in g.nvlink_active else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, handle, link, counter):
        g = self._gpu("nvmlDeviceGetNvLinkErrorCounter", handle)
        return g.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetSupportedEventTypes(self, handle):
        g = self._gpu("nvmlDeviceGetSupportedEventTypes", handle)
        return pynvml.nvmlEventTypeXidCriticalError if g.supports_xid_events else 0

    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, handle, event_types, event_set):
        g = self._gpu("nvmlDeviceRegisterEvents", handle)
        if not g.supports_xid_events:
            raise pynvml.NVMLError_NotSupported()
        self._registered.add(handle.index)

    def nvmlEventSetWait(self, event_set, timeout_ms):
        """Block until an XID for a registered GPU arrives or the timeout passes."""
        self._enter("nvmlEventSetWait")
        with self._cond:
            self._cond.wait_for(lambda: self._xids or not self.driver, timeout_ms / 1000.0)
            if not self.driver:
                raise pynvml.NVMLError_Uninitialized()
            while self._xids:
                index, xid = self._xids.popleft()
                if index in self._registered:
                    return SimpleNamespace(device=_Handle(index),
                                           eventType=pynvml.nvmlEventTypeXidCriticalError,
                                           eventData=xid, gpuInstanceId=0, computeInstanceId=0)
            raise pynvml.NVMLError_Timeout()

    def nvmlEventSetFree(self, event_set):
        self._enter("nvmlEventSetFree")
        self._registered.clear()


# Every function the backend may call exists here under the same name.
_missing = [n for n in NVML_FUNCTIONS if not callable(getattr(ScriptedNvml, n, None))]
assert not _missing, f"fake NVML lacks {_missing}"
