// elastic_ep/csrc/kernels/sizing.hpp -- every byte layout of the elastic buffer, as constexpr functions.
//
// The symmetric window registered with NCCL is  [ workspace (2 MiB-aligned) | buffer ].
//   * workspace: signals and counters (WorkspaceLayout). Remote ranks write into it through LSA
//     pointers; values are tagged with an operation epoch so nothing has to be re-zeroed between
//     operations (the window is zeroed once at creation). The local scratch part is returned to zero
//     by the kernel that used it.
//   * buffer: dispatch receive area and combine receive area. They alias (the buffer is sized for the
//     larger of the two), which is safe because every operation starts with an epoch barrier.
//
// Dispatch token record (each part 16 B aligned):
//   [ hidden * elem_size | num_sf_packs * 4 B | topk_idx int32 x K | topk_weights f32 x K | src meta 2 x int32 ]
// Dispatch receive area (direct mode): [src_rank][num_max_tokens_per_rank][record]; a sender writes its
// tokens for rank r into r's area [sender][slot], slot = number of earlier tokens of the sender bound for r.
//
// Combine token record: [ hidden * 2 B (bf16) | topk_weights f32 x K ].
// Combine receive area (direct mode): [num_max_tokens_per_rank][num_slots][record], num_slots =
// min(R, K) with multiple reduction (one slot per rank when R <= K, else one per master top-k lane),
// K without.
//
// Everything here is host+device constexpr; the bindings expose it to Python in every build, CUDA or
// not, and the CPU suite checks it against DeepEP V2's formulas by hand (test_sizing.py).
#pragma once

#include <cstdint>

#include "commkit/layout.hpp"

