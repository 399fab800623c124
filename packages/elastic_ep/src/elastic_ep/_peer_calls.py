"""What a PP transfer and an AGRS gather tell the peers about each call, and the errors a difference raises.

Both ends of a PP transfer, and every rank of an AGRS gather, must pass the same tensors: a receiver
that reads bytes of another size or dtype than its peer wrote gets garbage, or, sized by the peer,
writes past its own tensor. So each call carries a small description of its tensors, compared before
any byte is read or copied; a difference is refused by name, on both backends with the same text:

* PP, per tensor: ``(dtype code, numel, shape word)`` (``pp_descriptor``). The native send writes it
  into the receiver's descriptor ring (kernels/pp.cuh), the torch send as a header message. The receive
  compares it with its own tensor's, then copies nothing when they differ: ``t`` stays unchanged, the
  tensor is dropped, and the receiver raises ``pp_recv_error`` (torch: at once; native: at its next
  call, as a dispatch without CPU sync). The sender hears of it at its next ``pp_set_config`` (the
  first call where both ranks meet), which every rank then refuses (``pp_send_error``).
* AGRS, per gather: a record of 16 words (``agrs_record``): tensor count, the gather's offset in its
  session, and the dtype, element count and shape of the first four tensors (a digest of the rest).
  The torch runtime all-gathers the records before posting any data; the native gather-done kernel
  compares their digests (folded into its signal word) and then the records (kernels/agrs.cuh).
  Every rank refuses a gather whose records differ, naming the lowest such peer and the first word
  that differs (``agrs_gather_error``).

The native kernels report through the host's report words (``native_report_error``); the codes are
csrc/kernels/launch.hpp's ``kReport*``.
"""
from __future__ import annotations

import zlib
from typing import List, Optional, Sequence, Tuple

import torch

from . import _C

__all__ = ["dtype_code", "dtype_text", "shape_word", "shape_text", "pp_descriptor", "pp_difference",
           "pp_recv_error", "pp_send_error", "agrs_record", "agrs_difference", "agrs_gather_error",
           "native_report_error", "REPORT_FIRST", "PP_FIELDS", "AGRS_RECORD_WORDS", "U64"]

U64 = (1 << 64) - 1
# launch.hpp's kReportPpField (+ PpField), kReportPpTag, kReportAgrsTag, kReportAgrsWord (+ record word)
# and sizing.hpp's kAgrsRecordWords, as the extension binds them.
REPORT_PP_FIELD, REPORT_PP_TAG = _C.REPORT_PP_FIELD, _C.REPORT_PP_TAG
REPORT_AGRS_TAG, REPORT_AGRS_WORD = _C.REPORT_AGRS_TAG, _C.REPORT_AGRS_WORD
REPORT_FIRST = REPORT_PP_FIELD
PP_FIELDS = ("dtype", "numel", "shape")  # launch.hpp PpField order: the first that differs is named
AGRS_RECORD_WORDS = _C.AGRS_RECORD_WORDS
AGRS_DETAILED = 4                        # tensors with words of their own; a digest covers the rest
_AGRS_REST = 3 + 2 * AGRS_DETAILED

# A dtype's code is its index here plus one (never renumbered: both ends must agree); others get
# 0x80 | a hash of their name, so two of them still differ (almost always) but are not named.
_DTYPES = ("float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool",
           "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex64",
           "complex128", "complex32", "uint16", "uint32", "uint64", "float4_e2m1fn_x2")
_CODES = {getattr(torch, n): i + 1 for i, n in enumerate(_DTYPES) if hasattr(torch, n)}


def dtype_code(dtype: torch.dtype) -> int:
    """The dtype's code, 1..127 for elastic_ep's list, 128..255 otherwise."""
    code = _CODES.get(dtype)
    return code if code is not None else 0x80 | (zlib.crc32(str(dtype).encode()) & 0x7F)


