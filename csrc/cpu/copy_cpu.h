// copy_cpu.h - multi-threaded CPU implementation of the paged <-> contiguous copy.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../kv_layout.h"

namespace kvx::cpu {

// Copy every row described by `p` in `direction` (kGather: paged -> contiguous).
//   layer_ptrs: [num_layers] base address of each layer's paged cache
//   ids:        [num_ids] block ids (kBlocks) or slot ids, negative = padding (kSlots)
//   contig:     base address of the contiguous side
// Runs on up to `num_threads` threads (<= 0: the pool's default). Call without the GIL held.
void copy(const CopyParams& p, const int64_t* layer_ptrs, const int64_t* ids, int64_t contig,
          int32_t direction, int num_threads);

// Several copies that share everything but their id list and contiguous buffer (ids[s]: num_ids[s] ids,
// contig[s]: the buffer's address; p.num_ids is ignored), in one parallel region of the pool: a batch of
// small copies (a layer of every chunk of a step) wakes the pool once, not once per copy. `whole_bytes`:
// the bytes of the whole transfer these copies are part of (every layer of a layer-wise load), which
// decides streaming stores as this call's own bytes do (0: this call alone).
void copy_many(const CopyParams& p, const int64_t* layer_ptrs, const int64_t* const* ids, const int64_t* num_ids,
               const int64_t* contig, int64_t count, int32_t direction, int num_threads, int64_t whole_bytes);

// Plain memcpy split over the same thread pool: the roof the benchmarks compare against.
void parallel_memcpy(void* dst, const void* src, size_t bytes, int num_threads);

// The runs of a DMA plan executed on the CPU, in order: `sizes[i]` bytes from `srcs[i] + src_base` to
// `dsts[i] + dst_base` (what the CUDA copy engines do with the same arrays, cuda::copy_runs). A base lets one
// run list serve every staging buffer: offsets on the staging side, absolute addresses on the other.
// num_threads 1: the calling thread alone, no pool (kvx.kernels.ops.host_copy on I/O threads).
//   dsts, srcs, sizes: [n] int64
void copy_runs(const int64_t* dsts, const int64_t* srcs, const int64_t* sizes, int64_t n, int64_t dst_base,
               int64_t src_base, int num_threads);

// Commit the pages of [addr, addr + bytes) now (Linux MADV_POPULATE_WRITE, 5.14+), split over the
// thread pool, so later writes take no page faults; contents are unchanged. Only whole pages inside the
// range are touched. Returns 0 or an errno (EINVAL: kernel too old; ENOSYS: not Linux). Call without
// the GIL held.
int populate_write(void* addr, size_t bytes, int num_threads);

int get_num_threads();
void set_num_threads(int n);

}  // namespace kvx::cpu
