"""The one place rankscope talks to NVML (pynvml / nvidia-ml-py).

Everything the GPU collector needs from the driver goes through ``NvmlBackend``,
which calls a small, fixed set of pynvml functions (``NVML_FUNCTIONS``) on a
module object. In production that module is ``pynvml``; tests pass a fake
module with the same function names (tests/support/fake_nvml.py), which is how NVML is
faked at its boundary and nowhere else.

Three kinds of failure are told apart here, so the collector above stays
simple:

* a reading this GPU or driver does not offer (``NotSupported``,
  ``FunctionNotFound``, ``NoPermission``, ...) becomes ``None``: the record
  field stays null, never an error;
* a GPU that fell off the bus (``GPU_IS_LOST``) raises ``GpuLost`` for that
  device only;
* the driver gone or never there (library missing, driver not loaded,
  uninitialized) raises ``NvmlUnavailable`` with a readable reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "NVML_FUNCTIONS",
    "CLOCK_EVENT_NAMES",
    "NvmlBackend",
    "NvmlUnavailable",
    "GpuLost",
    "DeviceInfo",
    "clock_event_names",
]

# The pynvml functions rankscope calls; a fake must offer the same names.
NVML_FUNCTIONS = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait",
    "nvmlEventSetFree",
)

# NVML constants used below. They are part of NVML's stable C ABI, so they
# are spelled out here rather than looked up on the module (a fake then does
# not need to copy them).
_TEMPERATURE_GPU = 0
_THRESHOLD_SHUTDOWN = 0
_THRESHOLD_SLOWDOWN = 1
_CLOCK_SM = 1
_ECC_CORRECTED = 0
_ECC_UNCORRECTED = 1
_VOLATILE_ECC = 0
_NVLINK_MAX_LINKS = 18  # NVLink 4 (H100); NVML answers NotSupported beyond a GPU's links
# DL_REPLAY, DL_RECOVERY, DL_CRC_FLIT, DL_CRC_DATA: the counters summed into nvlink_errors.
_NVLINK_COUNTERS = (0, 1, 2, 3)
EVENT_XID_CRITICAL = 0x8

# Clock-event (throttle) reason bits -> the names used in ``clock_events``.
CLOCK_EVENT_NAMES = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}

# NVML return codes, grouped by what they mean for a reader.
_ERR_UNINITIALIZED = 1
_ERR_DRIVER_NOT_LOADED = 9
_ERR_TIMEOUT = 10
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_LIB_RM_VERSION_MISMATCH = 18
_DRIVER_GONE = {
    _ERR_UNINITIALIZED,
    _ERR_DRIVER_NOT_LOADED,
    _ERR_LIBRARY_NOT_FOUND,
    _ERR_LIB_RM_VERSION_MISMATCH,
}


class NvmlUnavailable(RuntimeError):
    """No usable NVML: no library, no driver, or the driver went away."""


class GpuLost(RuntimeError):
    """One GPU stopped answering (NVML_ERROR_GPU_IS_LOST): fallen off the bus."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


@dataclass(slots=True, frozen=True)
class DeviceInfo:
    """What does not change while a GPU is up: read once when the backend opens."""

    index: int
    uuid: str | None
    name: str | None
    temp_slowdown_c: float | None
    temp_shutdown_c: float | None
    nvlinks: tuple[int, ...]  # active NVLink link numbers


