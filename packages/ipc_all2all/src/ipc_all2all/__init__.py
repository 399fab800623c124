"""ipc_all2all -- CUDA-IPC all-to-all for Ulysses sequence parallelism, on one node.

What it does
------------
With ``W`` ranks, each holding ``local_tokens`` of a sequence and all ``H`` attention heads,

* ``send_recv_heads(x[b, local_tokens, H, D]) -> [b, total_tokens, H/W, D]`` scatters heads and
  gathers tokens (rank ``r`` receives heads ``r*H/W : (r+1)*H/W`` of every token, ordered by rank);
* ``gather_heads(x[b, total_tokens, H/W, D]) -> [b, local_tokens, H, D]`` is its exact inverse;
* ``allgather(x[b, local_tokens, h, d]) -> [b, total_tokens, h, d]`` concatenates tokens.

The result is bit-identical to ``permute -> all_to_all_single -> permute`` (and
``all_gather_into_tensor``) for any 1-, 2- or 4-byte dtype; token counts may differ per rank, zero
included.

How
---
Each rank allocates ONE device buffer ``[signals 4 KiB | slot 0 | slot 1]`` and shares it by a CUDA
IPC handle. One kernel per call *pushes* every rank's rows straight into the receivers' slots over
NVLink with 16-byte vector stores from many SMs, so the output lands permuted in place and no
separate permute pass or staging copy exists. Calls alternate between the two slots, so a call may
consume the previous call's zero-copy output (the round trip ``gather_heads(send_recv_heads(x))``).

Back-to-back safety: each call has an epoch kept on the device (CUDA-graph replays advance it).
On entry a rank announces ``ready = (epoch, signature)`` to every peer and writes into a peer only
after that peer announced the same epoch, i.e. after the peer's stream finished everything before
this call (no write-after-read race however far one rank runs ahead). The signature (operation,
output slot, geometry, token counts) must match too: a rank that skipped a call, or a
``send_recv_heads`` met by a ``gather_heads``, fails the call on both sides with ``CommError``
instead of being paired silently. Completion is a per-peer ``done = epoch`` written after the data;
all counters are monotonic, so none can overshoot. Every wait has a deadline on ``%globaltimer``: on
expiry the kernel records (operation, rank, peer) in host-mapped memory and exits; the next call,
``check()`` or ``synchronize()`` raises ``CommTimeoutError`` naming them. There is no ``trap``; the
CUDA context stays usable. A failed kernel also leaves a sticky mark in the instance's device memory
(and, after a timeout, in the peers'): every later kernel of the instance, already queued or not,
moves nothing and reports itself abandoned, and the host refuses further calls. Destroy the
instance on every rank and build a new one.

Zero-copy outputs (``copy_out=False``) are views into the instance's buffer: the view returned
by call N stays valid until this rank enqueues call N+2 on the instance (call N+1 writes the other
slot). Read it on the stream that made the call, or pass ``copy_out=True`` to get a fresh tensor.
A view keeps the buffer allocated, also past ``destroy()`` (the memory is freed with the last view).
Calls of one instance made on different streams run one after the other (each call waits for the
previous one). Once a call of an instance has been captured in a CUDA graph, its eager calls return
copies (a replay may rewrite either slot), and a captured call refuses an input that is a view made
outside its capture; see the README's "Lifetimes" for what a view made inside a capture holds.

How to launch
-------------
One process per GPU, with torch.distributed initialised. LTX's constructor, collective when given
a group::

    import ipc_all2all
    a2a = ipc_all2all.All2All(rank, W, max_local_tokens * batch, H * D, num_sms, torch.bfloat16, group=group)
    a2a.set_rank_tokens(tokens_per_rank)                # list of W ints, or an int32 CUDA tensor
    q = a2a.send_recv_heads(q_local, copy_out=True)
    ...
    out = a2a.gather_heads(attn_out)
    a2a.destroy()                                       # collective

or ``with ipc_all2all.All2All.from_group(group, num_tokens=..., hidden_dim=..., tensor_dtype=...)``.
Inside ``torch.compile`` the methods are the torch custom ops of ``ipc_all2all.ops`` (with fake
implementations). ``python -m ipc_all2all.demo`` checks both directions against plain torch; ``tools/block_ipc_all2all.py`` times a sequence-parallel attention layer on it.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads the CUDA runtime before _C)

from . import _C  # noqa: F401
from . import ops  # noqa: F401  (registers the torch custom ops)
from ._lifetime import release_deferred
from ._shapes import MAX_WORLD_SIZE
from .all2all import (
    DEFAULT_TIMEOUT_SECONDS,
    DESTROY_TIMEOUT_SECONDS,
    FP8_WIRE_HEAD_DIMS,
    All2All,
    CommError,
    CommTimeoutError,
    built_with_cuda,
)

__all__ = [
    "All2All",
    "CommError",
    "CommTimeoutError",
    "DEFAULT_TIMEOUT_SECONDS",
    "DESTROY_TIMEOUT_SECONDS",
    "FP8_WIRE_HEAD_DIMS",
    "MAX_WORLD_SIZE",
    "built_with_cuda",
    "release_deferred",
]

__version__ = "0.2.0"