def dtype_text(code: int) -> str:
    if 1 <= code <= len(_DTYPES):
        return f"torch.{_DTYPES[code - 1]}"
    return f"a dtype outside elastic_ep's list (code {code})"


def shape_word(shape: Sequence[int]) -> int:
    """A shape in 64 bits: up to 4 dims below 2^15 packed (ndim in the top 4 bits), else 0xF, the ndim
    and a 56-bit digest of the dims."""
    n = len(shape)
    if n <= 4 and all(d < 1 << 15 for d in shape):
        w = n << 60
        for i, d in enumerate(shape):
            w |= int(d) << (15 * i)
        return w
    return (0xF << 60) | (min(n, 15) << 56) | (hash(tuple(int(d) for d in shape)) & ((1 << 56) - 1))


def shape_text(word: int) -> str:
    n = word >> 60
    if n <= 4:
        return str(tuple((word >> (15 * i)) & 0x7FFF for i in range(n)))
    ndim = (word >> 56) & 0xF
    return f"a shape of {ndim}{' or more' if ndim == 15 else ''} dims (too large to show)"


# ---------------------------------------------------------------------------------------------- PP
def pp_descriptor(t: torch.Tensor) -> Tuple[int, int, int]:
    """``(dtype code, numel, shape word)`` of a PP tensor, in launch.hpp's PpField order."""
    return dtype_code(t.dtype), t.numel(), shape_word(t.shape)


def pp_difference(theirs: Sequence[int], mine: Sequence[int]) -> Optional[int]:
    """The first field (index into ``PP_FIELDS``) where two descriptors differ, or None."""
    for f, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            return f
    return None


def _pp_value(field: int, v: int) -> str:
    return dtype_text(v) if field == 0 else str(v) if field == 1 else shape_text(v)


def pp_recv_error(rank: int, src: int, k: int, field: int, theirs: int, mine: int) -> ValueError:
    """The receiver's error: rank ``src``'s ``k``-th tensor to this rank (from 0) differs in ``field``."""
    return ValueError(
        f"pp_recv [rank {rank}]: the tensor rank {src} sent (its pp_send #{k} to this rank, counted from 0) does "
        f"not match this call's t: {PP_FIELDS[field]}: rank {src} passed {_pp_value(field, theirs)}, rank {rank} "
        f"(this one) {_pp_value(field, mine)}. Nothing was copied into t and that tensor is dropped; the buffer "
        "stays usable and the two ranks' next pp_send / pp_recv pair up as before (the sender hears of it at its "
        "next pp_set_config). Both ends of a transfer must pass tensors of the same dtype and shape.")


def pp_send_error(rank: int, dst: int, k: int, field: int, receiver_value: int, sender_value: int) -> ValueError:
    """The sender's error (at ``pp_set_config``): rank ``dst`` refused this rank's ``k``-th tensor to it."""
    return ValueError(
        f"pp_send [rank {rank}]: rank {dst} refused this rank's pp_send #{k} to it (counted from 0): "
        f"{PP_FIELDS[field]}: rank {rank} (this one) passed {_pp_value(field, sender_value)}, rank {dst} "
        f"{_pp_value(field, receiver_value)}. Its pp_recv copied nothing and raised; the buffer stays usable "
        "(pp_set_config, where the sender hears of it, changed nothing: call it again). Both ends of a transfer "
        "must pass tensors of the same dtype and shape.")


# ---------------------------------------------------------------------------------------------- AGRS
def agrs_record(tensors: Sequence[torch.Tensor], offset: int) -> List[int]:
    """The 16-word record of a gather of ``tensors`` at byte ``offset`` of its session (word 0 is the
    native kernel's: the digest of the others)."""
    w = [0] * AGRS_RECORD_WORDS
    w[1], w[2] = len(tensors), offset
    for i, x in enumerate(tensors[:AGRS_DETAILED]):
        w[3 + 2 * i] = (dtype_code(x.dtype) << 56) | (x.numel() & ((1 << 56) - 1))
        w[4 + 2 * i] = shape_word(x.shape)
    if len(tensors) > AGRS_DETAILED:
        w[_AGRS_REST] = hash(tuple(pp_descriptor(x) for x in tensors[AGRS_DETAILED:])) & U64
    return w


