// copy_cuda.cu - CUDA implementation of the paged <-> contiguous copy.
//
// One launch moves every (layer, plane, id) entry. Rows (see kv_layout.h) are split over groups of
// `TPR` lanes (TPR = threads per row, a power of two <= 32 chosen from the row length, so a 256-byte
// row of 16-byte words keeps 16 lanes busy and a warp serves two rows). Each lane moves one vector word
// of width sizeof(VecT) (16 bytes when every address and stride allows) per iteration, with streaming
// cache hints: the data is touched once, so it should not evict the model's working set from L2.
// The contiguous side may be pinned host memory mapped into the device address space (UVA): the same
// kernel then reads/writes over PCIe, which is how small pages beat one DMA per block.
//
// copy_dma() is the other host<->device path: the copy as runs of contiguous bytes (for_each_run in
// kv_layout.h) handed to the copy engines, batched (cudaMemcpyBatchAsync) where the runtime has it. No
// SM is used; each run costs a DMA descriptor, so it wins once runs are large. kvx/ops.py picks between
// the two per call by a threshold measured on the device.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "copy_cuda.h"

namespace kvx::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps per CTA

template <typename VecT>
__device__ __forceinline__ VecT load_stream(const VecT* p) {
  return __ldcs(p);
}
template <>
__device__ __forceinline__ uint8_t load_stream<uint8_t>(const uint8_t* p) {
  return *p;  // no __ldcs overload for 8-bit types
}
template <>
__device__ __forceinline__ uint16_t load_stream<uint16_t>(const uint16_t* p) {
  return __ldcs(reinterpret_cast<const unsigned short*>(p));
}

template <typename VecT>
__device__ __forceinline__ void store_stream(VecT* p, VecT v) {
  __stcs(p, v);
}
template <>
__device__ __forceinline__ void store_stream<uint8_t>(uint8_t* p, uint8_t v) {
  *p = v;
}
template <>
__device__ __forceinline__ void store_stream<uint16_t>(uint16_t* p, uint16_t v) {
  __stcs(reinterpret_cast<unsigned short*>(p), v);
}

// layer_ptrs: [num_layers] device-accessible layer base addresses
// ids:        [num_ids] block or slot ids
// contig:     base of the contiguous side [layers, planes, tokens, heads, row_bytes] (strided)
template <typename VecT, int TPR>
__global__ void __launch_bounds__(kThreads) copy_kernel(CopyParams p, const int64_t* __restrict__ layer_ptrs,
                                                        const int64_t* __restrict__ ids, char* contig,
                                                        bool gather) {
  constexpr int kGroups = kThreads / TPR;  // row groups per CTA
  const int lane = threadIdx.x % TPR;
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(VecT));
  const int64_t rpe = rows_per_entry(p);
  const int64_t total = num_entries(p) * rpe;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kGroups + threadIdx.x / TPR; row < total;
       row += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t e = row / rpe, r = row - e * rpe;
    int32_t layer;
    int64_t paged_off, contig_off;
    if (!entry_offsets(p, e, ids, &layer, &paged_off, &contig_off)) continue;
    char* paged = reinterpret_cast<char*>(layer_ptrs[layer]) + paged_off + row_paged_offset(p, r);
    char* flat = contig + contig_off + row_contig_offset(p, r);
    const VecT* src = reinterpret_cast<const VecT*>(gather ? paged : flat);
    VecT* dst = reinterpret_cast<VecT*>(gather ? flat : paged);
    // Four loads in flight per lane before their stores: a read of mapped host memory waits a PCIe round
    // trip (~1 us), so with one load per lane a CTA cap of 8 would leave the link mostly idle. Named
    // values, not an array: an array of uint4 made ptxas spill (sm_90, 40 registers).
    int64_t w = lane;
    for (; w + 3 * TPR < words; w += 4 * TPR) {
      const VecT v0 = load_stream(src + w), v1 = load_stream(src + w + TPR), v2 = load_stream(src + w + 2 * TPR),
                 v3 = load_stream(src + w + 3 * TPR);
      store_stream(dst + w, v0);
      store_stream(dst + w + TPR, v1);
      store_stream(dst + w + 2 * TPR, v2);
      store_stream(dst + w + 3 * TPR, v3);
    }
    for (; w < words; w += TPR) store_stream(dst + w, load_stream(src + w));
  }
}

