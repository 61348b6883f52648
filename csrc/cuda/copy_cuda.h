// copy_cuda.h - CUDA implementation of the paged <-> contiguous copy (torch-free launchers).
// Compiled by nvcc only when the CUDA toolchain is present (KVX_WITH_CUDA); declared here so the
// bindings can be built by the host compiler.
#pragma once

#include <cstdint>

#include "../kv_layout.h"
#include "launch_config.h"

namespace kvx::cuda {

// Launch the copy kernel on `stream` (a cudaStream_t as an integer; 0 = legacy default stream).
// One launch covers every layer, plane and id. Returns a cudaError_t (0 = success); never syncs.
//   layer_ptrs_host: [num_layers] host copy of the layer base addresses (alignment, no deref)
//   layer_ptrs_dev:  [num_layers] the same table in device-accessible memory
//   ids_dev:         [num_ids] int64 block or slot ids in device-accessible memory
//   contig:          device-accessible address of the contiguous side (device or mapped host memory)
//   max_ctas:        cap on thread blocks (<= 0: enough to fill the device), for background copies
//   used:            if not null, receives the launch decisions (kernel_launch_config(), launch_config.h)
int copy(const CopyParams& p, const int64_t* layer_ptrs_host, const int64_t* layer_ptrs_dev,
         const int64_t* ids_dev, int64_t contig, int32_t direction, int64_t stream, int max_ctas,
         LaunchConfig* used = nullptr);

// Launch the copy kernel as `c` (kernel_launch_config(), decided when a plan was built) on `stream`. Nothing is
// computed here: the launch a plan's leg issues per layer. Returns a cudaError_t; never syncs.
//   layer_ptrs_dev: [c.params.num_layers] layer base addresses in device-accessible memory
//   ids_dev:        [c.params.num_ids] int64 ids in device-accessible memory
//   contig:         device-accessible address of the contiguous side
int launch(const LaunchConfig& c, const int64_t* layer_ptrs_dev, const int64_t* ids_dev, int64_t contig,
           int32_t direction, int64_t stream);

// Issue the copy as DMA on `stream`: its runs of contiguous bytes (for_each_run in kv_layout.h), with
// cudaMemcpyBatchAsync (CUDA >= 12.8, any stream but the legacy default one; chunks of 4096 runs) or one
// cudaMemcpyAsync per run. Only when the runs average at least `min_run_bytes` (<= 0: always); otherwise
// nothing is issued and *issued = false, so the caller launches copy() instead. Returns a cudaError_t;
// never syncs.
//   layer_ptrs_host: [num_layers] layer base addresses (device memory), host array
//   ids_host:        [num_ids] int64 block or slot ids, host array
//   contig:          address of the contiguous side (pinned host or device memory; not the device alias)
//   contig_on_host:  whether `contig` is host memory (the location hint of the batched copies)
int copy_dma(const CopyParams& p, const int64_t* layer_ptrs_host, const int64_t* ids_host, int64_t contig,
             bool contig_on_host, int32_t direction, int64_t stream, int64_t min_run_bytes, bool* issued);

// Issue a DMA plan on `stream`: `sizes[i]` bytes from `srcs[i] + src_base` to `dsts[i] + dst_base`, with
// cudaMemcpyBatchAsync (CUDA >= 12.8, any stream but the legacy default one; chunks of 4096 runs) or one
// cudaMemcpyAsync per run. The staged path's host <-> staging copies and the direct path's host <-> block copies
// of a layer group are one call each (kvx/kernels/staged.py builds the arrays once per batch; a base lets one list
// serve whichever staging buffer the ring hands out). Returns a cudaError_t; never syncs. cpu::copy_runs is the
// same plan run by memcpy.
//   dsts, srcs, sizes: [n] int64 host arrays
//   src_host, dst_host: where each side lives (the batched copies' location hints)
int copy_runs(const int64_t* dsts, const int64_t* srcs, const int64_t* sizes, int64_t n, int64_t dst_base,
              int64_t src_base, bool src_host, bool dst_host, int64_t stream);

// SMs of the current device (cached per device; 1 when it cannot be read): the grid's fill cap.
int sm_count();

// Whether copy_dma() batches its runs: built with CUDA >= 12.8 and the driver has not refused it.
bool batch_memcpy_available();

// Baseline for benchmarks: one cudaMemcpyAsync per (dst, src, bytes) triple, host arrays.
int memcpy_each(const int64_t* dsts, const int64_t* srcs, const int64_t* sizes, int64_t n,
                int64_t stream);

// Device alias of a pinned (cudaHostAlloc / cudaHostRegister'ed) host address; *out = 0 on error.
int host_device_pointer(int64_t host_ptr, int64_t* out);

// Number of visible CUDA devices (0 when there is no driver or device).
int device_count();

const char* error_string(int err);

}  // namespace kvx::cuda