namespace elastic_ep {

using commkit::align_up;
using commkit::ceil_div;
using commkit::Layout;
using commkit::Region;

// Sizes come from user arguments (int token counts, hidden sizes, rank counts), so their int64
// products can exceed int64: signed overflow is undefined, and in practice it wrapped to a small
// positive size that a buffer-too-small check then accepted. Host code saturates at kSizeOverflow
// (INT64_MAX, no allocation's size; commkit::sat_mul / sat_add / sat_cast) and the bindings refuse
// it; device code keeps the plain arithmetic. Operands are non-negative (the bindings check them).
constexpr int64_t kSizeOverflow = commkit::max_of<int64_t>();
namespace sizing_detail {
CK_HD constexpr int64_t mul(int64_t a, int64_t b) { return commkit::sat_mul(a, b); }
CK_HD constexpr int64_t add(int64_t a, int64_t b) { return commkit::sat_add(a, b); }
// A layout total (saturated at UINT64_MAX by commkit::Layout) as an int64 size.
CK_HD constexpr int64_t from_u64(uint64_t v) { return commkit::sat_cast<int64_t>(v); }
}  // namespace sizing_detail

// Symmetric allocations and the buffer size are multiples of 2 MiB (cuMem granularity on H100/H200).
constexpr int64_t kBufferAlignmentBytes = int64_t(2) << 20;
// Direct mode limits (one NVLink domain).
constexpr int kMaxRanks = 256;
// Scale-out signals per rank beyond one per peer (DeepEP asks NCCL for ranks + 4).
constexpr int kScaleoutExtraSignals = 4;
constexpr int kMaxExperts = 2048;
constexpr int kMaxLocalExperts = 256;
constexpr int kMaxTopk = 32;
// Dispatch notify splits a rank's tokens into at most this many contiguous ranges, one block each
// (ranges of whole 1024-token chunks; see notify_split).
constexpr int kMaxNotifyBlocks = 32;
constexpr int kNotifyChunkTokens = 1024;
// PP and AGRS call descriptors (pp.cuh, agrs.cuh): a PP receiver's ring of its senders' descriptors
// holds kPpDescEntries entries of kPpDescWords words, kPpDescEntries / num_ranks per sender (so at most
// that many tensors in flight per peer); an AGRS gather's record is kAgrsRecordWords words.
constexpr int kPpDescEntries = 8192;
constexpr int kPpDescWords = 4;
constexpr int kAgrsRecordWords = 16;

// How notify splits T tokens: `blocks` blocks, block b owning tokens [b * span, min(T, (b+1) * span)).
// The push kernel uses the same split to find the slot base of a token's range.
struct NotifySplit {
  int blocks;
  int span;
};
CK_HD constexpr NotifySplit notify_split(int num_tokens) {
  const int chunks = num_tokens <= 0 ? 1 : (num_tokens + kNotifyChunkTokens - 1) / kNotifyChunkTokens;
  const int per_block = (chunks + kMaxNotifyBlocks - 1) / kMaxNotifyBlocks;
  return NotifySplit{(chunks + per_block - 1) / per_block, per_block * kNotifyChunkTokens};
}
// Arrival counters of the overlapped modes, u32 words [sending rank][chunk of kArriveTokens]:
//   * overlapped combine (one kernel: some blocks push rows back, the others reduce as rows land):
//     chunk = origin token / kArriveTokens; the origin's reduce waits per token chunk until the count
//     equals the number of its tokens in that chunk with an expert on the pushing rank;
//   * overlapped dispatch (the copy epilogue runs beside the push, on its own stream and blocks):
//     chunk = receive slot / kArriveTokens; the receiver's epilogue waits until the count equals the
//     slots of that chunk the sender filled (its psum tells how many).
// Senders count one per finished token (release), the operation's last block zeroes them.
constexpr int kArriveTokens = 32;
constexpr int kArriveWords = 1 << 16;  // in the workspace (256 KiB)
CK_HD constexpr int arrive_chunks(int64_t num_max_tokens_per_rank) {
  return int((num_max_tokens_per_rank + kArriveTokens - 1) / kArriveTokens);
}
// Whether the counters of R ranks x the token chunks fit; otherwise nothing overlaps.
CK_HD constexpr bool overlap_fits(int64_t num_ranks, int64_t num_max_tokens_per_rank) {
  return num_ranks * arrive_chunks(num_max_tokens_per_rank) <= kArriveWords;
}
// The order in which the overlapped kernels walk the rows of several sources (the combine push over
// its received rows, the dispatch epilogue over its receive slots): chunk-major, v = (chunk c,
// source j, slot q within the chunk), source s = rank + 1 + j (mod R), slot = c * 32 + q. A
// grid-stride walk over v then moves through every source's slots in step (the pushes fill slots in
// token order, so the receiving side follows them), each sender starts with a different peer, and a
// rank's own rows come last in each chunk. `max_rows` is the largest per-source row count; positions
// whose slot is beyond that source's count are skipped (ChunkPos::valid false).
struct ChunkPos {
  int source, slot, chunk;
};
CK_HD constexpr int64_t chunk_order_size(int num_ranks, int max_rows) {
  return int64_t((max_rows + kArriveTokens - 1) / kArriveTokens) * num_ranks * kArriveTokens;
}
CK_HD constexpr ChunkPos chunk_order_at(int64_t v, int num_ranks, int rank) {
  const int chunk = int(v / (int64_t(num_ranks) * kArriveTokens));
  const int rem = int(v - int64_t(chunk) * num_ranks * kArriveTokens);
  int source = rank + 1 + rem / kArriveTokens;
  if (source >= num_ranks) source -= num_ranks;
  return ChunkPos{source, chunk * kArriveTokens + rem % kArriveTokens, chunk};
}
// TMA needs the column-major SF token dimension padded to 16 B (4 packs of 4 B).
constexpr int kNumAlignedSFPacks = 4;
// Top-k used for sizing when the caller passes num_topk == 0 (many paths allow K <= 32).
constexpr int kSizingDefaultTopk = 32;

struct DispatchTokenLayout {
  Region x, sf, topk_idx, topk_weights, src_meta;
  uint64_t bytes;
};

CK_HD constexpr DispatchTokenLayout dispatch_token_layout(int64_t hidden, int64_t elem_size,
                                                          int64_t num_sf_packs, int64_t num_topk) {
  Layout l;
  DispatchTokenLayout t{};
  t.x = l.add(uint64_t(sizing_detail::mul(hidden, elem_size)), 16);
  t.sf = l.add(uint64_t(sizing_detail::mul(num_sf_packs, 4)), 16);
  t.topk_idx = l.add(uint64_t(sizing_detail::mul(num_topk, 4)), 16);
  t.topk_weights = l.add(uint64_t(sizing_detail::mul(num_topk, 4)), 16);
  t.src_meta = l.add(8, 16);
  t.bytes = l.total(16);
  return t;
}

struct CombineTokenLayout {
  Region x, topk_weights;
  uint64_t bytes;
};

CK_HD constexpr CombineTokenLayout combine_token_layout(int64_t hidden, int64_t elem_size, int64_t num_topk) {
  Layout l;
  CombineTokenLayout t{};
  t.x = l.add(uint64_t(sizing_detail::mul(hidden, elem_size)), 16);
  t.topk_weights = l.add(uint64_t(sizing_detail::mul(num_topk, 4)), 16);
  t.bytes = l.total(16);
  return t;
}

// A [num_ranks][num_tokens][record] area (kSizeOverflow on the host when it exceeds int64).
CK_HD constexpr int64_t buffer_layout_bytes(uint64_t token_bytes, int64_t num_ranks, int64_t num_tokens) {
  return sizing_detail::mul(sizing_detail::mul(sizing_detail::from_u64(token_bytes), num_ranks), num_tokens);
}

CK_HD constexpr int combine_num_slots(int num_ranks, int num_topk, bool allow_multiple_reduction) {
  return allow_multiple_reduction ? (num_ranks < num_topk ? num_ranks : num_topk) : num_topk;
}
// True when the combine receive slots are indexed by the sending rank (else by top-k lane).
CK_HD constexpr bool combine_slot_per_rank(int num_ranks, int num_topk, bool allow_multiple_reduction) {
  return allow_multiple_reduction && num_ranks <= num_topk;
}

// Channels of DeepEP V2's hybrid (scale-out + scale-up) kernels, kNumMaxChannelsPerSM x kNumMaxSMs. The
// size hints follow DeepEP's formulas (a buffer sized for DeepEP fits ours); our hybrid kernels use
// the hybrid_*_layout below, which the runtime checks against the buffer it got.
constexpr int64_t kHybridNumMaxChannels = int64_t(8) * 160;

// DeepEP V2's get_dispatch_buffer_size.
CK_HD constexpr int64_t dispatch_buffer_size(int64_t num_max_tokens_per_rank, int64_t hidden,
                                             int64_t num_sf_packs, int64_t num_topk, int64_t elem_size,
                                             int64_t num_scaleout_ranks, int64_t num_scaleup_ranks,
                                             bool is_scaleup_nvlink) {
  using sizing_detail::add;
  using sizing_detail::mul;
  const auto tok = dispatch_token_layout(hidden, elem_size, num_sf_packs, num_topk).bytes;
  const int64_t num_ranks = mul(num_scaleout_ranks, num_scaleup_ranks);
  if (num_scaleout_ranks == 1) {
    // Peers outside NVLink would need a staging send buffer; inside NVLink records go straight to the peer.
    const int64_t send = buffer_layout_bytes(tok, is_scaleup_nvlink ? 0 : 1, num_max_tokens_per_rank);
    const int64_t recv = buffer_layout_bytes(tok, num_ranks, num_max_tokens_per_rank);
    return add(send, recv);
  }
  // Hybrid: scale-up receive area for every scale-out peer's tokens, one scale-out send area, and a
  // scale-out receive area with room for one partly filled chunk per channel.
  return add(add(buffer_layout_bytes(tok, num_scaleup_ranks, mul(num_scaleout_ranks, num_max_tokens_per_rank)),
                 buffer_layout_bytes(tok, 1, num_max_tokens_per_rank)),
             buffer_layout_bytes(tok, num_scaleout_ranks, add(num_max_tokens_per_rank, kHybridNumMaxChannels)));
}

// DeepEP V2's get_combine_buffer_size.
CK_HD constexpr int64_t combine_buffer_size(int64_t num_max_tokens_per_rank, int64_t hidden, int64_t num_topk,
                                            int64_t num_scaleout_ranks, int64_t num_scaleup_ranks,
                                            bool is_scaleup_nvlink, bool allow_multiple_reduction) {
  using sizing_detail::add;
  using sizing_detail::mul;
  const int64_t num_ranks = mul(num_scaleout_ranks, num_scaleup_ranks);
  const auto tok = combine_token_layout(hidden, 2, num_topk).bytes;
  if (num_scaleout_ranks == 1) {
    // min(R, K) needs no more than K's range: the bindings bound K, so the int narrowing is exact.
    const int64_t slots = combine_num_slots(num_ranks < num_topk ? int(num_ranks) : int(num_topk), int(num_topk),
                                            allow_multiple_reduction);
    const int64_t send = buffer_layout_bytes(tok, is_scaleup_nvlink ? 0 : num_ranks,
                                             mul(num_max_tokens_per_rank, allow_multiple_reduction ? 1 : num_topk));
    const int64_t recv = buffer_layout_bytes(tok, slots, num_max_tokens_per_rank);
    return add(send, recv);
  }
  // Hybrid: scale-up receive slots per token of every scale-out peer, scale-out receive slots, and the
  // scale-out send area (one row per token with multiple reduction, else one per top-k lane).
  const int64_t up_slots = combine_num_slots(int(num_scaleup_ranks), int(num_topk), allow_multiple_reduction);
  const int64_t out_slots = combine_num_slots(int(num_scaleout_ranks), int(num_topk), allow_multiple_reduction);
  return add(add(buffer_layout_bytes(tok, up_slots, mul(num_scaleout_ranks, num_max_tokens_per_rank)),
                 buffer_layout_bytes(tok, out_slots, num_max_tokens_per_rank)),
             buffer_layout_bytes(tok, allow_multiple_reduction ? 1 : num_topk,
                                 mul(num_scaleout_ranks, add(num_max_tokens_per_rank, kHybridNumMaxChannels))));
}

// Hybrid mode (S > 1 logical scale-out domains of U ranks; rank r is in domain r / U on rail r % U).
// Rows cross domains only between rail peers, through the scale-out transport (scaleout.cuh); the
// kernels keep direct mode's receive areas, so the epilogue and the reduce are direct mode's own.
// Dispatch, in the buffer:
//   recv     [R][M][record]              direct mode's receive area (the epilogue reads it)
//   send     [M][record | route]         this rank's tokens bound for other domains, staged in the
//                                        window (a scale-out put reads its source from there)
//   relay    [S-1][M][record | route]    tokens from the rail peer of each other domain (domain d at
//                                        index d - (d > own domain)), forwarded from here to the ranks
//                                        of this domain
// route = [ K int32: the slot at the owner of each top-k lane's expert | pad to 8 | u64 stamp ], so
// the forwarder writes each record where direct mode's push would have; the stamp (hybrid_stamp, in
// kernels/device_common.cuh: the epoch and the entry's position) tells this dispatch's records from
// anything else in those bytes -- the forwarder scans the M entries of each source domain.
// Combine, in the buffer:
//   recv     [M][slots][record]          direct mode's receive area (the reduce reads it)
//   stage    [S-1][M][stage_slots][record]  partials of this domain for the tokens of the rail peer in
//                                        each other domain (indexed as relay), by the slot they take
//                                        in its recv area; with one slot per rank (combine_slot_per_rank)
//                                        only this domain's U slots are staged (slot - domain * U),
//                                        else all of them
//   tags     [S-1][M][stage_slots] u64   the stamp of the combine that filled each staged slot (the
//                                        forwarder sends exactly those)
// Both fit the buffer DeepEP's formulas size (calculate_buffer_size) for the usual shapes; the runtime
// checks and names the bytes it needs otherwise.
// The stamps matter because every region aliases others' (dispatch, combine, PP and AGRS all use the
// buffer): a 32-bit epoch alone could be matched by a row's bytes.
CK_HD constexpr int64_t hybrid_route_stamp_offset(int64_t num_topk) {
  return int64_t(align_up(uint64_t(sizing_detail::mul(num_topk, 4)), 8));
}
CK_HD constexpr int64_t hybrid_route_bytes(int64_t num_topk) {
  return int64_t(align_up(uint64_t(sizing_detail::add(hybrid_route_stamp_offset(num_topk), 8)), 16));
}
struct HybridDispatchLayout {
  int64_t staged_bytes;  // record + route
  int64_t send, relay;   // offsets in the buffer (recv starts at 0)
  int64_t bytes;         // total (kSizeOverflow on the host when it exceeds int64)
};
CK_HD constexpr HybridDispatchLayout hybrid_dispatch_layout(uint64_t record_bytes, int64_t num_topk, int64_t num_ranks,
                                                            int64_t num_scaleout_ranks,
                                                            int64_t num_max_tokens_per_rank) {
  using sizing_detail::add;
  using sizing_detail::mul;
  HybridDispatchLayout h{};
  h.staged_bytes = add(sizing_detail::from_u64(record_bytes), hybrid_route_bytes(num_topk));
  h.send = sizing_detail::from_u64(align_up(uint64_t(buffer_layout_bytes(record_bytes, num_ranks,
                                                                         num_max_tokens_per_rank)), 128));
  h.relay = add(h.send, sizing_detail::from_u64(align_up(uint64_t(mul(h.staged_bytes, num_max_tokens_per_rank)), 128)));
  h.bytes = add(h.relay, mul(mul(h.staged_bytes, num_scaleout_ranks - 1), num_max_tokens_per_rank));
  return h;
}
struct HybridCombineLayout {
  int64_t stage, tags;  // offsets in the buffer (recv starts at 0)
  int64_t bytes;
};
CK_HD constexpr int64_t hybrid_stage_slots(int64_t num_ranks, int64_t num_scaleup_ranks, int64_t num_topk,
                                           bool allow_multiple_reduction) {
  return combine_slot_per_rank(int(num_ranks), int(num_topk), allow_multiple_reduction)
             ? num_scaleup_ranks
             : combine_num_slots(int(num_ranks), int(num_topk), allow_multiple_reduction);
}
CK_HD constexpr HybridCombineLayout hybrid_combine_layout(uint64_t record_bytes, int64_t num_slots,
                                                          int64_t num_stage_slots, int64_t num_scaleout_ranks,
                                                          int64_t num_max_tokens_per_rank) {
  using sizing_detail::add;
  using sizing_detail::mul;
  HybridCombineLayout h{};
  const int64_t stage_entries = mul(mul(num_scaleout_ranks - 1, num_max_tokens_per_rank), num_stage_slots);
  h.stage = sizing_detail::from_u64(align_up(uint64_t(buffer_layout_bytes(record_bytes, num_slots,
                                                                          num_max_tokens_per_rank)), 128));
  h.tags = add(h.stage, sizing_detail::from_u64(align_up(uint64_t(mul(sizing_detail::from_u64(record_bytes),
                                                                      stage_entries)), 128)));
  h.bytes = add(h.tags, mul(stage_entries, 8));
  return h;
}

// Hybrid notify's count relay (WorkspaceLayout::count_relay of the forwarder). A rank sends the count
// words for the U ranks of each other domain to its rail peer there, which passes them on to its
// domain (the only ranks a rail peer reaches over the scale-out transport): block i (the source's
// domain among the forwarder's S - 1 others, as the relay area) = [U rank words | U * L expert words,
// domain-local expert order], (epoch<<32)|count each, self-validating like direct mode's words.
// (S - 1) * U * (1 + L) <= R + E words, which the region holds for every R <= kMaxRanks, E <= kMaxExperts.
CK_HD constexpr int64_t hybrid_count_block_words(int64_t num_scaleup_ranks, int64_t num_local_experts) {
  return num_scaleup_ranks * (1 + num_local_experts);
}
static_assert(hybrid_count_block_words(8, kMaxExperts / kMaxRanks) * (kMaxRanks / 8 - 1) <= kMaxRanks + kMaxExperts &&
                  hybrid_count_block_words(1, kMaxExperts / kMaxRanks) * (kMaxRanks - 1) <= kMaxRanks + kMaxExperts,
              "the count relay holds every other domain's block (the largest shapes: 32 x 8 and 256 x 1 ranks)");

// Approximate SF pack count used for sizing: one 4 B pack per 32 elements is the worst case
// (UE8M0 per 32 elements packed 4 per int, or FP32 per 128 elements, both need fewer).
CK_HD constexpr int64_t sizing_num_sf_packs(int64_t hidden, bool use_fp8_dispatch) {
  return use_fp8_dispatch ? int64_t(ceil_div(uint64_t(hidden), 32)) : 0;
}

// DeepEP V2's calculate_buffer_size, with the domain sizes given explicitly. Returns -1 when the
// arguments are invalid (the binding turns that into a ValueError with the reason), kSizeOverflow
// when the size exceeds int64 (host).
CK_HD constexpr int64_t calculate_buffer_size(int64_t num_max_tokens_per_rank, int64_t hidden, int64_t num_topk,
                                              bool use_fp8_dispatch, int64_t num_scaleout_ranks,
                                              int64_t num_scaleup_ranks, bool is_scaleup_nvlink,
                                              bool allow_multiple_reduction) {
  if (num_max_tokens_per_rank <= 0 || hidden <= 0 || num_topk < 0 || num_topk > kMaxTopk) return -1;
  if (num_scaleout_ranks <= 0 || num_scaleup_ranks <= 0) return -1;
  if (int64_t(ceil_div(uint64_t(hidden), 32)) * 4 > hidden) return -1;
  const int64_t k = num_topk == 0 ? kSizingDefaultTopk : num_topk;
  const int64_t elem = use_fp8_dispatch ? 1 : 2;
  const int64_t d = dispatch_buffer_size(num_max_tokens_per_rank, hidden, sizing_num_sf_packs(hidden, use_fp8_dispatch),
                                         k, elem, num_scaleout_ranks, num_scaleup_ranks, is_scaleup_nvlink);
  const int64_t c = combine_buffer_size(num_max_tokens_per_rank, hidden, k, num_scaleout_ranks, num_scaleup_ranks,
                                        is_scaleup_nvlink, allow_multiple_reduction);
  return sizing_detail::from_u64(align_up(uint64_t(d > c ? d : c), uint64_t(kBufferAlignmentBytes)));
}

// DeepEP V2's topology rule for sizing: with hybrid mode allowed and ranks beyond one NVLink domain,
// scale-out = num_ranks / num_nvl_ranks domains of num_nvl_ranks (on NVLink); otherwise one scale-up
// domain of every rank, on NVLink only when it is the whole NVLink domain. num_ranks must be a
// multiple of num_nvl_ranks (the binding refuses others: rounding the scale-out down would undersize).
struct SizingDomain {
  int64_t num_scaleout_ranks, num_scaleup_ranks;
  bool is_scaleup_nvlink;
};
CK_HD constexpr SizingDomain sizing_domain(int64_t num_ranks, int64_t num_nvl_ranks, bool allow_hybrid_mode) {
  if (allow_hybrid_mode && num_nvl_ranks < num_ranks) return SizingDomain{num_ranks / num_nvl_ranks, num_nvl_ranks, true};
  return SizingDomain{1, num_ranks, num_ranks == num_nvl_ranks};
}

// Per-rank count words of dispatch notify, to the peers (tag = epoch) and to the host (tag = the
// call's host tag): (tag << 32) | refused bit | geometry bit | token count. The refused bit says the
// rank passed expert ids outside [-1, E) to a CPU-synced dispatch, which every rank then refuses; the
// geometry bit (host words only) that some rank's dispatch geometry differs from this rank's
// (kGeometryWords), which every rank refuses alike.
constexpr uint64_t kRefusedBit = 1ull << 31;
constexpr uint64_t kGeometryBit = 1ull << 30;
constexpr uint64_t kCountMask = kGeometryBit - 1ull;
// Dispatch geometry: every rank sends each peer these words of its call, (epoch << 32) | value, and
// compares the peers' with its own before any record is read or written (layout: geometry.hpp).
constexpr int kGeometryWords = 4;
// Protocol errors notify and the epilogue report through the same words (HostWorkspaceLayout::geometry):
// a peer's count above num_max_tokens_per_rank (peer's count, M), a peer's record naming a source token
// outside that peer's range (the record's source id, the peer), an expanded row past its expert's
// count (local expert, its count), a record a rail peer staged for this rank to relay (hybrid mode)
// whose route names an expert id or a slot out of range (the value, its bound: num_experts or M).
// Nothing is written where such a word points.
constexpr int kProtocolCount = 4, kProtocolSource = 5, kProtocolPlacement = 6, kProtocolRoute = 7;
// Low-latency mode's reports through the same words: a peer's geometry word w differs (what =
// kProtocolLlGeometry + w; the peer's word, this rank's), a peer's count above M (count, M), a message
// or handle row naming a token, lane or rank out of range (the value, its bound), a signal from a later
// call than this one (its seq, this call's).
constexpr int kProtocolLlGeometry = 8, kProtocolLlCount = 10, kProtocolLlRecord = 11, kProtocolLlSeq = 12;
// The combine's reduce: a slot of this rank's own row holds an index outside x (the index, x's rows).
constexpr int kProtocolOwnRow = 13;
// Notify: a peer's row count for one of this rank's experts above K x M (the count, K x M).
constexpr int kProtocolExpertCount = 14;
// grid_counter words kGridCounterEpochSlot and the next hold the u64 epoch of the last completed
// operation (launch.cu; 8-byte aligned: the region is 128-byte aligned and the slot even).
constexpr int kGridCounterEpochSlot = 8;

// Workspace: signal words are u64 "(epoch tag << 32) | payload" (tag = epoch mod 2^32, compared in
// serial-number order) or plain u64 epochs; see launch.cu.
struct WorkspaceLayout {
  Region barrier_signal;   // u64[kMaxRanks]     epoch a peer has entered (written by the peer)
  Region rank_count;       // u64[kMaxRanks]     (epoch<<32)|tokens the peer sends me
  Region expert_count;     // u64[kMaxExperts]   [src][local expert] (epoch<<32)|tokens for that expert
  Region dispatch_done;    // u64[kMaxRanks]     epoch whose dispatch records from the peer are complete
  Region combine_done;     // u64[kMaxRanks]     epoch whose combine records from the peer are complete
  Region grid_counter;     // u32[16]            local: blocks finished (reset by the last block);
                           //                    [kGridCounterEpochSlot, +1]: the u64 epoch
  Region expert_cursor;    // i32[kMaxLocalExperts] local: expand-mode row cursors (reset by the last block)
  Region notify_expert;    // u32[kMaxExperts]   local: notify's per-expert counts summed over its blocks
                           //                    (reset by its last block)
  Region notify_block_cnt; // u32[kMaxNotifyBlocks][kMaxRanks] local: tokens of each notify block per rank
  Region notify_block_base;// u32[kMaxNotifyBlocks][kMaxRanks] local: exclusive prefix of the above (the
                           //                    push adds it to notify's block-relative slots)
  Region notify_bad;       // u64[2]             local: ids outside [-1, E) notify's blocks found, one of
                           //                    them (reset by the last block)
  Region arrive;           // u32[kArriveWords] [src rank][chunk]: tokens a peer finished pushing in an
                           //                    overlapped dispatch or combine (counted up by the
                           //                    peers, reset by the operation's last block)
  Region count_matrix;     // u64[kMaxRanks][kMaxRanks] zero-copy dispatch: [src][dst] (epoch<<32)|tokens src
                           //                    sends dst, from every lower-ranked peer (written by the peer)
  // PP send/recv (pp.cuh): monotonic per-pair tensor counts; never reset (pp_set_config checks that
  // nothing is in flight).
  Region pp_sent;          // u64[kMaxRanks]     tensors the peer delivered into my slots (written by the peer)
  Region pp_freed;         // u64[kMaxRanks]     tensors of mine the peer copied out (written by the peer)
  Region pp_seq;           // u64[2][kMaxRanks]  local: [0] tensors I sent to each peer, [1] received from each
  Region pp_grid;          // u32[2][kMaxRanks]  local: finished blocks of the send / recv kernel per peer
  Region pp_desc;          // u64[kPpDescEntries][kPpDescWords] [src][k % depth] the descriptor of the peer's
                           //                    k-th tensor to me (written by the peer; pp.cuh)
  Region pp_refusal;       // u64[kMaxRanks][4]  the last of my tensors the peer refused (written by the peer)
  // AGRS (agrs.cuh): monotonic counts.
  Region agrs_arrived;     // u64[kMaxRanks]     (gather << 32) | record digest: all-gathers whose data the
                           //                    peer copied into my region
  Region agrs_ended;       // u64[kMaxRanks]     sessions the peer ended (its reads of my region are done)
  Region agrs_local;       // u64[3]             local: [0] all-gathers issued, [1] sessions ended, [2] the
                           //                    session a gather of which was refused
  Region agrs_record;      // u64[2][kAgrsRecordWords] my last two gathers' records (read by the peers)
  // Scale-out transport (scaleout.cuh), NVLink-emulated backend: monotonic signals raised by the peers.
  Region scaleout_signal;  // u64[kMaxRanks + kScaleoutExtraSignals]
  Region scaleout_seen;    // u64[kMaxRanks]     local: the count of each scale-out signal this rank's
                           //                    hybrid kernels have consumed (each hybrid operation
                           //                    raises every rail peer's signal by one)
  Region count_relay;      // u64[kMaxRanks + kMaxExperts] hybrid notify: the counts each rail peer sends
                           //                    this rank's domain, (epoch<<32)|tokens, which this rank
                           //                    passes on (hybrid_count_relay; written by the rail peers)
  Region geometry;         // u64[kMaxRanks][kGeometryWords] (epoch<<32)|word w of the peer's dispatch
                           //                    geometry (written by the peer; in hybrid mode by the
                           //                    rail peer that relays it when the peer is neither in
                           //                    this domain nor a rail peer)
  // Low-latency mode (ll_sizing.hpp): kind 0 = dispatch, 1 = combine; half = the call's buffer_idx;
  // seq = the calls of that kind and half so far, counted on the device (CUDA-graph replays count).
  Region ll_count;         // u64[2][kMaxExperts] [half][local expert * R + src] (seq<<32)|tokens src sends it
  Region ll_done;          // u64[2][kMaxRanks]   [half][src] (seq<<32)|1: src's combine rows for me landed
  Region ll_geo;           // u64[2][2][kMaxRanks][2] [kind][half][src][w] (seq<<32)|ll_geometry_word w of src
  Region ll_seq;           // u64[2][2][2]        local: [kind][half][send, receive] phases run
  Region ll_grid;          // u32[2][2][2]        local: finished blocks of a phase (reset by its last block)
  Region ll_mask;          // u32[kMaxRanks]      local: shrink mode's rank mask (1 = masked)
  uint64_t bytes;          // total, 2 MiB aligned
};

CK_HD constexpr WorkspaceLayout workspace_layout() {
  Layout l;
  WorkspaceLayout w{};
  w.barrier_signal = l.add(8ull * kMaxRanks, 128);
  w.rank_count = l.add(8ull * kMaxRanks, 128);
  w.expert_count = l.add(8ull * kMaxExperts, 128);
  w.dispatch_done = l.add(8ull * kMaxRanks, 128);
  w.combine_done = l.add(8ull * kMaxRanks, 128);
  w.grid_counter = l.add(4ull * 16, 128);
  w.expert_cursor = l.add(4ull * kMaxLocalExperts, 128);
  w.notify_expert = l.add(4ull * kMaxExperts, 128);
  w.notify_block_cnt = l.add(4ull * kMaxNotifyBlocks * kMaxRanks, 128);
  w.notify_block_base = l.add(4ull * kMaxNotifyBlocks * kMaxRanks, 128);
  w.notify_bad = l.add(16, 128);
  w.arrive = l.add(4ull * kArriveWords, 128);
  w.count_matrix = l.add(8ull * kMaxRanks * kMaxRanks, 128);
  w.pp_sent = l.add(8ull * kMaxRanks, 128);
  w.pp_freed = l.add(8ull * kMaxRanks, 128);
  w.pp_seq = l.add(16ull * kMaxRanks, 128);
  w.pp_grid = l.add(8ull * kMaxRanks, 128);
  w.pp_desc = l.add(8ull * kPpDescEntries * kPpDescWords, 128);
  w.pp_refusal = l.add(32ull * kMaxRanks, 128);
  w.agrs_arrived = l.add(8ull * kMaxRanks, 128);
  w.agrs_ended = l.add(8ull * kMaxRanks, 128);
  w.agrs_local = l.add(24, 128);
  w.agrs_record = l.add(16ull * kAgrsRecordWords, 128);
  w.scaleout_signal = l.add(8ull * (kMaxRanks + kScaleoutExtraSignals), 128);
  w.scaleout_seen = l.add(8ull * kMaxRanks, 128);
  w.count_relay = l.add(8ull * (kMaxRanks + kMaxExperts), 128);
  w.geometry = l.add(8ull * kMaxRanks * kGeometryWords, 128);
  w.ll_count = l.add(16ull * kMaxExperts, 128);
  w.ll_done = l.add(16ull * kMaxRanks, 128);
  w.ll_geo = l.add(64ull * kMaxRanks, 128);
  w.ll_seq = l.add(64, 128);
  w.ll_grid = l.add(32, 128);
  w.ll_mask = l.add(4ull * kMaxRanks, 128);
  w.bytes = l.total(uint64_t(kBufferAlignmentBytes));
  return w;
}

// Host-mapped workspace (cudaHostAllocMapped): the notify step publishes counts here for the CPU sync,
// and device deadlines leave their TimeoutRecord here.
struct HostWorkspaceLayout {
  Region rank_count;    // u64[kMaxRanks]        (epoch<<32)|tokens received from each rank
  Region expert_count;  // u64[kMaxLocalExperts] (epoch<<32)|aligned tokens per local expert
  Region timeout;       // commkit::TimeoutRecord (64 B)
  Region ids;           // u64[4]: [0] (tag<<32)|ids outside [-1, E) that made notify refuse a
                        // CPU-synced dispatch, [1] one such id; [2] running total of such ids notify
                        // masked (no CPU sync), [3] the last one (see launch.hpp)
  Region geometry;      // u64[4]: [0] running total of refusals reported, [1] (peer << 8) | what of the
                        // last one, [2] the peer's value, [3] this rank's (written before [0] is
                        // raised). What: a geometry word 0..3 (kGeometryWords), or a protocol error
                        // (kProtocol*: a corrupted peer word). A signed value (a token, lane, rank or
                        // row index, a low-latency count) may be its 32 bits: the host reads it as int32
  uint64_t bytes;
};

CK_HD constexpr HostWorkspaceLayout host_workspace_layout() {
  Layout l;
  HostWorkspaceLayout h{};
  h.rank_count = l.add(8ull * kMaxRanks, 64);
  h.expert_count = l.add(8ull * kMaxLocalExperts, 64);
  h.timeout = l.add(64, 64);
  h.ids = l.add(32, 64);
  h.geometry = l.add(32, 64);
  h.bytes = l.total(4096);
  return h;
}

// Worst-case output rows when the CPU does not wait for the counts (as DeepEP V2 sizes them).
CK_HD constexpr int64_t worst_case_num_recv_tokens(int64_t num_ranks, int64_t num_max_tokens_per_rank) {
  return num_ranks * num_max_tokens_per_rank;
}
// Expand mode: one row per top-k lane whose expert is local, so at most num_topk rows per received
// token (a token that names one expert on several lanes gets a row per lane; nothing refuses such
// repeats, and the CPU-synced path handles them exactly), plus each expert's alignment padding.
// Saturates at kSizeOverflow on the host (the alignment comes from the user).
CK_HD constexpr int64_t worst_case_num_expanded_tokens(int64_t num_ranks, int64_t num_max_tokens_per_rank,
                                                       int64_t num_topk, int64_t num_local_experts,
                                                       int64_t expert_alignment) {
  using sizing_detail::add;
  using sizing_detail::mul;
  const int64_t n = add(mul(mul(num_ranks, num_max_tokens_per_rank), num_topk),
                        mul(expert_alignment - 1, num_local_experts));
  if (n >= kSizeOverflow - expert_alignment) return kSizeOverflow;
  return int64_t(align_up(uint64_t(n), uint64_t(expert_alignment)));
}

// Zero-copy dispatch (ElasticBuffer.dispatch(zero_copy=True), non-expanded layout). The hidden bytes
// skip the records: each sender writes a row straight to its final place in the receiver's dense area
// [R * num_max_tokens_per_rank][hidden bytes] (rows in receive order: by source rank, then source
// token), so recv_x is a view of that area. The records keep the scales, top-k and source metadata
// (the record layout with hidden = 0) at the start of the buffer, where the combine area lies too. The
// dense area is the end of the buffer, past both, so a combine leaves the views intact; the next
// dispatch overwrites them. x_offset < 0: the buffer is too small (need_bytes, 2 MiB aligned, fits).
struct ZeroCopyLayout {
  int64_t x_offset;    // of the dense area in the buffer (128 B aligned)
  int64_t need_bytes;  // the smallest buffer (multiple of kBufferAlignmentBytes) with room for it
};
CK_HD constexpr ZeroCopyLayout zero_copy_layout(int64_t buffer_bytes, int64_t num_ranks, int64_t num_max_tokens_per_rank,
                                                int64_t hidden, int64_t elem_size, int64_t num_sf_packs,
                                                int64_t num_topk, bool allow_multiple_reduction) {
  using sizing_detail::add;
  using sizing_detail::mul;
  const int64_t records = buffer_layout_bytes(dispatch_token_layout(0, 1, num_sf_packs, num_topk).bytes, num_ranks,
                                              num_max_tokens_per_rank);
  const int64_t combine = combine_buffer_size(num_max_tokens_per_rank, hidden, num_topk, 1, num_ranks, true,
                                              allow_multiple_reduction);
  const int64_t front = sizing_detail::from_u64(align_up(uint64_t(records > combine ? records : combine), 128));
  const int64_t dense = sizing_detail::from_u64(
      align_up(uint64_t(mul(mul(num_ranks, num_max_tokens_per_rank), mul(hidden, elem_size))), 128));
  const int64_t need = add(front, dense);
  ZeroCopyLayout z{-1, need >= kSizeOverflow - kBufferAlignmentBytes
                           ? kSizeOverflow
                           : int64_t(align_up(uint64_t(need), uint64_t(kBufferAlignmentBytes)))};
  if (need <= buffer_bytes) z.x_offset = buffer_bytes - dense;
  return z;
}

// PP send/recv: the receive slots [source rank][num_max_inflight_tensors][num_max_tensor_bytes] at the
// start of the buffer (one row of slots per rank, its own unused: the rank index is the row index).
CK_HD constexpr int64_t pp_buffer_bytes(int64_t num_ranks, int64_t num_max_tensor_bytes, int64_t num_max_inflight) {
  return sizing_detail::mul(sizing_detail::mul(num_ranks, num_max_inflight),
                            int64_t(align_up(uint64_t(num_max_tensor_bytes), 32)));
}

// Compile-time checks of the invariants the kernels rely on.
static_assert(hybrid_route_bytes(8) == 48 && hybrid_route_bytes(1) == 16 && hybrid_route_stamp_offset(3) == 16,
              "route: K slots, then an 8 B aligned stamp, 16 B aligned");
static_assert(hybrid_dispatch_layout(7200, 8, 4, 2, 4096).bytes ==
                  int64_t(7200) * 4 * 4096 + int64_t(7248) * 4096 * 2, "hybrid dispatch: recv, send, relay");
static_assert(hybrid_stage_slots(8, 4, 8, true) == 4 && hybrid_stage_slots(16, 4, 8, true) == 8 &&
                  hybrid_stage_slots(8, 4, 8, false) == 8, "stage: the domain's U slots, else every slot");
// DeepSeek-V3 shapes (hidden 7168, top-8, 4096 tokens) in DeepEP's buffer size, at 2x4, 2x8 and 8x8.
static_assert(hybrid_combine_layout(combine_token_layout(7168, 2, 8).bytes, 8, 4, 2, 4096).bytes <=
                  calculate_buffer_size(4096, 7168, 8, false, 2, 4, true, true) &&
              hybrid_combine_layout(combine_token_layout(7168, 2, 8).bytes, 8, 8, 2, 4096).bytes <=
                  calculate_buffer_size(4096, 7168, 8, false, 2, 8, true, true) &&
              hybrid_combine_layout(combine_token_layout(7168, 2, 8).bytes, 8, 8, 8, 4096).bytes <=
                  calculate_buffer_size(4096, 7168, 8, false, 8, 8, true, true) &&
              hybrid_dispatch_layout(dispatch_token_layout(7168, 2, 0, 8).bytes, 8, 64, 8, 4096).bytes <=
                  calculate_buffer_size(4096, 7168, 8, false, 8, 8, true, true),
              "hybrid layouts fit DeepEP's buffer size");
static_assert(notify_split(0).blocks == 1 && notify_split(4096).blocks == 4 && notify_split(4096).span == 1024, "");
static_assert(notify_split(4097).blocks == 5 && notify_split(32768).blocks == 32, "one block per chunk up to 32");
static_assert(notify_split(32769).blocks == 17 && notify_split(32769).span == 2048, "then two chunks per block");
static_assert(notify_split(1 << 24).blocks <= kMaxNotifyBlocks && notify_split(1 << 24).span * 32 >= (1 << 24), "");
static_assert(dispatch_token_layout(7168, 2, 0, 8).bytes % 16 == 0, "records stay 16 B aligned");
static_assert(dispatch_token_layout(7168, 1, 56, 8).sf.offset == 7168, "SF follows the hidden bytes");
static_assert(workspace_layout().bytes == uint64_t(kBufferAlignmentBytes), "workspace fits in 2 MiB");
static_assert(chunk_order_at(0, 2, 0).source == 1 && chunk_order_at(32, 2, 0).source == 0 &&
                  chunk_order_at(64, 2, 0).slot == 32 && chunk_order_at(64, 2, 0).chunk == 1,
              "chunk order: peers first, own rows last in each chunk");
static_assert(overlap_fits(2, 4096) && overlap_fits(256, 8192) && !overlap_fits(256, 8193),
              "arrival counters: 256 ranks x 8192 tokens fit");
static_assert(calculate_buffer_size(4096, 7168, 8, true, 1, 2, true, true) % kBufferAlignmentBytes == 0, "");
static_assert(zero_copy_layout(int64_t(1) << 30, 2, 4096, 7168, 2, 0, 8, true).x_offset ==
                  (int64_t(1) << 30) - int64_t(2) * 4096 * 7168 * 2,
              "zero-copy: the dense area ends the buffer");

}  // namespace elastic_ep
