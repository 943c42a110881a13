// attnjit/sm90/traits.cuh: every tile, stage, thread and register constant of one sm90 kernel instance, and its
// shared-memory layout, with static_asserts that carry the reason.
#pragma once
#include <type_traits>

#include "attnjit/paged.cuh"
#include "attnjit/variant.cuh"

namespace attnjit {

// Whether paged NHD K/V tiles take the interleaved layout (Sm90Traits::KV_INTERLEAVED; the host's
// sm90.kv_interleaved says the same, and the template asserts it). With it, V comes by TMA too (tma.cuh
// tma_v_gather). Run 147 (H100, causal page 16, benchmarks/sm90_timeline.py --time): 8x2048 583 TFLOP/s against
// 558 with the plain layout, 1x8192 656 against 629, 32x512 391 against 380; the what-if plain-kv turns it off.
constexpr bool kKvInterleave = true;

// Whether the producer's cp.async gather addresses rows of pages smaller than a copy pass (1, 2, 4, 8 tokens) from
// per-thread bases (attnjit/kv_load.cuh gather_page_base; GATHER_PAGE_BASE below says where); the what-if
// page-offsets turns it off.
constexpr bool kGatherPageBase = true;

template <typename T_, typename TO_, typename TKV_, int HEAD_DIM_, int GROUP_, bool CAUSAL_, bool PAGED_, int PAGE_SIZE_, bool HND_,
          int CTA_KV_, int NUM_STAGES_, int Q_STAGES_, int TAU_ = 0, int CONSUMERS_ = 2, typename VARIANT_ = NoVariant,
          bool CHAIN_ = false>
struct Sm90Traits {
  using T = T_;      // q's type (the Q tile as it lands)
  using TKV = TKV_;  // the cache's element type: T, or fp8 (e4m3 / e5m2)
  using TO = TO_;
  // An fp8 cache is copied as stored into the 16-bit K and V tiles and converted there, in place, by the producer;
  // the wgmma then runs in fp16 (fp8 -> fp16 is one instruction per two values and exact). A bf16 q becomes fp16
  // in its Q tile, each row times 2^e (attnjit/kv_load.cuh q_rows_to_half_rows), S multiplied back by 2^-e.
  static constexpr bool FP8_KV = sizeof(TKV_) == 1;
  using TM = std::conditional_t<FP8_KV, __half, T_>;  // the wgmma's type: K, V and (converted) Q tiles, and P
  static constexpr bool Q_TO_HALF = FP8_KV && std::is_same<T_, __nv_bfloat16>::value;
  using Variant = VARIANT_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int GROUP = GROUP_;
  static constexpr bool CAUSAL = CAUSAL_;
  static constexpr bool PAGED = PAGED_;
  static constexpr int PAGE_SIZE = PAGE_SIZE_;
  static constexpr bool HND = HND_;
  // one producer warpgroup (loads) and two (or three) consumer warpgroups (wgmma, softmax), 64 packed rows each;
  // the consumers take turns at the tensor cores in a ring (0, 1, ..., 0)
  static constexpr int CONSUMERS = CONSUMERS_;
  static constexpr int WG_ROWS = 64;                       // wgmma M
  static constexpr int CTA_Q = WG_ROWS * CONSUMERS;        // packed rows per work item
  static constexpr int CTA_KV = CTA_KV_;                   // kv tokens per tile
  static constexpr int NUM_STAGES = NUM_STAGES_;           // K and V tiles in flight (each its own ring)
  static constexpr int Q_STAGES = Q_STAGES_;               // Q tiles: 2 lets the next item's Q load under this one
  // a row's running max moves only when a tile's max exceeds it by more than TAU (log2 units): P is then at most
  // 2^TAU, and O is rescaled far less often. 0: every larger max moves it.
  static constexpr int TAU = TAU_;
  static constexpr int NUM_THREADS = 128 * (CONSUMERS + 1);
  static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  // the softmax of tile j under the tensor cores' P(j-1) V(j-1): S(j) and P(j-1) live at once (not at head_dim 256)
  static constexpr bool OVERLAP = HEAD_DIM_ <= 128;
  // Consecutive items chained (sm90/walk.cuh walk_chained), where the tile configuration asks for it (CHAIN_: the
  // sm90 family's kv128c, attnjit/families/sm90.py) and the kernel allows. The next pair is waited for before an
  // item's epilogue, so its Q needs a stage of its own. Not where the consumers prepare the Q tile together first
  // (an fp8 cache under a bf16 q, a query transform: their barriers), nor in the tile configurations of wide K/V
  // tiles or three consumers (kv160 and q192kv64 spilled in the main loop). A softmax with a hook (a logits
  // transform: soft-cap, ALiBi, a user's bias; or a sink) holds more registers at the boundary (40-60 bytes
  // spilled at 224): chained, its consumers take 232 and the producer 40, which is enough where the producer's
  // K/V go by TMA (16-bit pages of 16k tokens, ragged); its cp.async gather of smaller pages needs 56, so there
  // such kernels are not chained.
  static constexpr bool HOOKED_SOFTMAX =
      VARIANT_::HAS_SINK || (VARIANT_::HAS_LOGITS_TRANSFORM && VARIANT_::USE_SOFTMAX);
  static constexpr bool TMA_PRODUCER = !FP8_KV && (!PAGED || PAGE_SIZE_ % 16 == 0);
  static constexpr bool CHAIN_ASKED = CHAIN_;
  static constexpr bool CHAIN = CHAIN_ && OVERLAP && CONSUMERS_ == 2 && CTA_KV_ <= 128 && Q_STAGES_ >= 2 &&
                                !Q_TO_HALF && !VARIANT_::HAS_QUERY_TRANSFORM && (!HOOKED_SOFTMAX || TMA_PRODUCER);
  static constexpr bool WIDE_CONSUMERS = CHAIN && HOOKED_SOFTMAX;
  // setmaxnreg budgets. The CTA starts with LAUNCH_REGS per thread (64K / threads, rounded down to a multiple of 8:
  // ptxas's allocation under __launch_bounds__(threads, 1)); a consumer's setmaxnreg.inc waits until the producer's
  // .dec has returned enough of them, so the two budgets must fit in what the CTA was given, or it waits forever.
  static constexpr int LAUNCH_REGS = (65536 / (128 * (CONSUMERS + 1))) / 8 * 8;
  // Head_dim 256: producer 32, consumers 232. (At 24 the producer spilled 4-8 bytes once a work item with
  // interleaved tiles and V by TMA, pages 16 and 32: none now; pages of 1-8 tokens still spill, less. Run 149, H100,
  // sm90_timeline.py --head-dim 256 --time: 32 / 232 as fast, 8x2048 584 / 589 against 591 / 584 TFLOP/s, 1x8192
  // 622 / 606 against 615 / 621. Over fp8 its ring counters and in-place conversion need 32 too.)
  // Three consumers (64K registers over 512 threads, 128 each at launch): producer 32, consumers 160.
  // K/V tiles wider than 128: S and P take 3N/4 registers, so the consumers take 232 and the producer 40; so do
  // chained kernels with a hooked softmax (WIDE_CONSUMERS, above).
  // Head_dim 64 with K/V tiles of 128 or fewer: O and S take 96 registers, so the consumers give 8 to the producer
  // (its loop-invariant copy addresses and page ids; the work order's claim, sm90/producer.cuh, tipped page 1 over).
  static constexpr bool SMALL_D = HEAD_DIM_ <= 64 && CTA_KV_ <= 128;
  static constexpr int PRODUCER_REGS =
      CONSUMERS_ == 3 || HEAD_DIM_ > 128 ? 32 : CTA_KV_ > 128 || WIDE_CONSUMERS ? 40 : SMALL_D ? 64 : 56;
  static constexpr int CONSUMER_REGS =
      CONSUMERS_ == 3 ? 160 : HEAD_DIM_ > 128 || CTA_KV_ > 128 || WIDE_CONSUMERS ? 232 : SMALL_D ? 216 : 224;
  static constexpr int TURN_THREADS = 256;  // a turn's named barrier: the taker's 128 threads + the passer's 128
  // An item's last K/V tile whose visible keys all lie in its first NARROW columns (the causal diagonal's of a
  // short q tile, or a request's short tail) runs its softmax and P V over those columns only: the columns past
  // them are hidden for every row of the item. (S keeps its full width: a second wgmma shape for it costs ptxas
  // the registers that keep the wgmma pipelined in the variants' kernels; a variant's own mask, whose bit reads
  // already fill the consumers' registers, keeps full tiles: its kernel spilled with the narrow path.) 0: every
  // tile at full width.
  static constexpr int NARROW = OVERLAP && CTA_KV_ == 128 && CONSUMERS_ == 2 && !VARIANT_::HAS_LOGITS_MASK ? 64 : 0;
  // shared memory: Q_STAGES Q tiles, NUM_STAGES K tiles, NUM_STAGES V tiles, then the mbarriers. Tiles are
  // HEAD_DIM / 64 column blocks of [rows][64] in the 128-byte swizzle (attnjit/kv_load.cuh), 1024-byte aligned.
  static constexpr int Q_BYTES = CTA_Q * HEAD_DIM * 2;
  static constexpr int KV_BYTES = CTA_KV * HEAD_DIM * 2;
  static constexpr int K_OFF = Q_STAGES * Q_BYTES;
  static constexpr int V_OFF = K_OFF + NUM_STAGES * KV_BYTES;
  // fp8: each K or V stage is its own staging tile: row r's HEAD_DIM bytes lie in row r's 128-byte slots of the
  // stage's upper column blocks (stage8_offset), so the producer converts every row in place (sm90/producer.cuh)
  // and an fp8 cache needs no shared memory beyond the 16-bit tiles, but (bf16 q) CTA_Q floats of Q row scales
  static constexpr int BLOCKS = HEAD_DIM / 64;  // 64-column (128-byte) blocks of a tile row
  __device__ __forceinline__ static constexpr uint32_t stage8_offset(int row, int byte) {
    return BLOCKS >= 2 ? static_cast<uint32_t>((BLOCKS / 2 + byte / 128) * KV_STEP + row * 128 + byte % 128)
                       : static_cast<uint32_t>(row * 128 + 64 + byte);
  }
  static constexpr int QINV_OFF = V_OFF + NUM_STAGES * KV_BYTES;
  static constexpr int BAR_OFF = QINV_OFF + (Q_TO_HALF ? CTA_Q * 4 : 0);
  // barriers: q_full, q_empty per Q stage, then k_full, k_empty, v_full, v_empty per KV stage
  static constexpr int NUM_BARRIERS = 2 * Q_STAGES + 4 * NUM_STAGES;
  // then the work order's slots (sm90/producer.cuh): one pair per Q stage, the producer's claim
  static constexpr int PAIR_OFF = BAR_OFF + NUM_BARRIERS * 8;
  static constexpr int SMEM_BYTES = PAIR_OFF + (Q_STAGES + 1) * 4 + 1024;  // + the slack that aligns the base
  // the shared loaders' geometry (attnjit/kv_load.cuh): the producer warpgroup copies
  static constexpr int LOAD_THREADS = 128;
  // (head_dim 64 or 128 under two consumers: the d256 and q192kv64 producers, tighter, spilled 4-20 bytes more)
  static constexpr bool GATHER_PAGE_BASE = kGatherPageBase && HEAD_DIM_ <= 128 && CONSUMERS_ == 2;
  // K and V tiles of a paged NHD kernel whose tile is several pages of 16k tokens (pages its TMA path copies as
  // whole boxes, sm90/tma.cuh tma_kv) are "interleaved": 8-row groups of BLOCKS * 1024 bytes, each the group's
  // 64-column blocks one after another ([row / 8][block][row % 8][128 B]), so one TMA box {64, 8 rows, BLOCKS
  // blocks, PAGE_SIZE / 8 groups} brings a whole page, where the plain layout ([block][row][128 B]) takes a box per
  // page and column block. The wgmma read either: the 8-row
  // groups are KV_GS apart, the column blocks KV_STEP (attnjit/kv_load.cuh tile_offset, sm90/attention.cuh).
  static constexpr bool KV_INTERLEAVED = kKvInterleave && PAGED && !HND && !FP8_KV && BLOCKS >= 2 &&
                                         PAGE_SIZE % 16 == 0 && PAGE_SIZE < CTA_KV && CTA_KV % PAGE_SIZE == 0;
  static constexpr int Q_PITCH = 128, Q_STEP = CTA_Q * 128, KV_PITCH = 128;
  static constexpr int KV_STEP = KV_INTERLEAVED ? 1024 : CTA_KV * 128;  // bytes from one 64-column block to the next
  static constexpr int KV_GS = KV_INTERLEAVED ? BLOCKS * 1024 : 1024;    // bytes from one 8-row group to the next
  static constexpr int KV_PASSES = CTA_KV / (LOAD_THREADS / 8);   // copy passes per tile (page ids per thread)
  // named barriers (0 is __syncthreads): the consumers; each consumer's turn at the tensor cores; its
  // epilogue (and, fp8, its Q rows' conversion); the producer's claim of its next pair (the fp8 producer's warps
  // convert independently).
  static constexpr int BAR_CONSUMERS = 1, BAR_TURN = 2, BAR_EPILOGUE = 2 + CONSUMERS,
                       BAR_PRODUCER = 2 + 2 * CONSUMERS;

