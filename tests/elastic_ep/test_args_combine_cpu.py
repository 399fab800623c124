"""``combine``'s bad inputs raise ValueError naming the argument before anything launches, and the
buffer stays usable after them: the expert outputs (dtype, shape), the weights, the biases (shape, count,
type), the handle (missing, or another buffer's) and the integers ``num_sms`` / ``num_qps`` (floats,
strings, bools and None refused by name).

The torch backend runs them over gloo on the CPU; the GPU twin runs the native kernels (one GPU, EP=1).
"""
import pytest

from tests._dist import run_workers


def refusal_worker(rank, world, rdzv, backend="torch"):
    import torch

    from tests._dist import init_gloo, init_nccl
    from tests.elastic_ep._common import import_elastic_ep, make_inputs, refusal_checker

    ep = import_elastic_ep()
    dev = "cuda" if backend == "native" else "cpu"
    group = init_nccl(rank, world, rdzv) if dev == "cuda" else init_gloo(rank, world, rdzv)
    H, K, E, M = 256, 4, 8, 32
    buf = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend=backend)
    inp = make_inputs(rank, 16, H, K, E, "bf16", 0, dev)
    recv, _, rw, h, _ = buf.dispatch(inp["x"], topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"],
                                     num_experts=E)
    seen = []
    bad = refusal_checker(seen)
    c = buf.combine
    bad("x: expected dtype", lambda: c(recv.float(), h))
    bad("x: expected shape", lambda: c(recv[:-1], h))
    bad("topk_weights: expected shape", lambda: c(recv, h, topk_weights=rw[:, :1].contiguous()))
    bad("bias[0]: expected shape", lambda: c(recv, h, bias=torch.zeros(3, H, dtype=torch.bfloat16)))
    bad("bias: expected at most two", lambda: c(recv, h, bias=(None, None, None)))
    bad("bias: expected None, a tensor or a sequence", lambda: c(recv, h, bias=3))
    bad("handle: expected the EPHandle", lambda: c(recv, None))
    bad("num_qps: expected an int >= 0, got 1.5", lambda: c(recv, h, num_qps=1.5))
    bad("num_sms: expected an int >= 0, got 'x'", lambda: c(recv, h, num_sms="x"))
    bad("num_sms: expected an int >= 0, got None", lambda: c(recv, h, num_sms=None))
    bad("num_sms: expected an int >= 0, got False", lambda: c(recv, h, num_sms=False))
    buf2 = ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend=backend)
    bad("produced by another ElasticBuffer", lambda: buf2.combine(recv, h))
    buf2.destroy()
    # usable after the refusals
    y, w, _ = c(recv, h, topk_weights=rw)
    assert y.shape == (16, H) and w.shape == (16, K)
    buf.destroy()
    return len(seen)


def test_combine_refuses_bad_inputs_before_launch(tmp_path):
    assert run_workers(refusal_worker, 2, tmp_path=tmp_path, timeout=120) == [12, 12]


@pytest.mark.smoke
@pytest.mark.gpu
def test_combine_refuses_bad_inputs_native_ep1(tmp_path):
    assert run_workers(refusal_worker, 1, "native", tmp_path=tmp_path, timeout=180) == [12]
