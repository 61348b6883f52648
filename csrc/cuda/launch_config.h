// launch_config.h - every host-side decision of a copy-kernel launch, in one function.
//
// The CUDA launcher (copy_cuda.cu) and its CPU emulation (copy_sim.cu, impl "cuda_sim") both call
// kernel_launch_config(), so the grid the emulation runs is the grid the GPU gets: same vector width, same
// lanes per row, same CTA count and cap. Plain host C++ (no CUDA header): the bindings expose it as
// kvx._C.cuda_launch_config whether or not nvcc built the kernels, so the decisions are testable anywhere.
#pragma once

#include <cstdint>

#include "../kv_layout.h"

namespace kvx::cuda {

constexpr int kThreads = 256;     // threads per CTA: 8 warps
constexpr int kCtasPerSm = 4;     // resident CTAs of kThreads each that keep an SM busy

struct LaunchConfig {
  CopyParams params;   // after collapse_rows(): what the kernel receives
  int64_t total_rows;  // rows of the iteration space (padding slots included; the kernel skips them)
  int64_t ctas;        // grid size; 0 = nothing to copy, no launch
  int32_t width;       // bytes per vector access: 16, 8, 4, 2 or 1 (sizeof(VecT))
  int32_t tpr;         // threads (lanes) per row: 4, 8, 16 or 32
  int32_t groups;      // rows a CTA serves per pass of its grid-stride loop: kThreads / tpr
};

// The launch for a copy of `width`-byte vectors. Split from kernel_launch_config() so the emulation can be
// asked for a wider vector than the alignment allows (its checker's own test) and still get the lanes
// and grid the launcher would derive from that width.
//   p:         params after collapse_rows()
//   sm_count:  SMs of the device (the emulation takes an emulated count)
//   max_ctas:  cap on CTAs (<= 0: none), e.g. H2D_MAX_CTAS for copies over PCIe
inline LaunchConfig launch_config_for_width(const CopyParams& p, int32_t width, int sm_count, int max_ctas) {
  LaunchConfig c{};
  c.params = p;
  c.width = width;
  c.total_rows = num_entries(p) * rows_per_entry(p);
  const int64_t words = p.row_bytes / width;
  // TPR: a power of two <= 32 from the row length, so a 256-byte row of 16-byte words keeps 16 lanes busy
  // and a warp serves two rows; short rows do not leave most of a warp idle.
  c.tpr = words <= 4 ? 4 : words <= 8 ? 8 : words <= 16 ? 16 : 32;
  c.groups = kThreads / c.tpr;
  if (c.total_rows == 0 || p.row_bytes == 0) return c;  // ctas = 0: nothing to launch
  // Enough CTAs to keep every SM busy (4 resident CTAs of 256 threads each), never more than rows need;
  // rows beyond ctas * groups are taken by the kernel's grid-stride loop.
  int64_t ctas = (c.total_rows + c.groups - 1) / c.groups;
  const int64_t fill = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * kCtasPerSm;
  if (ctas > fill) ctas = fill;
  if (max_ctas > 0 && ctas > max_ctas) ctas = max_ctas;
  c.ctas = ctas;
  return c;
}

// Collapse the rows, pick the vector width from the alignment of every address and stride (copy_width()),
// then lanes and grid.
//   layer_ptrs_host: [num_layers] layer base addresses (only their alignment is read)
//   contig:          address of the contiguous side as the kernel sees it (only its alignment is read)
inline LaunchConfig kernel_launch_config(const CopyParams& params, const int64_t* layer_ptrs_host, int64_t contig,
                                         int sm_count, int max_ctas) {
  CopyParams p = params;
  collapse_rows(p);
  return launch_config_for_width(p, copy_width(p, layer_ptrs_host, contig), sm_count, max_ctas);
}

}  // namespace kvx::cuda
