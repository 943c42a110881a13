// attnjit/fa2/traits.cuh: every tile and stage constant of one fa2 kernel instance, with its static_asserts.
#pragma once
#include "attnjit/paged.cuh"
#include "attnjit/variant.cuh"

namespace attnjit {

// Every tile and stage constant of one fa2 kernel instance.
template <typename T_, typename TO_, typename TKV_, int HEAD_DIM_, int GROUP_, bool CAUSAL_, bool PAGED_, int PAGE_SIZE_,
          bool HND_, int NUM_WARPS_Q_, int NUM_WARPS_KV_, int NUM_MMA_Q_, int NUM_MMA_KV_, int NUM_STAGES_,
          typename VARIANT_ = NoVariant>
struct AttentionTraits {
  using T = T_;      // q element type, and the type K and V tiles have in shared memory (the mma's type)
  using TO = TO_;    // output element type
  using TKV = TKV_;  // the KV cache's element type: T, or fp8 (e4m3/e5m2), converted on the way into the mma
  using Variant = VARIANT_;  // hook policy (NoVariant: plain softmax attention)
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int GROUP = GROUP_;  // query heads per KV head
  static constexpr bool CAUSAL = CAUSAL_;
  static constexpr bool PAGED = PAGED_;
  static constexpr int PAGE_SIZE = PAGE_SIZE_;
  static constexpr bool HND = HND_;
  static constexpr int NUM_WARPS_Q = NUM_WARPS_Q_;    // warps splitting the q rows of a tile
  static constexpr int NUM_WARPS_KV = NUM_WARPS_KV_;  // warps splitting the kv columns of a tile
  static constexpr int NUM_MMA_Q = NUM_MMA_Q_;        // m16 row blocks per warp
  static constexpr int NUM_MMA_KV = NUM_MMA_KV_;      // 16-column kv blocks per warp per tile
  static constexpr int NUM_STAGES = NUM_STAGES_;      // cp.async pipeline depth for K/V tiles
  static constexpr int NUM_WARPS = NUM_WARPS_Q * NUM_WARPS_KV;
  static constexpr int NUM_THREADS = 32 * NUM_WARPS;
  static constexpr int WARP_ROWS = NUM_MMA_Q * 16;
  static constexpr int WARP_COLS = NUM_MMA_KV * 16;
  static constexpr int CTA_Q = NUM_WARPS_Q * WARP_ROWS;    // packed rows per work item
  static constexpr int CTA_KV = NUM_WARPS_KV * WARP_COLS;  // kv tokens per pipeline stage
  static constexpr int CHUNKS = HEAD_DIM / 8;              // 16-byte chunks per row
  static constexpr int ROW_BYTES = HEAD_DIM * 2;           // one row of a Q/K/V tile in shared memory
  // page ids of a KV tile, staged in shared memory by cp.async several tiles ahead of their use
  static constexpr int PAGES_PER_TILE = PAGED ? pages_per_tile(CTA_KV, PAGE_SIZE) : 0;
  static constexpr int PAGE_RING = 2 * NUM_STAGES;         // tiles whose page ids are resident
  static constexpr int PAGE_SMEM = (PAGE_RING * PAGES_PER_TILE * 4 + 127) / 128 * 128;
  static constexpr int Q_SMEM = CTA_Q * HEAD_DIM * 2;
  static constexpr int KV_TILE_SMEM = CTA_KV * HEAD_DIM * 2;  // one of K or V, 16-bit: what the mainloop reads
  // the cp.async ring holds K and V as stored. An fp8 cache's stages hold rows of KV_ROW_BYTES; its bytes become the
  // mma's 16-bit operands in registers (FP8_IN_REGS: fa2/fp8_frags.cuh), or, where a key transform rewrites K in
  // shared memory, are converted into 16-bit K and V tiles first. Rows of a multiple of 128 bytes (head_dim 128,
  // 256) are swizzled as the 16-bit tiles are (16-byte chunk c of row r at (c ^ (r & 7)) << 4: 8 rows at one chunk
  // fall in 8 bank groups, for ldmatrix) and stay 128-byte aligned; shorter rows (head_dim 64) are padded by 16
  // bytes instead. (Padded 144-byte rows made each cp.async of 128-byte global rows ask L2 for 24 sectors
  // instead of 16: Nsight Compute, run 102.)
  static constexpr int KV_ELEM_BYTES = static_cast<int>(sizeof(TKV));
  static constexpr bool FP8_KV = KV_ELEM_BYTES == 1;
  static constexpr bool FP8_IN_REGS = FP8_KV && !Variant::HAS_KEY_TRANSFORM;
  static constexpr bool FP8_SWIZZLED = FP8_KV && HEAD_DIM % 128 == 0;
  static constexpr int KV_ROW_BYTES = FP8_KV ? (FP8_SWIZZLED ? HEAD_DIM : HEAD_DIM + 16) : ROW_BYTES;
  static constexpr int KV_STAGE_SMEM = CTA_KV * KV_ROW_BYTES;  // one of K or V, one stage, as stored
  // where byte `byte` of a staged fp8 row lands (attnjit/kv_load.cuh)
  __device__ __forceinline__ static constexpr uint32_t stage8_offset(int row, int byte) {
    return static_cast<uint32_t>(row * KV_ROW_BYTES +
                                 (FP8_SWIZZLED ? (((byte >> 4) ^ (row & 7)) << 4) | (byte & 15) : byte));
  }
  // the XOR term of a staged fp8 chunk that a lane addresses with ldmatrix (its rows all have row & 7 == lane & 7):
  // chunk 2 j + h (h = lane / 16) of such a row lies at ((j << 5) ^ stage8_y16(lane)) past the row's start
  __device__ __forceinline__ static constexpr uint32_t stage8_y16(int lane) {
    return static_cast<uint32_t>(((lane / 16) ^ (FP8_SWIZZLED ? lane & 7 : 0)) << 4);
  }
  // Converted in shared memory, where warps split the kv tile (NUM_WARPS_KV > 1: decode), each warp reads only its
  // own WARP_COLS rows of K and V, so each converts its own rows, K before S = Q K^T and then V into the same
  // 16-bit tile before O += P V, with __syncwarp only; otherwise (every warp reads every row) the CTA converts K
  // and V into two tiles behind a barrier
  static constexpr bool FP8_WARP_OWNED = FP8_KV && !FP8_IN_REGS && NUM_WARPS_KV > 1;
  static constexpr int DEQUANT_SMEM = FP8_KV && !FP8_IN_REGS ? (FP8_WARP_OWNED ? 1 : 2) * KV_TILE_SMEM : 0;
  // fp8 in registers multiplies in fp16 (one conversion per two values, not four). A bf16 q is converted once per
  // item into the Q tile as fp16, each row scaled by a power of two (fa2/fp8_frags.cuh); the rows' 2^-e live here
  static constexpr bool Q_TO_HALF = FP8_IN_REGS && is_bf16<T>::value;
  static constexpr int QSCALE_SMEM = FP8_IN_REGS ? (CTA_Q * 4 + 127) / 128 * 128 : 0;
  static constexpr int PIPE_SMEM = 2 * NUM_STAGES * KV_STAGE_SMEM + DEQUANT_SMEM;
  // cross-warp merge scratch (NUM_WARPS_KV > 1), reusing the pipeline's memory after the main loop:
  // normalized o [NUM_WARPS_KV][CTA_Q][HEAD_DIM] f32, then lse [NUM_WARPS_KV][CTA_Q] f32
  static constexpr int MERGE_SMEM = NUM_WARPS_KV > 1 ? NUM_WARPS_KV * CTA_Q * (HEAD_DIM + 1) * 4 : 0;
  static constexpr int SMEM_BYTES = Q_SMEM + PAGE_SMEM + QSCALE_SMEM + (PIPE_SMEM > MERGE_SMEM ? PIPE_SMEM : MERGE_SMEM);
  // tile loads (Q, K, V): 8 threads per row, thread t copies chunks t % 8 + 8 j (j < CHUNKS / 8) of one row, so
  // 8 neighbouring threads write 8 different bank groups, and one address serves a row's CHUNKS / 8 copies
  static constexpr int KV_ROWS_PER_PASS = NUM_THREADS / 8;        // rows one pass of the CTA's threads covers
  static constexpr bool Q_IN_REGS = NUM_MMA_Q * (HEAD_DIM / 16) * 4 <= 32;
  // the shared loaders' geometry (attnjit/kv_load.cuh): every thread copies; rows are contiguous in shared memory
  static constexpr int LOAD_THREADS = NUM_THREADS;
  static constexpr bool GATHER_PAGE_BASE = false;  // small pages: each row's offset in elements (kv_load.cuh)
  static constexpr int Q_PITCH = ROW_BYTES, Q_STEP = 128, KV_PITCH = ROW_BYTES, KV_STEP = 128;
  static constexpr int KV_GS = 8 * KV_PITCH;  // bytes from one 8-row group to the next (rows are contiguous)

  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 64, "head_dim must be a multiple of 16, at least 64");
  static_assert(NUM_THREADS % 8 == 0 && CHUNKS % 8 == 0, "a cp.async pass must cover whole rows");
  static_assert(CTA_Q % KV_ROWS_PER_PASS == 0 || KV_ROWS_PER_PASS % CTA_Q == 0, "q rows and load passes must nest");
  static_assert(CTA_KV % KV_ROWS_PER_PASS == 0, "the kv tile must be a whole number of cp.async passes");
  static_assert(NUM_STAGES >= 2, "the K/V pipeline needs at least two stages");
  static_assert(NUM_WARPS_Q == 1 || NUM_WARPS_KV == 1, "warps split either q rows or kv columns, not both");
  static_assert(GROUP >= 1, "group size must be positive");
  static_assert(KV_ELEM_BYTES == 2 ? std::is_same<TKV, T>::value : FP8_KV,
                "the cache holds q's 16-bit type or fp8");
  static_assert(!PAGED || (PAGE_SIZE >= 1 && PAGE_SIZE <= 1024), "page_size is 1..1024 (any, not only 2^k)");
  static_assert(PAGES_PER_TILE <= NUM_THREADS, "one thread per staged page id");
};

}  // namespace attnjit