int sm_count() {
  static int cached[64] = {0};  // per device; a benign race at worst queries twice
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= 0 && dev < 64 && cached[dev] > 0) return cached[dev];
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) return 1;
  if (dev >= 0 && dev < 64) cached[dev] = n;
  return n;
}

template <typename VecT, int TPR>
cudaError_t launch_tpr(const CopyParams& p, const int64_t* layer_ptrs, const int64_t* ids, char* contig,
                       bool gather, int64_t total_rows, int max_ctas, cudaStream_t stream) {
  constexpr int kGroups = kThreads / TPR;
  // Enough CTAs to keep every SM busy (4 resident CTAs of 256 threads each), never more than rows need.
  int64_t ctas = (total_rows + kGroups - 1) / kGroups;
  int64_t fill = static_cast<int64_t>(sm_count()) * 4;
  if (ctas > fill) ctas = fill;
  if (max_ctas > 0 && ctas > max_ctas) ctas = max_ctas;
  copy_kernel<VecT, TPR><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(p, layer_ptrs, ids, contig, gather);
  return cudaGetLastError();
}

template <typename VecT>
cudaError_t launch(const CopyParams& p, const int64_t* layer_ptrs, const int64_t* ids, char* contig,
                   bool gather, int64_t total_rows, int max_ctas, cudaStream_t stream) {
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(VecT));
  if (words <= 4) return launch_tpr<VecT, 4>(p, layer_ptrs, ids, contig, gather, total_rows, max_ctas, stream);
  if (words <= 8) return launch_tpr<VecT, 8>(p, layer_ptrs, ids, contig, gather, total_rows, max_ctas, stream);
  if (words <= 16) return launch_tpr<VecT, 16>(p, layer_ptrs, ids, contig, gather, total_rows, max_ctas, stream);
  return launch_tpr<VecT, 32>(p, layer_ptrs, ids, contig, gather, total_rows, max_ctas, stream);
}

}  // namespace

int copy(const CopyParams& params, const int64_t* layer_ptrs_host, const int64_t* layer_ptrs_dev,
         const int64_t* ids_dev, int64_t contig, int32_t direction, int64_t stream_handle, int max_ctas) {
  CopyParams p = params;
  collapse_rows(p);
  const int64_t total_rows = num_entries(p) * rows_per_entry(p);
  if (total_rows == 0 || p.row_bytes == 0) return cudaSuccess;
  const bool gather = direction == kGather;
  char* base = reinterpret_cast<char*>(contig);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (copy_width(p, layer_ptrs_host, contig)) {
    case 16: return launch<uint4>(p, layer_ptrs_dev, ids_dev, base, gather, total_rows, max_ctas, stream);
    case 8: return launch<uint2>(p, layer_ptrs_dev, ids_dev, base, gather, total_rows, max_ctas, stream);
    case 4: return launch<uint32_t>(p, layer_ptrs_dev, ids_dev, base, gather, total_rows, max_ctas, stream);
    case 2: return launch<uint16_t>(p, layer_ptrs_dev, ids_dev, base, gather, total_rows, max_ctas, stream);
    default: return launch<uint8_t>(p, layer_ptrs_dev, ids_dev, base, gather, total_rows, max_ctas, stream);
  }
}

