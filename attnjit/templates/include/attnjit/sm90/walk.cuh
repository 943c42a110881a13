// attnjit/sm90/walk.cuh: the order in which a consumer warpgroup (sm90/attention.cuh Consumer) takes its work items'
// phases: each item alone (walk_items), or consecutive items chained (walk_chained, Sm90Traits::CHAIN). The phases
// themselves (an item's start, its tiles, its last P V, its epilogue) are the Consumer's.
#pragma once
#include "attnjit/sm90/producer.cuh"
#include "attnjit/sm90/wgmma.cuh"

namespace attnjit {
namespace sm90 {

// Each pair the producer published, in turn: its start, its tiles (Consumer::mainloop), its epilogue.
template <typename C>
__device__ __forceinline__ void walk_items(C& c, const typename C::Params& p, float sm_scale2) {
  using Tr = typename C::Traits;
  Ring<Tr::NUM_STAGES> kr, vr;
  consumer_pairs<Tr>(c.sm, [&](int i, int stage) {  // a pair the producer took (its setup holds), its Q landed
    c.release_stored();
    const float scale2 = c.begin_item(p, i, stage, sm_scale2);
    c.zero_o();
    c.reset_softmax();
    c.mainloop(kr, vr, scale2);
    c.write_item(c.it, c.qstage);
  });
}

// The walk with items chained: where an unsplit item with tiles is followed by one with tiles, the first's last P V
// is issued in one turn with the next's S(0) = Q K^T; once both are done, the first's epilogue (its m and l still
// there), then the next's first softmax, while the other consumer has its turn at the tensor cores. (Unchained, the
// last P V and the next S(0) each take a turn of their own, and both consumers' epilogues fall together, when
// neither has a GEMM to issue.) The next pair is waited for before the item's
// epilogue, so its Q tile must be another stage (Q_STAGES >= 2: that stage was released by the item before, whose
// output rows are released at the latest here, Consumer::release_stored).
template <typename C>
__device__ __forceinline__ void walk_chained(C& c, const typename C::Params& p, float sm_scale2) {
  using Tr = typename C::Traits;
  constexpr int N = Tr::CTA_KV;
  constexpr int NARROW = Tr::NARROW ? Tr::NARROW : N;  // (a template argument where NARROW is 0: never used)
  Ring<Tr::NUM_STAGES> kr, vr;
  Ring<Tr::Q_STAGES> qr;
  int i = next_pair<Tr>(c.sm, qr);
  float scale2 = sm_scale2;  // (the item's, from the run's: one value, one register, where no fp8 scale moves it)
  if (i >= 0) {
    scale2 = c.begin_item(p, i, qr.stage, sm_scale2);
    c.zero_o();
    c.reset_softmax();
  }
  bool s0 = false;  // the current item's S(0) is done and its P packed (chained)
  while (i >= 0) {
    const bool narrow = c.narrow_last();
    c.tiles_from(kr, vr, s0 ? 1 : 0, narrow, scale2);
    c.release_stored();  // the item before's output rows (a one-tile item had no step to do it)
    const int qs = qr.stage;
    qr.advance();
    i = next_pair<Tr>(c.sm, qr);
    const auto done = c.it;
    s0 = false;
    if (i >= 0) {
      c.template begin_item<false>(p, i, qr.stage, sm_scale2);  // (its fp8 scales after the done item's epilogue)
      // from lane 0 (every lane's value): the compiler then knows the branch is warp-uniform
      const bool chain = __shfl_sync(0xffffffffu, done.num_tiles > 0 && done.pslot < 0 && c.it.num_tiles > 0, 0);
      if (chain) {
        c.qk_turn(kr, 0);  // the next item's S(0)
        c.rescale_o();     // by the done item's last alpha, before its last P V adds to O
        c.wait_full(c.sm.v_full(vr.stage), vr.phase);
        if (Tr::NARROW > 0 && narrow) c.template pv_issue<NARROW>(vr);
        else c.pv_issue(vr);
        c.pass_turn();
        // both GEMMs done, then the done item's epilogue, then the next item's first softmax: O, S and P are never
        // live at once beyond what the loop holds
        wgmma_wait<0>();
        c.done_with_k(kr);
        c.done_with_v(vr);
        c.write_item(done, qs);
        // (the epilogue's one-thread branches behind: with the warp's convergence stated here ptxas keeps the K
        // descriptors of the main loop in uniform registers, 690 instructions a loop against 715 without; a
        // heuristic of the compiler's, checked only in SASS)
        __syncwarp();
        scale2 = c.item_scales(p, sm_scale2, c.it.kv_head);
        c.reset_softmax();
        const bool first_narrow = c.it.num_tiles == 1 && c.narrow_last();
        if (Tr::NARROW > 0 && first_narrow) c.template softmax<NARROW>(0, scale2);
        else c.softmax(0, scale2);
        c.zero_o();
        if (Tr::NARROW > 0 && first_narrow) c.template pack_p<NARROW>();
        else c.pack_p();
        s0 = true;
      }
    }
    if (!s0) {  // the done item ends alone: its last P V, its epilogue; then the next item from its S(0)
      if (done.num_tiles > 0) {
        if (Tr::NARROW > 0 && narrow) c.template pv_alone<NARROW>(vr);
        else c.pv_alone(vr);
      }
      c.write_item(done, qs);
      if (i >= 0) {
        scale2 = c.item_scales(p, sm_scale2, c.it.kv_head);
        c.zero_o();
        c.reset_softmax();
      }
    }
  }
}

}  // namespace sm90
}  // namespace attnjit
