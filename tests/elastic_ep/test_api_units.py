"""In-process unit tests of the small API pieces: EPHandle.copy, EventOverlap, the package surface."""
import torch

from tests.elastic_ep._common import import_elastic_ep

ep = import_elastic_ep()
from elastic_ep.buffer import EPHandle, EventOverlap  # noqa: E402


def _handle():
    t = lambda *s: torch.arange(int(torch.tensor(s).prod()), dtype=torch.int32).view(*s)  # noqa: E731
    return EPHandle(num_experts=8, num_max_tokens_per_rank=4, expert_alignment=1, do_expand=False, num_tokens=3,
                    num_topk=2, topk_idx=torch.tensor([[0, 1], [2, -1], [3, 4]]), num_recv_tokens=5,
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