def agrs_difference(theirs: Sequence[int], mine: Sequence[int]) -> Optional[int]:
    """The first word (1..15) where two gather records differ, or None."""
    for w in range(1, AGRS_RECORD_WORDS):
        if theirs[w] != mine[w]:
            return w
    return None


def _agrs_field(word: int, theirs: int, mine: int) -> Tuple[str, str, str]:
    """``(what, the peer's value, this rank's)`` of record word ``word``."""
    if word == 1:
        return "the number of tensors", str(theirs), str(mine)
    if word == 2:
        return ("the gather's byte offset in its session (an earlier gather of the session differed)", str(theirs),
                str(mine))
    if 3 <= word < _AGRS_REST:
        i = (word - 3) // 2
        if word % 2 == 0:
            return f"tensor {i}'s shape", shape_text(theirs), shape_text(mine)
        if theirs >> 56 != mine >> 56:
            return f"tensor {i}'s dtype", dtype_text(theirs >> 56), dtype_text(mine >> 56)
        n = (1 << 56) - 1
        return f"tensor {i}'s numel", str(theirs & n), str(mine & n)
    if word == _AGRS_REST:
        return f"the dtypes, sizes or shapes of tensors {AGRS_DETAILED} and after", hex(theirs), hex(mine)
    return f"record word {word}", hex(theirs), hex(mine)


def agrs_gather_error(rank: int, peer: int, word: int, theirs: int, mine: int) -> ValueError:
    """Every rank's error for a gather whose records differ: ``peer``'s word ``word`` is ``theirs``."""
    what, a, b = _agrs_field(word, theirs & U64, mine & U64)
    return ValueError(
        f"all_gather [rank {rank}]: the ranks passed different tensors to one gather: {what}: rank {peer} passed "
        f"{a}, rank {rank} (this one) {b}. Every rank refused that gather: its results are not valid (the "
        "session's earlier results are intact); end the session (destroy_agrs_session) and gather again in a new "
        "one: the buffer stays usable. Every rank must pass tensors of the same dtypes and shapes, in the same "
        "order, to each all_gather.")


# ---------------------------------------------------------------------------------------------- native reports
def native_report_error(rank: int, peer_word: int, what: int, theirs: int, mine: int) -> Exception:
    """The error of a PP / AGRS report of the native kernels (``what >= REPORT_FIRST``): a ValueError
    for a refused call (the buffer stays usable), a CommError for a corrupted word (the caller marks
    the runtime unusable)."""
    theirs, mine = theirs & U64, mine & U64
    if REPORT_PP_FIELD <= what < REPORT_PP_FIELD + len(PP_FIELDS):
        src, tag = peer_word & 0xFF, peer_word >> 8
        return pp_recv_error(rank, src, (tag - 1) % (1 << 23), what - REPORT_PP_FIELD, theirs, mine)
    if REPORT_AGRS_WORD <= what < REPORT_AGRS_WORD + AGRS_RECORD_WORDS:
        return agrs_gather_error(rank, peer_word, what - REPORT_AGRS_WORD, theirs, mine)
    if what == REPORT_PP_TAG:
        detail = (f"rank {peer_word & 0xFF}'s PP descriptor is from its tensor #{theirs - 1}, this receive expects "
                  f"#{mine - 1} (a corrupted word)")
        op = "pp_recv"
    elif what == REPORT_AGRS_TAG:
        detail = f"rank {peer_word}'s gather signal is from gather {theirs}, this rank is at gather {mine}"
        op = "all_gather"
    else:
        detail, op = f"report {what} from rank {peer_word} ({theirs}, {mine})", "elastic_ep"
    return _C.CommError(f"{op} [rank {rank}]: protocol error: {detail}; nothing was copied. This buffer is "
                        "unusable: destroy it on every rank and create a new one")
