"""In-process unit tests of the small API pieces: EPHandle.copy, EventOverlap, the package surface."""
import pytest
import torch

from tests.elastic_ep._common import import_elastic_ep

ep = import_elastic_ep()
from elastic_ep import _checks, _domains, _env, _nvml  # noqa: E402
from elastic_ep._handle import sorted_metadata  # noqa: E402
from elastic_ep.buffer import EPHandle, EventOverlap  # noqa: E402


def _handle():
    t = lambda *s: torch.arange(int(torch.tensor(s).prod()), dtype=torch.int32).view(*s)  # noqa: E731
    return EPHandle(num_experts=8, num_max_tokens_per_rank=4, expert_alignment=1, do_expand=False, num_sms=0,
                    topk_idx=torch.tensor([[0, 1], [2, -1], [3, 4]]), num_recv_tokens=5,
                    num_expanded_tokens=6, num_recv_tokens_per_expert_list=[1, 2, 3, 0],
                    psum_num_recv_tokens_per_scaleup_rank=t(2), psum_num_recv_tokens_per_expert=t(4),
                    num_unaligned_recv_tokens_per_expert=t(4), recv_src_metadata=t(5, 4),
                    dst_buffer_slot_idx=t(3, 2))


def test_handle_copy_is_deep():
    h = _handle()
    c = h.copy()
    assert c is not h and c.num_recv_tokens == 5 and c.num_allocated_tokens == 5
    c.topk_idx[0, 0] = 7
    c.recv_src_metadata.zero_()
    c.num_recv_tokens_per_expert_list.append(9)
    assert h.topk_idx[0, 0] == 0 and int(h.recv_src_metadata.sum()) == sum(range(20))
    assert h.num_recv_tokens_per_expert_list == [1, 2, 3, 0]
    assert int(h.num_valid_recv_tokens()) == 1


def test_event_overlap_waits_once_per_use():
    calls = []

    class Ev:
        def current_stream_wait(self):
            calls.append(1)

    e = EventOverlap(Ev())
    e.current_stream_wait()
    with e as same:
        assert same is e
    assert calls == [1, 1]
    EventOverlap(None).current_stream_wait()  # nothing to wait for
    with EventOverlap(None):
        pass


def test_package_surface_imports_without_gpu():
    assert ep.topk_idx_t is torch.int64
    assert ep.ALIGNMENT_BYTES == 2 * 1024 * 1024
    assert isinstance(ep.native_available(), bool)
    for name in ("dispatch", "combine", "barrier", "destroy", "capture", "get_comm_stream",
                 "get_physical_domain_size", "get_logical_domain_size", "get_buffer_size_hint",
                 "get_theoretical_num_sms", "get_theoretical_num_qps"):
        assert callable(getattr(ep.ElasticBuffer, name)), name


def test_event_overlap_hook_and_release_like_deepep():
    """DeepEP V2's EventOverlap: the hook runs once after the wait and its result is returned,
    ``wait()`` is ``current_stream_wait()``, ``with ev(release_handle=True)`` drops the event."""
    calls = []

    class Ev:
        def current_stream_wait(self):
            calls.append("wait")

    e = EventOverlap(Ev())
    e.register_hook_after_wait(lambda: calls.append("hook") or 42)
    try:
        e.register_hook_after_wait(lambda: None)
    except RuntimeError as err:
        assert "already registered" in str(err)
    else:
        raise AssertionError("a second hook was accepted")
    assert e.wait() == 42 and calls == ["wait", "hook"]
    assert e.current_stream_wait() is None and calls == ["wait", "hook", "wait"]  # the hook ran once
    with e(release_handle=True) as same:
        assert same is e
    assert e.event is None and calls[-1] == "wait"
    with e:  # nothing left to wait for
        pass
    assert calls.count("wait") == 3


def test_event_handle_is_exported_and_capture_is_static():
    assert ep.EventHandle is ep.ElasticBuffer.capture().__class__
    h = ep.ElasticBuffer.capture()  # no CUDA initialised here: nothing recorded, waiting is a no-op
    h.current_stream_wait()
    # both forms are accepted as event arguments, anything else is refused before launch
    _checks.check_event("previous_event", h)
    _checks.check_event("previous_event", EventOverlap(h))
    _checks.check_event("previous_event", EventOverlap(None))
    for bad in (object(), EventOverlap(object()), 3):
        try:
            _checks.check_event("previous_event", bad)
        except ValueError as err:
            assert "previous_event: expected None, an EventHandle" in str(err)
        else:
            raise AssertionError(f"{bad!r} accepted as an event")


def test_handle_identity_semantics_and_derived_sizes():
    h = _handle()
    assert h.num_tokens == 3 and h.num_topk == 2 and h.num_sms == 0
    assert h == h and h != h.copy()  # identity, never a tensor comparison
    assert len({h, h.copy()}) == 2   # hashable: usable as a dict key
    assert h.backend_recv_src_metadata is h.recv_src_metadata
    raw = torch.zeros(5, 4, dtype=torch.int32)
    from dataclasses import replace
    assert replace(h, raw_recv_src_metadata=raw).backend_recv_src_metadata is raw