def clock_event_names(mask: int | None) -> list[str] | None:
    """The set bits of a clock-event reason mask as names; unknown bits as hex."""
    if mask is None:
        return None
    names = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(CLOCK_EVENT_NAMES.get(bit, f"0x{bit:x}"))
        bit <<= 1
    return names


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class NvmlBackend:
    """Calls pynvml (or a module with the same function names) and sorts its failures.

    Not thread-safe by design: one collector thread owns one backend.
    """

    def __init__(self, module: ModuleType | Any | None = None):
        self._nv = module
        self._handles: list[Any] = []
        self._infos: list[DeviceInfo] = []
        self._events: Any = None
        self._open = False
        self._reasons_fn: Callable | None = None

    # -- lifecycle -----------------------------------------------------------

    def open(self) -> list[DeviceInfo]:
        """Initialise NVML and describe every GPU; raises ``NvmlUnavailable`` with the reason."""
        if self._nv is None:
            try:
                self._nv = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlUnavailable(f"pynvml (nvidia-ml-py) is not installed: {exc}") from exc
        err = getattr(self._nv, "NVMLError", Exception)
        try:
            self._nv.nvmlInit()
        except err as exc:
            raise NvmlUnavailable(f"NVML could not start: {exc}") from exc
        self._open = True
        try:
            count = int(self._nv.nvmlDeviceGetCount())
            self._handles = [self._nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except err as exc:
            self.close()
            raise NvmlUnavailable(f"NVML could not list GPUs: {exc}") from exc
        self._infos = [self._describe(i, h) for i, h in enumerate(self._handles)]
        self._reasons_fn = self._pick_reasons_fn()
        return list(self._infos)

    def _pick_reasons_fn(self) -> Callable | None:
        """Clock-event reasons; drivers before r535 only have the older "throttle" name."""
        nv = self._nv
        if not self._handles:
            return None
        try:
            nv.nvmlDeviceGetCurrentClocksEventReasons(self._handles[0])
            return nv.nvmlDeviceGetCurrentClocksEventReasons
        except nv.NVMLError as exc:
            if _code(exc) != _ERR_FUNCTION_NOT_FOUND:
                return nv.nvmlDeviceGetCurrentClocksEventReasons
        except AttributeError:
            pass
        return getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)

    def close(self) -> None:
        """Free the event set and shut NVML down; never raises."""
        if self._events is not None:
            self._quiet(self._nv.nvmlEventSetFree, self._events)
            self._events = None
        if self._open:
            self._open = False
            self._quiet(self._nv.nvmlShutdown)

    @property
    def devices(self) -> list[DeviceInfo]:
        return list(self._infos)

    def driver_version(self) -> str | None:
        value = self._quiet(self._nv.nvmlSystemGetDriverVersion)
        return value.decode() if isinstance(value, bytes) else value

    # -- readings --------------------------------------------------------------

    def _call(self, index: int, fn: Callable, *args: Any) -> Any:
        """One NVML call on device ``index``: None when unsupported, raise when gone."""
        try:
            return fn(*args)
        except self._nv.NVMLError as exc:
            code = _code(exc)
            if code == _ERR_GPU_IS_LOST:
                raise GpuLost(index, f"GPU {index} is lost (fallen off the bus?): {exc}") from exc
            if code in _DRIVER_GONE:
                raise NvmlUnavailable(f"NVML driver went away: {exc}") from exc
            return None

    def _quiet(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - shutdown paths must never raise
            return None

    def _describe(self, index: int, handle: Any) -> DeviceInfo:
        nv = self._nv
        uuid = self._call(index, nv.nvmlDeviceGetUUID, handle)
        name = self._call(index, nv.nvmlDeviceGetName, handle)
        links = []
        for link in range(_NVLINK_MAX_LINKS):
            state = self._call(index, nv.nvmlDeviceGetNvLinkState, handle, link)
            if state is None:
                break  # no NVLink, or past this GPU's last link
            if state:
                links.append(link)
        slow = self._call(index, nv.nvmlDeviceGetTemperatureThreshold, handle, _THRESHOLD_SLOWDOWN)
        shut = self._call(index, nv.nvmlDeviceGetTemperatureThreshold, handle, _THRESHOLD_SHUTDOWN)
        return DeviceInfo(
            index=index,
            uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
            name=name.decode() if isinstance(name, bytes) else name,
            temp_slowdown_c=float(slow) if slow else None,
            temp_shutdown_c=float(shut) if shut else None,
            nvlinks=tuple(links),
        )

    def read_fast(self, index: int) -> dict:
        """The readings that move every second: util, memory, temperature, power, clock, reasons."""
        nv, h = self._nv, self._handles[index]
        util = self._call(index, nv.nvmlDeviceGetUtilizationRates, h)
        mem = self._call(index, nv.nvmlDeviceGetMemoryInfo, h)
        temp = self._call(index, nv.nvmlDeviceGetTemperature, h, _TEMPERATURE_GPU)
        power_mw = self._call(index, nv.nvmlDeviceGetPowerUsage, h)
        clock = self._call(index, nv.nvmlDeviceGetClockInfo, h, _CLOCK_SM)
        reasons = self._call(index, self._reasons_fn, h) if self._reasons_fn else None
        return {
            "util_pct": float(util.gpu) if util is not None else None,
            "mem_used_mb": round(mem.used / 2**20, 1) if mem is not None else None,
            "temp_c": float(temp) if temp is not None else None,
            "power_w": power_mw / 1000.0 if power_mw is not None else None,
            "sm_clock_mhz": float(clock) if clock is not None else None,
            "clock_events": clock_event_names(reasons),
        }

    def read_counters(self, index: int) -> dict:
        """The error counters: ECC, row remapping, PCIe replays, NVLink errors (summed)."""
        nv, h = self._nv, self._handles[index]
        sbe = self._call(index, nv.nvmlDeviceGetTotalEccErrors, h, _ECC_CORRECTED, _VOLATILE_ECC)
        dbe = self._call(index, nv.nvmlDeviceGetTotalEccErrors, h, _ECC_UNCORRECTED, _VOLATILE_ECC)
        rows = self._call(index, nv.nvmlDeviceGetRemappedRows, h)
        replay = self._call(index, nv.nvmlDeviceGetPcieReplayCounter, h)
        nvlink = None
        for link in self._infos[index].nvlinks:
            for counter in _NVLINK_COUNTERS:
                value = self._call(index, nv.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
                if value is not None:
                    nvlink = (nvlink or 0) + int(value)
        return {
            "ecc_sbe": int(sbe) if sbe is not None else None,
            "ecc_dbe": int(dbe) if dbe is not None else None,
            "remap_pending": bool(rows[2]) if rows is not None else None,
            "remap_failed": bool(rows[3]) if rows is not None else None,
            "pcie_replay": int(replay) if replay is not None else None,
            "nvlink_errors": nvlink,
        }

    # -- XID events ------------------------------------------------------------

    def watch_xids(self, indices: list[int]) -> list[int]:
        """Register critical-XID events for these GPUs; returns the ones that support it."""
        nv = self._nv
        if self._events is None:
            self._events = self._call(-1, nv.nvmlEventSetCreate)
            if self._events is None:
                return []
        watched = []
        for i in indices:
            supported = self._call(i, nv.nvmlDeviceGetSupportedEventTypes, self._handles[i])
            if not supported or not supported & EVENT_XID_CRITICAL:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(self._handles[i], EVENT_XID_CRITICAL, self._events)
            except nv.NVMLError as exc:
                if _code(exc) in _DRIVER_GONE:
                    raise NvmlUnavailable(f"NVML driver went away: {exc}") from exc
                continue
            watched.append(i)
        return watched

    def wait_xids(self, timeout_ms: int) -> list[tuple[int, int]]:
        """Wait up to ``timeout_ms`` for one XID event; returns ``[(gpu index, xid)]`` or []."""
        nv = self._nv
        try:
            data = nv.nvmlEventSetWait(self._events, int(timeout_ms))
        except nv.NVMLError as exc:
            code = _code(exc)
            if code == _ERR_TIMEOUT:
                return []
            if code in _DRIVER_GONE:
                raise NvmlUnavailable(f"NVML driver went away: {exc}") from exc
            if code == _ERR_GPU_IS_LOST:
                raise GpuLost(-1, f"a watched GPU is lost: {exc}") from exc
            return []
        if not data.eventType & EVENT_XID_CRITICAL:
            return []
        index = self._call(-1, nv.nvmlDeviceGetIndex, data.device)
        return [(int(index) if index is not None else -1, int(data.eventData))]