  static_assert(HEAD_DIM % 64 == 0, "sm90 tiles are whole 64-column (128-byte) swizzle blocks");
  static_assert(CTA_KV % 16 == 0 && CTA_KV >= 16 && CTA_KV <= 256, "a kv tile is wgmma N (S) and K slices (PV)");
  static_assert(HEAD_DIM <= 256, "the PV wgmma's N is the head dim, at most 256");
  static_assert(CTA_KV % (LOAD_THREADS / 8) == 0, "a kv tile is a whole number of copy passes");
  static_assert(NUM_STAGES >= 2, "K and V rings need at least two stages");
  static_assert(Q_STAGES >= 1, "at least one Q tile");
  static_assert(CONSUMERS == 2 || (CONSUMERS == 3 && HEAD_DIM <= 128 && !FP8_KV && CTA_KV <= 64),
                "three consumers: head_dim 64 or 128, a 16-bit cache, 64-token K/V tiles (their registers: 160 each)");
  static_assert(BAR_PRODUCER <= 15, "named barriers 1..15");
  static_assert(NARROW % 16 == 0 && NARROW < CTA_KV_, "a narrow tile is whole P V k-slices of a wider one");
  static_assert(TAU >= 0 && TAU <= 14, "P reaches 2^TAU (and a rounding residual more): fp16 P overflows at 2^16");
  static_assert(!PAGED || (PAGE_SIZE >= 1 && PAGE_SIZE <= 1024), "page_size is 1..1024 (any, not only 2^k)");
  static_assert(sizeof(TKV_) == 2 ? std::is_same<TKV_, T_>::value : FP8_KV, "the cache holds q's type or fp8");
  static_assert(!FP8_KV || BLOCKS == 1 || BLOCKS == 2 || BLOCKS == 4,
                "fp8 staging and its in-place conversion cover head dims 64, 128 and 256 (sm90/producer.cuh)");
  static_assert(SMEM_BYTES <= 227 * 1024, "the tiles do not fit in shared memory");
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * CONSUMER_THREADS <= LAUNCH_REGS * NUM_THREADS,
                "setmaxnreg budgets exceed the CTA's registers at launch: the consumers would wait forever");
};

}  // namespace attnjit