def test_deterministic_metadata_follows_the_sorted_rows():
    """DeepEP's deterministic metadata: non-expand rows permuted with the output rows; expand row
    pointers (columns 2..) remapped to where the rows moved, -1 kept."""
    sm = sorted_metadata
    meta = torch.tensor([[30, 0, -1, -1], [10, 1, -1, -1], [20, 2, -1, -1]], dtype=torch.int32)
    perm = torch.tensor([1, 2, 0])  # user row j = backend row perm[j]: sources 10, 20, 30
    assert sm(meta, perm, False)[:, 0].tolist() == [10, 20, 30]
    # expand: 3 tokens, rows 0..4; token 0 owns rows 0 and 3, token 1 row 1, token 2 rows 2 and 4
    meta = torch.tensor([[30, 0, 0, 3], [10, 1, 1, -1], [20, 2, 2, 4]], dtype=torch.int32)
    perm = torch.tensor([1, 2, 0, 4, 3])  # segment [0, 3): sources 10, 20, 30; segment [3, 5): 20, 30
    out = sm(meta, perm, True)
    assert out[:, :2].tolist() == meta[:, :2].tolist()
    assert out[:, 2:].tolist() == [[2, 4], [0, -1], [1, 3]]
    for i in range(3):  # every pointer lands on the row that now holds that token's data
        for r_new in out[i, 2:].tolist():
            if r_new >= 0:
                assert int(perm[r_new]) in meta[i, 2:].tolist()


def _buffer(num_ranks=2, settings=None):
    b = object.__new__(ep.ElasticBuffer)
    b.num_ranks, b.device, b.prefer_overlap_with_compute = num_ranks, torch.device("cpu"), True
    b._settings, b._device_sms = settings or _env.Settings(), 132
    b.domains = _domains.Domains(num_ranks, 0, 1, num_ranks, 1, num_ranks)
    return b


def test_theoretical_num_sms_hybrid_scaleout_term():
    """Hybrid mode, 256 experts, top-8, 450 GB/s NVLink, one 400 Gb/s NIC per GPU (45 GB/s).
    2x8: a token reaches k_out = 2 (1 - C(128,8)/C(256,8)) = 1.993 domains (0.997 remote rows on the
    network) and k = 6.523 ranks (5.708 NVLink rows): the network binds, 45 / 0.997 = 45.2 row-GB/s of
    tokens; the SMs write (1.993 + 6.523) rows per token: 45.2 x 8.516 / 50 = 7.69 SMs, +25 % -> 10.
    8x8: k_out = 5.295 (4.633 remote rows), k = 7.676: 45 / 4.633 x 12.97 / 50 = 2.52 -> 4 (the floor).
    The emulated 2x2 of one node (scale-out on NVLink, 450 GB/s): 256 experts, top-8, k_out = 1.993,
    k = 3.614 (1.807 NVLink rows, more than the 0.997 on the emulated network) -> NVLink binds:
    450 / 1.807 x 5.607 / 50 = 27.9, +25 % = 34.9 -> 36 (even)."""
    b = _buffer(16)
    b.domains = _domains.Domains(16, 0, 2, 8, 2, 8)
    assert b.get_theoretical_num_sms(256, 8) == 10
    b.domains = _domains.Domains(64, 0, 8, 8, 8, 8)
    b.num_ranks = 64
    assert b.get_theoretical_num_sms(256, 8) == 4
    assert b.get_theoretical_num_sms(256, 8, num_scaleout_topk=4) == 4
    b.num_ranks, b.domains = 4, _domains.Domains(4, 0, 1, 4, 2, 2, overridden=True)
    assert b.get_theoretical_num_sms(256, 8) == 36
    with pytest.raises(ValueError, match="num_scaleout_topk"):
        b.get_theoretical_num_sms(256, 8, num_scaleout_topk=3)  # more than the 2 domains
    b.domains = _domains.Domains(4, 0, 1, 4, 1, 4)
    with pytest.raises(ValueError, match="num_scaleout_topk: expected 0 in direct mode"):
        b.get_theoretical_num_sms(256, 8, num_scaleout_topk=1)


def test_theoretical_num_sms_follows_the_bandwidth_model():
    """DeepEP's model at EP 2, 256 experts, top-8: each SM writes 50 GB/s, the link carries half the
    rows at 450 GB/s, so 18 SMs, +25 % -> 24 (even); at least 64 without preferring overlap; all SMs
    at EP 1; ELASTIC_EP_NUM_SMS wins."""
    b = _buffer()
    assert b.get_theoretical_num_sms(256, 8) == 24  # off a GPU: NVML has no device, 450 GB/s
    assert b.get_theoretical_num_sms(256, 8, nvlink_gbs=900) == 46
    b.prefer_overlap_with_compute = False
    assert b.get_theoretical_num_sms(256, 8) == 64
    b.num_ranks = 1
    assert b.get_theoretical_num_sms(256, 8) == 132  # no link traffic: the whole (assumed H200) device
    b._settings = _env.Settings(num_sms=20)
    assert b.get_theoretical_num_sms(256, 8) == 20
    b._settings, b.num_ranks = _env.Settings(), 2
    for args in ((255, 8), (256, 0), (256, 8, 1)):
        try:
            b.get_theoretical_num_sms(*args)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{args} accepted")


