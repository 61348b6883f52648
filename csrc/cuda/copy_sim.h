// copy_sim.h - the CUDA copy kernel emulated on the CPU, with checked memory accesses (impl "cuda_sim").
// Compiled by nvcc (copy_sim.cu runs the kernel body of copy_kernel.cuh as host code), so it exists only
// when the CUDA kernels are built (KVX_WITH_CUDA); declared here so the bindings build with the host
// compiler.
#pragma once

#include <cstdint>
#include <string>

#include "../kv_layout.h"
#include "launch_config.h"

namespace kvx::cuda {

// What one emulated launch did, for the tests that hold the emulation to the launcher's decisions.
struct SimReport {
  LaunchConfig config;            // the launch emulated (kernel_launch_config(), or the forced width's)
  int64_t threads = 0;            // threads run: config.ctas * kThreads
  int64_t item_visits = 0;        // work items (vector words) located and copied: padding slots' are skipped
  int64_t passes_per_thread = 0;  // most grid-stride passes one thread made (> 1: the loop came round)
  int64_t accesses = 0;           // vector loads plus stores
  std::string fault;              // empty, or the first violation (the emulation stopped there)
};

// Run every thread of every CTA of the copy kernel's launch for `p` on the CPU, in order, on CPU memory.
// Each vector load/store is checked before it is made: its address must be a multiple of the vector width,
// [addr, addr + width) must lie inside the buffer the access belongs to (the source or destination side),
// and no destination byte may be written twice in one launch (two threads racing for it on a GPU).
// The first violation stops the emulation (nothing of that access is read or written) and is described in
// SimReport::fault.
//   layer_ptrs:   [num_layers] layer base addresses
//   layer_bounds: [num_layers, 2] byte range [lo, hi) each layer's accesses must stay in
//   ids:          [num_ids] block ids (kBlocks) or slot ids, negative = padding (kSlots)
//   contig:       address of the contiguous side; its accesses must stay in [contig_lo, contig_hi)
//   sm_count:     the emulated device's SMs (the grid's fill cap is kCtasPerSm per SM)
//   max_ctas:     the caller's cap on CTAs (<= 0: none), as kvx::cuda::copy() takes it
//   force_width:  0, or a vector width in bytes to use instead of copy_width()'s (tests of the checker)
//   index32_limit: launch_config_for_width()'s test knob (kIndex32Limit: the launcher's choice)
SimReport simulate_copy(const CopyParams& p, const int64_t* layer_ptrs, const int64_t* layer_bounds,
                        const int64_t* ids, int64_t contig, int64_t contig_lo, int64_t contig_hi,
                        int32_t direction, int sm_count, int max_ctas, int force_width,
                        int64_t index32_limit = kIndex32Limit);

}  // namespace kvx::cuda
