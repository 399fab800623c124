"""The NVLink bandwidth of a GPU from NVML, for DeepEP V2's SM model (``get_theoretical_num_sms``).

DeepEP derives it from ``nvidia-smi nvlink -s`` (the active links' speeds) times 0.9; this reads the
same figures from NVML: through ``pynvml`` when it is importable, else through ctypes on
``libnvidia-ml.so.1``, else (no driver, no NVLink) ``FALLBACK_GBS``. Each device is asked once.
"""
from __future__ import annotations

import ctypes
from typing import Any, Dict, Optional, Tuple

__all__ = ["FALLBACK_GBS", "EFFICIENCY", "nvlink_gbs", "pci_bus_id"]

FALLBACK_GBS = 450.0     # an H100 / H200's NVLink, per direction
EFFICIENCY = 0.9         # DeepEP's factor on the links' nominal speed
_MAX_LINKS = 18          # NVML_NVLINK_MAX_LINKS of Hopper-era drivers
_FI_SPEED_COMMON = 90    # NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON: MB/s per active link and direction
_cache: Dict[Optional[str], float] = {}


def pci_bus_id(props: Any) -> Optional[str]:
    """NVML's bus id (``"00000000:18:00.0"``) of a GPU from its ``torch.cuda.get_device_properties``, or
    None (no properties, or a torch without the PCI fields)."""
    try:
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, TypeError, ValueError):
        return None


def nvlink_gbs(pci_bus_id: Optional[str]) -> float:
    """Unidirectional NVLink GB/s of the GPU at ``pci_bus_id`` (``"00000000:18:00.0"``): active links x
    per-link speed x ``EFFICIENCY``; ``FALLBACK_GBS`` when NVML cannot tell (or ``pci_bus_id`` is
    None). Cached per device."""
    if pci_bus_id not in _cache:
        found = None
        if pci_bus_id is not None:
            for query in (_query_pynvml, _query_ctypes):
                try:
                    found = query(pci_bus_id)
                except Exception:  # noqa: BLE001 - a missing or old library: try the next way
                    found = None
                if found is not None:
                    break
        links, mbps = found if found is not None else (0, 0)
        _cache[pci_bus_id] = links * mbps / 1000.0 * EFFICIENCY if links and mbps else FALLBACK_GBS
    return _cache[pci_bus_id]


def _query_pynvml(pci_bus_id: str) -> Optional[Tuple[int, int]]:
    """``(active links, MB/s per link)`` through pynvml, or None when it is not importable."""
    try:
        import pynvml  # noqa: WPS433 - optional
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        dev = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
        links = 0
        for link in range(_MAX_LINKS):
            try:
                links += int(pynvml.nvmlDeviceGetNvLinkState(dev, link) == pynvml.NVML_FEATURE_ENABLED)
            except pynvml.NVMLError:
                continue
        value = pynvml.nvmlDeviceGetFieldValues(dev, [_FI_SPEED_COMMON])[0]
        return links, (int(value.value.uiVal) if value.nvmlReturn == 0 else 0)
    finally:
        pynvml.nvmlShutdown()


class _Value(ctypes.Union):
    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint), ("ulVal", ctypes.c_ulong),
                ("ullVal", ctypes.c_ulonglong), ("sllVal", ctypes.c_longlong), ("siVal", ctypes.c_int),
                ("usVal", ctypes.c_ushort)]


class _FieldValue(ctypes.Structure):
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", _Value)]


def _load_libnvml() -> Any:
    return ctypes.CDLL("libnvidia-ml.so.1")


def _query_ctypes(pci_bus_id: str) -> Optional[Tuple[int, int]]:
    """``(active links, MB/s per link)`` through ctypes on the driver's NVML, or None without it."""
    try:
        lib = _load_libnvml()
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    try:
        dev = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(dev)) != 0:
            return None
        links, state = 0, ctypes.c_uint()
        for link in range(_MAX_LINKS):
            if lib.nvmlDeviceGetNvLinkState(dev, ctypes.c_uint(link), ctypes.byref(state)) == 0:
                links += int(state.value == 1)  # NVML_FEATURE_ENABLED
        field = _FieldValue(fieldId=_FI_SPEED_COMMON)
        if lib.nvmlDeviceGetFieldValues(dev, ctypes.c_int(1), ctypes.byref(field)) != 0 or field.nvmlReturn != 0:
            return links, 0
        return links, int(field.value.uiVal)
    finally:
        lib.nvmlShutdown()