def test_num_sms_zero_means_the_theoretical_count_cached(monkeypatch):
    """dispatch / combine with num_sms=0 use get_theoretical_num_sms, as DeepEP; computed once per shape."""
    b = _buffer()
    calls = []
    real = ep.ElasticBuffer.get_theoretical_num_sms
    monkeypatch.setattr(ep.ElasticBuffer, "get_theoretical_num_sms",
                        lambda self, e, k, *a: calls.append((e, k)) or real(self, e, k, *a))
    b._sms_cache = {}
    assert b._sms_for(256, 8) == 24 and b._sms_for(256, 8) == 24 and calls == [(256, 8)]
    assert b._sms_for(4, 8) == real(b, 4, 4)  # top-k above the expert count (repeated ids): capped
    b._max_sms = 16
    with pytest.raises(ValueError, match=r"num_sms must be in \[0, 16\], got 24"):
        _checks._num_sms(b, 0, 256, 8)
    assert _checks._num_sms(b, 12, 256, 8) == 12


class _FakeNvml:
    """pynvml's calls used by _nvml, on a made-up device with 18 links of which 16 are active."""

    NVML_FEATURE_ENABLED = 1
    NVMLError = RuntimeError

    def __init__(self):
        self.calls = []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self.calls.append(bus)
        return "dev"

    def nvmlDeviceGetNvLinkState(self, dev, link):
        if link >= 18:
            raise RuntimeError("no such link")
        return 1 if link < 16 else 0

    def nvmlDeviceGetFieldValues(self, dev, fields):
        assert fields == [90]  # NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON
        from types import SimpleNamespace
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=25000))]


def test_nvlink_bandwidth_from_nvml_is_cached(monkeypatch):
    import sys

    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(_nvml, "_cache", {})
    # 16 active links x 25 GB/s x 0.9 (DeepEP's factor on nvidia-smi's figures)
    assert _nvml.nvlink_gbs("0000:18:00.0") == pytest.approx(16 * 25.0 * 0.9)
    assert _nvml.nvlink_gbs("0000:18:00.0") == pytest.approx(360.0)
    assert fake.calls == ["init", "0000:18:00.0", "shutdown"]  # asked once
    assert _nvml.nvlink_gbs(None) == _nvml.FALLBACK_GBS  # no device (a CPU buffer)
    assert _nvml.pci_bus_id(None) is None
    # A buffer on that GPU asks NVML when nvlink_gbs=0: the model then needs 360 / 0.5 / 50 = 14.4 SMs
    # -> 18 (+25 %, even), where the 450 GB/s fallback gives 24.
    from types import SimpleNamespace

    b = _buffer()
    b.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(pci_domain_id=0, pci_bus_id=0x18, pci_device_id=0))
    assert b.get_theoretical_num_sms(256, 8) == 18
    assert fake.calls == ["init", "0000:18:00.0", "shutdown", "init", "00000000:18:00.0", "shutdown"]
    assert b.get_theoretical_num_sms(256, 8) == 18 and len(fake.calls) == 6  # asked once per GPU


def test_nvlink_bandwidth_through_ctypes_and_the_fallback(monkeypatch):
    import ctypes
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable: the ctypes path

    class Lib:
        def nvmlInit_v2(self):
            return 0

        def nvmlShutdown(self):
            return 0

        def nvmlDeviceGetHandleByPciBusId_v2(self, bus, out):
            assert bus == b"0000:3a:00.0"
            return 0

        def nvmlDeviceGetNvLinkState(self, dev, link, out):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_uint))[0] = 1 if link.value < 18 else 0
            return 0

        def nvmlDeviceGetFieldValues(self, dev, count, out):
            field = ctypes.cast(out, ctypes.POINTER(_nvml._FieldValue))[0]
            assert count.value == 1 and field.fieldId == 90
            field.nvmlReturn, field.value.uiVal = 0, 26562
            return 0

    monkeypatch.setattr(_nvml, "_cache", {})
    monkeypatch.setattr(_nvml, "_load_libnvml", lambda: Lib())
    assert _nvml.nvlink_gbs("0000:3a:00.0") == pytest.approx(18 * 26.562 * 0.9)

    def missing():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(_nvml, "_load_libnvml", missing)
    assert _nvml.nvlink_gbs("0000:3b:00.0") == _nvml.FALLBACK_GBS
