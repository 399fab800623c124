// elastic_ep/csrc/kernels/launch.hpp -- parameter blocks and launchers of the kernels (direct and hybrid
// mode). Torch-free and CUDA-free: pointers are void*/int*, streams are cudaStream_t passed as void*.
// The parameter blocks are bound to Python in every build, every member by name (bindings/params.cpp):
// the native runtime keeps one block per plan (its scalar fields, set once) and sets the pointer fields
// of the call's tensors before each launch. The kernels take the blocks by value: a member added here
// changes their parameter layout.
#pragma once

#include <cstdint>

namespace elastic_ep {

// Where the kernels find the window and the per-rank state (built once by Runtime).
struct CommView {
  void* const* peer_bases;  // device array [num_ranks]: LSA address of each rank's window base; in
                            // hybrid mode null outside this rank's scale-up domain (dispatch, combine and
                            // barrier reach other domains only through the scale-out transport)
  void* window_base;        // this rank's window base (== peer_bases[rank])
  uint64_t buffer_offset;   // offset of the buffer inside the window (after the workspace)
  void* host_workspace;     // device alias of the host-mapped workspace (HostWorkspaceLayout)
  int rank;
  int num_ranks;
  uint64_t timeout_ns;      // device deadline without progress; 0 disables
  // Hybrid mode: U ranks per logical scale-out domain, 0 < U < R (0: direct mode). The buffer's
  // domains, fixed when the runtime is created (RuntimeOptions::num_scaleup_ranks).
  int num_scaleup_ranks;
  // The scale-out transport (scaleout.cuh) of hybrid mode, one of:
  void* const* scaleout_peer_bases;  // NVLink emulation: device array [num_ranks], every rank's window
  void* gin_devcomm;                 // GIN: host copy of the ncclDevComm with GIN contexts (by value
  void* gin_window;                  // into the kernels), and the ncclWindow_t the offsets refer to
};

// Operation codes recorded in the TimeoutRecord.
enum OpCode : uint32_t {
  kOpBarrier = 1,
  kOpDispatchNotify = 2,
  kOpDispatchEpilogue = 3,
  kOpCombine = 4,
  kOpCombineReduce = 5,
  kOpPpSend = 6,
  kOpPpRecv = 7,
  kOpAllGather = 8,
  kOpAgrsSession = 9,
  kOpScaleoutProbe = 10,
  // Hybrid mode (kernels/hybrid.cuh): the forwarder's wait for a rail peer's tokens (dispatch), the
  // forwarder's wait for its domain's partials (combine), the origin's wait for a rail peer's
  // forwarded partials (combine).
  kOpDispatchScaleout = 11,
  kOpCombineScaleup = 12,
  kOpCombineScaleout = 13,
  // Not a device wait: the host's peer watch (commkit::PeerWatch) found a peer's process gone.
  kOpPeerDied = 14,
  // Low-latency mode (ll_dispatch.cuh, ll_combine.cuh): the receive phase's wait for a peer's counts /
  // combined rows.
  kOpLowLatencyDispatch = 15,
  kOpLowLatencyCombine = 16,
};
// Hybrid mode: a wait for the words or records of a rank in another domain and on another rail, which a
// rank of this domain passes on (the relayer), records the relayer as the peer (the rank that did not
// deliver) and the other rank + 1 in the code's bits from kOpOriginShift up; op_name reads the low bits.
constexpr int kOpOriginShift = 16;
const char* op_name(uint32_t op);

struct DispatchParams {
  // Inputs
  const void* x;               // [T, hidden] bf16 or fp8 (hidden_bytes per row)
  const void* sf;              // [T, num_sf_packs] 4 B packs, strides below (may be null)
  int64_t sf_token_stride, sf_hidden_stride;
  const int64_t* topk_idx;     // [T, K] global expert ids, -1 masked
  const float* topk_weights;   // [T, K] (may be null)
  // Outputs of the notify step (non-cached) / inputs (cached)
  int64_t* copied_topk_idx;    // [T, K] (may be null)
  int* cumulative_stats;       // [L] += unaligned counts (may be null)
  int* psum_rank;              // [R] inclusive prefix of tokens received per source rank
  int* psum_expert;            // [L + 1] exclusive prefix of aligned per-expert counts
  int* unaligned_expert;       // [L] tokens received per local expert
  int* slot_idx;               // [T, K] slot in the destination rank's receive area, -1 masked
  int num_tokens, num_max_tokens_per_rank;
  int hidden_bytes, num_sf_packs;
  int num_experts, num_topk, expert_alignment;
  int cached;                  // reuse slot_idx / counts of an earlier dispatch
  uint32_t host_tag;           // tag of the host-mapped counts for the CPU sync
  int num_sms;
  // Notify builds its per-rank token masks with shared atomics instead of warp reductions (what it
  // does above 32 ranks). Set from ELASTIC_EP_TEST_NOTIFY_ATOMICS=1 (read by Python when the buffer
  // is created) so tests on 1-2 GPUs cover that path too.
  int notify_atomic_masks;
  // CPU-sync mode: expert ids outside [-1, E) refuse the whole dispatch on every rank (flagged count
  // words, nothing pushed, the host raises; see launch.cu). Otherwise they are masked and reported
  // through a running total (HostWorkspaceLayout::ids[2..3]).
  int refuse_bad_ids;
  // Overlapped dispatch: the push counts every token it finished into the receiver's arrival
  // counters (sizing.hpp) and signals no dispatch_done; the epilogue (overlap = 1 there too) runs on
  // the runtime's second stream beside it. num_sms is then the push's share of the grid.
  int overlap;
  // The push runs beside notify (a programmatic dependent launch; see dispatch_impl) instead of
  // after it (ElasticBuffer.dispatch_pdl; the runtime clears it with `overlap` and with a non-cached
  // zero_copy, whose push needs notify's direct_base).
  int concurrent_notify;
  // Zero-copy dispatch (non-expanded; sizing.hpp zero_copy_layout): the push writes each row's hidden
  // bytes, its own rows included, to buffer offset zero_copy_x_offset + (direct_base[dest] + slot) *
  // hidden_bytes at the destination; the records carry the rest (record layout with hidden = 0).
  // Non-cached, notify first exchanges the count matrix rows and writes direct_base.
  int zero_copy;
  int64_t zero_copy_x_offset;
  int* direct_base;            // [R] this rank's first receive row at each destination rank (that rank's
                               // psum_rank[this rank - 1]); written by notify, kept in the handle
  // Hybrid mode (CommView::num_scaleup_ranks; sizing.hpp, kernels/hybrid.cuh): the push sends its own
  // domain's rows directly and stages one record per token and other domain for that domain's rail
  // peer (no overlap, zero-copy or concurrent notify here).
  int* forward_dense;          // [S * M, 2] int32 (may be null: cached): the push writes row
                               // [own domain][t] = (rank * M + t, mask of the own domain's ranks t goes to)
  // Tests only (ELASTIC_EP_TEST_DROP_SCALEOUT_SIGNALS=1): the push raises no scale-out signal, so the
  // rail peers' forwarders time out naming the scale-out stage.
  int test_drop_scaleout_signals;
  // Tests only (ELASTIC_EP_TEST_CORRUPT): 1 = the count word notify sends rank (rank + 1) % R claims
  // num_max_tokens_per_rank + 1 tokens (hybrid mode: relayed when that rank is in another domain);
  // 2 = the records the push writes to peers (hybrid mode: and stages for the rail peers to relay)
  // name a source token outside every rank's range; 3 = hybrid mode: the staged records route every
  // lane to a slot past num_max_tokens_per_rank; 5 = the count word of that rank's first local expert
  // claims num_topk x num_max_tokens_per_rank + 1 rows. The receivers (the forwarders for 3) must
  // report a protocol error and write nothing past.
  int test_corrupt;
};

struct EpilogueParams {
  // The dispatch's inputs: rows a rank sends to itself are copied from here (the push sends only
  // their metadata), so they must stay alive and unchanged until the epilogue ran.
  const void* x;               // [T, hidden] bf16 or fp8
  const void* sf;              // [T, num_sf_packs] 4 B packs, strides below (may be null)
  int64_t sf_token_stride, sf_hidden_stride;
  void* recv_x;                // [N_alloc, hidden]
  void* recv_sf;               // [N_alloc, num_sf_packs] strided (may be null)
  int64_t recv_sf_token_stride, recv_sf_hidden_stride;
  int64_t* recv_topk_idx;      // [N_alloc, K] local expert ids or -1 (null in expand mode)
  float* recv_topk_weights;    // [N_alloc, K] or [N_exp_alloc] in expand mode (may be null)
  int* recv_src_metadata;      // [N_alloc, K + 2]
  const int* psum_rank;        // [R]
  int* psum_expert;            // [L + 1] exclusive aligned prefix (expand: rewritten to start + count)
  const int* unaligned_expert; // [L]
  int num_max_tokens_per_rank;
  int hidden_bytes, num_sf_packs;
  int num_experts, num_topk, expert_alignment;
  int do_expand, cached, do_zero_padding;
  int num_sms;
  // Overlapped dispatch: wait per chunk of 32 slots for the senders' arrival counts instead of for
  // their dispatch_done, and clear the counters at the end. num_sms is the epilogue's share.
  int overlap;
  // Zero-copy dispatch: recv_x is the dense area the push wrote (DispatchParams::zero_copy); the
  // epilogue copies no hidden bytes (recv_x is ignored) and reads records without them.
  int zero_copy;
  // Hybrid mode: the forward kernel runs first (relays the rail peers' records into this domain's
  // receive areas and writes rows [other domain][t] of forward_dense, as DispatchParams).
  int* forward_dense;
};

struct CombineParams {
  const void* x;               // [N or N_exp, hidden] bf16
  const float* topk_weights;   // [N, K] or [N_exp] (may be null)
  const int* src_metadata;     // [N_alloc, K + 2]
  const int* psum_rank;        // [R] (its last entry is the received token count N)
  const int64_t* combined_topk_idx;  // [T, K] the origin's top-k of the dispatch
  void* combined_x;            // [T, hidden] bf16
  float* combined_topk_weights;  // [T, K] (may be null)
  const void* bias0;           // [T, hidden] bf16 (may be null)
  const void* bias1;           // [T, hidden] bf16 (may be null)
  int num_combined_tokens, num_max_tokens_per_rank;
  int hidden, num_experts, num_topk;
  int use_expanded_layout, allow_multiple_reduction;
  int num_sms;
  // 0: push and reduce are two kernels (the reduce starts when every peer finished pushing).
  // > 0: one kernel of num_sms blocks; the first `overlap_push_blocks` blocks to start push, the
  // others reduce each token chunk as soon as its rows have landed (overlap_fits must hold,
  // 0 < overlap_push_blocks < num_sms, and no event may gate the reduce).
  int overlap_push_blocks;
  int num_x_rows;              // rows of x: the bound of the row index this rank's own slots hold (a peer
                               // maps the whole window, so the index is checked before x is read at it)
  // Tests only (ELASTIC_EP_TEST_CORRUPT=own_row): 4 = this rank's own slots hold their index plus
  // num_x_rows; the reduce must report a protocol error and read nothing past x.
  int test_corrupt;
  // Hybrid mode: rows for another domain's origin go to this domain's rail peer of the origin (its
  // stage area), which forwards them over the scale-out transport (no overlapped combine here).
};

// One PP send or receive (pp.cuh): `x` goes into / comes out of slot seq % num_max_inflight of the
// receiver's row for the sender, seq being the pair's running count (kept on the device, so a CUDA
// graph replays correctly). The descriptor (numel, dtype code, shape word; _peer_calls.py makes them)
// travels with a sent tensor; a receive compares it with its own before copying anything.
struct PpParams {
  void* x;                     // [nbytes] the sent tensor (send) or the one received into (recv)
  int64_t nbytes;              // <= slot_bytes
  int64_t slot_bytes;          // num_max_tensor_bytes rounded up to 32
  int peer;                    // dst_rank_idx (send) / src_rank_idx (recv)
  int num_max_inflight;        // <= kPpDescEntries / num_ranks (the descriptor ring)
  int num_sms;
  uint64_t numel;              // the tensor's descriptor: its element count,
  uint64_t dtype_code;         //   its dtype,
  uint64_t shape_word;         //   its shape (packed, or a digest)
};
// The PP descriptor's fields, in the order a receive compares them (the first that differs is named).
enum PpField : int { kPpFieldDtype = 0, kPpFieldNumel = 1, kPpFieldShape = 2 };

// One AGRS gather's record (agrs.cuh; _peer_calls.agrs_record makes it): word 0 is the kernel's (the
// digest of the others), then the tensor count, the gather's byte offset in its session and the
// first tensors' dtypes, element counts and shapes. Every rank compares its peers' with its own.
struct AgrsGatherParams {
  uint64_t record[16];  // kAgrsRecordWords (sizing.hpp; agrs.cuh checks the two agree)
};

// What PP and AGRS report to the host through HostWorkspaceLayout::geometry (sizing.hpp numbers the
// dispatch and low-latency reports below 32; _peer_calls.py reads these):
//   kReportPpField + f: a receive refused the sender's tensor, field f (PpField) differs; the report's
//     peer word is ((k + 1) << 8) | sender, k the pair's tensor count (mod 2^23); values: the
//     sender's field, this rank's.
//   kReportPpTag: a sender's descriptor is not the one of the tensor received (a corrupted word).
//   kReportAgrsWord + w: a peer's gather record differs from this rank's first at word w (1..15).
//   kReportAgrsTag: a peer's gather signal is from no gather this one can be waiting for.
constexpr int kReportPpField = 32, kReportPpTag = 35, kReportAgrsTag = 39, kReportAgrsWord = 40;

// Low-latency mode (DeepEP V1's low_latency_dispatch / low_latency_combine; ll_sizing.hpp has the
// layout). `phases`: bit 0 runs the send phase, bit 1 the receive phase (both: one kernel; DeepEP's
// return_recv_hook: one launch each). `half_offset`: the call's half, as an offset in the buffer.
enum LowLatencyPhase : int { kLlSend = 1, kLlRecv = 2 };
struct LlDispatchParams {
  const void* x;               // [T, hidden] bf16
  const int64_t* topk_idx;     // [T, K] global expert ids, -1 masked
  void* recv_x;                // [L, R * M, hidden] fp8 (use_fp8) or bf16
  float* recv_scales;          // use_fp8 without use_ue8m0: [L, hidden / 128, R * M] f32 (column-major scales), else null
  int* recv_scales_ue8m0;      // use_ue8m0: [L, hidden / 512, R * M] int32, 4 exponent bytes each, else null
  int* recv_count;             // [L] rows received per local expert
  int* recv_src_info;          // [L, R * M] the row's token index at its source rank
  int* recv_route;             // [L, R * M] ll_route(source rank, top-k lane): where the combine sends the row
  int64_t* recv_layout_range;  // [L, R] (first row << 32) | rows, per source rank
  int* recv_self_pos;          // [M, K] the recv_x row ([L, R * M] flat) of each lane of this rank whose expert is
                               // its own, -1 for the others: what an in-place combine reads; may be null
  int* cumulative_stats;       // [L] += rows received (may be null)
  int64_t* wait_stats;         // [R] += ns the receive phase waited for each source rank (may be null)
  int64_t half_offset;
  int num_tokens, num_max_tokens, hidden, num_experts, num_topk;
  int use_fp8, round_scale, use_ue8m0;
  int half, phases, shrink;
  int num_sms;
  int own_in_place;            // 1: x stays unchanged until the receive (no receive hook): this rank's own rows
                               // skip the window, the receive casts them from x (needs recv_self_pos)
};
struct LlCombineParams {
  const void* x;               // [L, R * M, hidden] bf16 expert outputs (the zero-copy area, or the caller's)
  const int64_t* topk_idx;     // [T, K] the dispatch's top-k
  const float* topk_weights;   // [T, K]
  const int* recv_count;       // [L] } the dispatch's handle
  const int* src_info;         // [L, R * M]
  const int* route;            // [L, R * M]
  const int* self_pos;         // [M, K] the dispatch's recv_self_pos, or null; given (to both phases) only
                               // when x stays unchanged from the send to the receive (no receive hook): the
                               // lanes of this rank's own experts are then read from x in place
  void* combined_x;            // [T, hidden] bf16
  int64_t* wait_stats;         // [R] += ns waited for each rank's rows (may be null)
  int64_t half_offset;
  int num_tokens, num_max_tokens, hidden, num_experts, num_topk;
  int half, phases, shrink;
  int num_sms;
};

// One ring step of the scale-out transport (scaleout_probe.cuh): put to `next`, wait for `prev`.
struct ScaleoutProbeParams {
  int next, prev;        // the rail peer this rank puts to, the one it waits for
  uint64_t src, dst;     // byte offsets in the window (this rank's source, the next peer's destination)
  uint64_t bytes;        // a multiple of 16
  uint64_t round;        // the wait: signal[prev] >= round (the signal is monotonic)
};

// What a device communicator asks NCCL's GIN for (DeepEP V2's request; Python's
// _domains.gin_requirements computes it): contexts (one per QP), signals (R + 4), exclusive contexts,
// queue depth, traffic class (sl_idx), connections (kGinRail in hybrid mode: only rail peers talk).
enum GinConnection : int { kGinNone = 0, kGinFull = 1, kGinRail = 2 };
struct GinRequest {
  int contexts, signals, counters, queue_depth, traffic_class;
  int connection;  // GinConnection
  int exclusive;
};
// The fields of NCCL's ncclDevCommRequirements that gin_fill sets, as read back (-1: the installed
// headers have no such field, so the request goes without it).
struct GinRequestApplied {
  int contexts, signals, counters, queue_depth, traffic_class, connection, exclusive;
};

#if COMMKIT_WITH_CUDA
// NCCL device communicator: LSA, plus GIN when `gin` is given (the runtime's hybrid mode across NVLink
// domains; only in a build with ELASTIC_EP_WITH_GIN, else ncclInvalidUsage). Return ncclResult_t codes;
// never throw. `nccl_runtime_version` (ncclGetVersion of the loaded libnccl) picks the structure layout
// that library reads (devcomm_abi): a build against newer headers runs LSA-only on an older NCCL.
int devcomm_create(void* nccl_comm, const GinRequest* gin, int nccl_runtime_version, void** out_devcomm,
                   int* out_lsa_rank, int* out_lsa_size);
// Whether devcomm_create can talk to a libnccl of `nccl_runtime_version` (NCCL_VERSION_CODE) from the
// headers this package was built with: NCCL 2.29 put a size/magic/version header in front of
// ncclDevCommRequirements and ncclDevComm, which 2.28.x lacks. Newer headers on an older library: LSA
// only, through 2.28.x's layout (GIN structures are read by the kernels, so GIN needs the same layout);
// headers older than 2.29 on a 2.29+ library: refused (the library checks the header's magic).
enum class DevcommAbi { kSame, kLegacyLsaOnly, kUnsupported };
DevcommAbi devcomm_abi(int nccl_runtime_version, bool use_gin);
// The requirements devcomm_create would pass for `gin`, read back (host only: no NCCL call), so the CPU
// suite checks the request against the headers the package was built with.
GinRequestApplied gin_request_applied(const GinRequest& gin);
// ncclCommQueryProperties (NCCL >= 2.29, never linked: `query_properties` is its address in the loaded
// libnccl, or null): GIN types (ncclGinType_t) and LSA team count; returns the ncclResult_t, or -1 when
// the headers the package was built with or the loaded library predate the call.
int nccl_comm_gin_properties(void* nccl_comm, void* query_properties, int* out_gin_type, int* out_railed_gin_type,
                             int* out_num_lsa_teams);
void devcomm_destroy(void* nccl_comm, void* devcomm);
// out_peer_bases[first + p] = the LSA address of LSA peer p's window, p < lsa_size (the caller zeroes the
// rest: ranks of other NVLink domains have none).
void launch_resolve_peers(void* window, int first, int lsa_size, void** out_peer_bases, void* stream);
void launch_barrier(const CommView& c, void* stream);
// Notify then push on `stream`: the push as notify's programmatic dependent when p.concurrent_notify
// (it runs beside notify), else after it; with `notify_done_event` (a cudaEvent_t, may be null; only
// without concurrent_notify) recorded between the two, so an overlapped epilogue on another stream
// can start with the push.
void launch_dispatch(const CommView& c, const DispatchParams& p, void* stream, void* notify_done_event = nullptr);
// Hybrid mode (num_scaleup_ranks < R): the forward kernel, then the epilogue.
void launch_dispatch_epilogue(const CommView& c, const EpilogueParams& p, void* stream);
// Combine = push (rows back to their origins) then reduce (the epilogue); the runtime may make the
// stream wait for an event between the two (previous_event_before_epilogue).
// Hybrid mode: the push, then the forward kernel (this domain's partials to the rail peers).
void launch_combine_push(const CommView& c, const CombineParams& p, void* stream);
void launch_combine_reduce(const CommView& c, const CombineParams& p, void* stream);
// The overlapped combine (p.overlap_push_blocks > 0): push and reduce in one kernel.
void launch_combine_overlapped(const CommView& c, const CombineParams& p, void* stream);
// PP (pp.cuh): the send waits for a free slot at the peer, copies, signals; the receive waits for the
// tensor, copies it out, returns the slot. Both point-to-point: no epoch, no entry barrier.
void launch_pp_send(const CommView& c, const PpParams& p, void* stream);
void launch_pp_recv(const CommView& c, const PpParams& p, void* stream);
// Low-latency mode: the phases p.phases names, in one kernel.
void launch_ll_dispatch(const CommView& c, const LlDispatchParams& p, void* stream);
void launch_ll_combine(const CommView& c, const LlCombineParams& p, void* stream);
// Scale-out transport probe (scaleout_probe.cuh), over the runtime's scale-out transport.
void launch_scaleout_probe(const CommView& c, const ScaleoutProbeParams& p, void* stream);
// AGRS (agrs.cuh), one block each, after the copy engine's copies: count the gather, signal every
// peer, wait for every peer's copies and compare their records with p's; end a session (count it,
// signal, wait for every peer's end).
void launch_agrs_gather_done(const CommView& c, const AgrsGatherParams& p, void* stream);
void launch_agrs_session_end(const CommView& c, void* stream);
// Engram (engram.cuh): out[i] = row indices[i] of the table whose rank r's shard is at hosts[r]
// (device-mapped pinned host memory), row_bytes a multiple of 16.
void launch_engram_fetch(const void* const* hosts, const int* indices, int64_t n, int64_t entries_per_rank,
                         int64_t row_bytes, void* out, void* stream);
#endif

}  // namespace elastic_ep