namespace {

// Copies per cudaMemcpyBatchAsync call. The API documents no limit; chunking bounds the argument arrays
// one call walks, and 4096 runs of even 4 KiB are 16 MiB, far past where the per-call cost matters.
constexpr size_t kMaxBatch = 4096;

// Cleared when the driver refuses batched copies (older than the runtime kvx was built with): every
// later call then goes straight to one cudaMemcpyAsync per run.
std::atomic<bool> batch_usable{CUDART_VERSION >= 12080};

struct Runs {
  std::vector<void*> dsts;
  std::vector<void*> srcs;
  std::vector<size_t> sizes;
};

cudaError_t memcpy_runs(const Runs& runs, size_t begin, size_t end, cudaStream_t stream) {
  for (size_t i = begin; i < end; ++i) {
    cudaError_t err = cudaMemcpyAsync(runs.dsts[i], runs.srcs[i], runs.sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) {
      cudaGetLastError();  // returned to the caller; cleared so that no later launch check reports it again
      return err;
    }
  }
  return cudaSuccess;
}

#if CUDART_VERSION >= 12080
cudaError_t memcpy_batch(Runs& runs, size_t begin, size_t end, cudaMemcpyAttributes* attrs, cudaStream_t stream) {
  size_t attrs_idx = 0;  // attrs[0] applies to every copy of the batch
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(runs.dsts.data() + begin, const_cast<const void* const*>(runs.srcs.data() + begin),
                              runs.sizes.data() + begin, end - begin, attrs, &attrs_idx, 1, stream);
#else  // CUDA 12.8 / 12.9: non-const arrays and a failIdx out-parameter
  size_t fail_idx = 0;
  return cudaMemcpyBatchAsync(runs.dsts.data() + begin, runs.srcs.data() + begin, runs.sizes.data() + begin,
                              end - begin, attrs, &attrs_idx, 1, &fail_idx, stream);
#endif
}

// Where one side of the copies lives (a hint: the driver uses it for memory without a fixed home).
cudaMemLocation location(bool host, int device) {
  cudaMemLocation loc{};
  loc.type = host ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
  loc.id = host ? 0 : device;
  return loc;
}
#endif

}  // namespace

int copy_dma(const CopyParams& p, const int64_t* layer_ptrs_host, const int64_t* ids_host, int64_t contig,
             bool contig_on_host, int32_t direction, int64_t stream_handle, int64_t min_run_bytes, bool* issued) {
  *issued = false;
  thread_local Runs runs;  // reused: no allocation once a thread has seen its largest copy
  runs.dsts.clear();
  runs.srcs.clear();
  runs.sizes.clear();
  const int64_t max_runs = max_runs_for(payload_bytes(p, ids_host), min_run_bytes);
  const bool fits = for_each_run(p, layer_ptrs_host, ids_host, contig, direction, max_runs,
                                 [](int64_t dst, int64_t src, int64_t bytes) {
                                   runs.dsts.push_back(reinterpret_cast<void*>(dst));
                                   runs.srcs.push_back(reinterpret_cast<void*>(src));
                                   runs.sizes.push_back(static_cast<size_t>(bytes));
                                 });
  if (!fits) return cudaSuccess;  // runs too small on average: the caller launches the kernel instead
  *issued = true;
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const size_t n = runs.sizes.size();
  // The batched API refuses the legacy default stream; copies there take one cudaMemcpyAsync per run.
  const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
#if CUDART_VERSION >= 12080
  if (!legacy && batch_usable.load(std::memory_order_relaxed)) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const bool gather = direction == kGather;
    cudaMemcpyAttributes attrs{};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources are written by earlier stream work
    attrs.srcLocHint = location(gather ? false : contig_on_host, device);
    attrs.dstLocHint = location(gather ? contig_on_host : false, device);
    attrs.flags = cudaMemcpyFlagDefault;
    for (size_t begin = 0; begin < n; begin += kMaxBatch) {
      const size_t end = begin + kMaxBatch < n ? begin + kMaxBatch : n;
      err = memcpy_batch(runs, begin, end, &attrs, stream);
      if (err == cudaSuccess) continue;
      cudaGetLastError();  // not sticky; clear it so no later launch check reports it
      if (err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver)
        batch_usable.store(false, std::memory_order_relaxed);
      // Re-issue this chunk one run at a time (copies already enqueued rewrite the same bytes: no run
      // reads what another writes). A real error in the runs shows up there.
      err = memcpy_runs(runs, begin, end, stream);
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  }
#endif
  (void)legacy;
  (void)contig_on_host;
  return memcpy_runs(runs, 0, n, stream);
}

bool batch_memcpy_available() { return batch_usable.load(std::memory_order_relaxed); }

int memcpy_each(const int64_t* dsts, const int64_t* srcs, const int64_t* sizes, int64_t n, int64_t stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < n; ++i) {
    cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]),
                                      static_cast<size_t>(sizes[i]), cudaMemcpyDefault, s);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

int host_device_pointer(int64_t host_ptr, int64_t* out) {
  void* dev = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(host_ptr), 0);
  *out = err == cudaSuccess ? reinterpret_cast<int64_t>(dev) : 0;
  return err;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace kvx::cuda
