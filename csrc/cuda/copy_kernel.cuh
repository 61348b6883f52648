// copy_kernel.cuh - the body of the CUDA copy kernel, compiled for the device and for the host.
//
// One thread's work: rows (see kv_layout.h) are split over groups of `TPR` lanes (TPR = threads per
// row, a power of two <= 32 chosen from the row length by launch_config.h); each lane moves one vector
// word of width sizeof(VecT) (16 bytes when every address and stride allows) per iteration, and a CTA's
// row groups walk the rows with a grid-stride loop. The memory accesses go through `Access`:
//   - copy_cuda.cu's __global__ kernel passes (blockIdx.x, threadIdx.x, gridDim.x) and streaming
//     loads/stores (__ldcs/__stcs): the data is touched once, so it should not evict the model's working
//     set from L2;
//   - copy_sim.cu (impl "cuda_sim") calls the same body for every thread of every CTA on the CPU, with
//     loads/stores that first check what the GPU would fault on or silently corrupt.
// So the kernel's indexing runs, bit for bit, in CPU CI, although no GPU ever executes it there.
//
// Access must provide (its methods may be __device__-only or host-only; each side instantiates only its
// own policy):
//   void begin_row(int64_t row, int32_t layer)  before a non-padding row's addresses are formed
//   VecT load(const VecT* p)
//   void store(VecT* p, VecT v)
#pragma once

#include <cuda_runtime.h>  // uint2 / uint4 (vector_types.h) on both sides

#include <cstdint>
#include <type_traits>

#include "../kv_layout.h"
#include "launch_config.h"

namespace kvx::cuda {

// One thread of the copy kernel: thread `thread` (of kThreads) of CTA `cta` in a grid of `grid` CTAs.
//   layer_ptrs: [num_layers] layer base addresses, readable where this runs
//   ids:        [num_ids] block or slot ids, readable where this runs
//   contig:     base of the contiguous side [layers, planes, tokens, heads, row_bytes] (strided)
// The exec check is off because the template is __host__ __device__ while each Access is one-sided: the
// device kernel instantiates it only with the device policy, the emulation only with the host one.
#pragma nv_exec_check_disable
template <typename VecT, int TPR, typename Access>
__host__ __device__ __forceinline__ void copy_thread(const CopyParams& p, const int64_t* __restrict__ layer_ptrs,
                                                     const int64_t* __restrict__ ids, char* contig, bool gather,
                                                     unsigned cta, unsigned thread, unsigned grid, Access& access) {
  constexpr int kGroups = kThreads / TPR;  // row groups per CTA
  const int lane = thread % TPR;
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(VecT));
  const int64_t rpe = rows_per_entry(p);
  const int64_t total = num_entries(p) * rpe;
  for (int64_t row = static_cast<int64_t>(cta) * kGroups + thread / TPR; row < total;
       row += static_cast<int64_t>(grid) * kGroups) {
    const int64_t e = row / rpe, r = row - e * rpe;
    int32_t layer;
    int64_t paged_off, contig_off;
    if (!entry_offsets(p, e, ids, &layer, &paged_off, &contig_off)) continue;
    access.begin_row(row, layer);
    char* paged = reinterpret_cast<char*>(layer_ptrs[layer]) + paged_off + row_paged_offset(p, r);
    char* flat = contig + contig_off + row_contig_offset(p, r);
    const VecT* src = reinterpret_cast<const VecT*>(gather ? paged : flat);
    VecT* dst = reinterpret_cast<VecT*>(gather ? flat : paged);
    // Four loads in flight per lane before their stores: a read of mapped host memory waits a PCIe round
    // trip (~1 us), so with one load per lane a CTA cap of 8 would leave the link mostly idle. Named
    // values, not an array: an array of uint4 made ptxas spill (sm_90, 40 registers).
    int64_t w = lane;
    for (; w + 3 * TPR < words; w += 4 * TPR) {
      const VecT v0 = access.load(src + w), v1 = access.load(src + w + TPR), v2 = access.load(src + w + 2 * TPR),
                 v3 = access.load(src + w + 3 * TPR);
      access.store(dst + w, v0);
      access.store(dst + w + TPR, v1);
      access.store(dst + w + 2 * TPR, v2);
      access.store(dst + w + 3 * TPR, v3);
    }
    for (; w < words; w += TPR) access.store(dst + w, access.load(src + w));
  }
}

template <typename T>
struct VecTag {
  using type = T;
};

// Call f(VecTag<VecT>{}, std::integral_constant<int, TPR>{}) for the kernel instance of a LaunchConfig's
// width and tpr: the one mapping from launch decisions to template arguments, for the launcher and the
// emulation alike. 5 widths x 4 lane counts = 20 instances.
template <typename F>
void with_kernel_types(int32_t width, int32_t tpr, F&& f) {
  auto by_tpr = [&](auto vec) {
    switch (tpr) {
      case 4: return f(vec, std::integral_constant<int, 4>{});
      case 8: return f(vec, std::integral_constant<int, 8>{});
      case 16: return f(vec, std::integral_constant<int, 16>{});
      default: return f(vec, std::integral_constant<int, 32>{});
    }
  };
  switch (width) {
    case 16: return by_tpr(VecTag<uint4>{});
    case 8: return by_tpr(VecTag<uint2>{});
    case 4: return by_tpr(VecTag<uint32_t>{});
    case 2: return by_tpr(VecTag<uint16_t>{});
    default: return by_tpr(VecTag<uint8_t>{});
  }
}

}  // namespace kvx::cuda
