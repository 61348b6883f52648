// copy_cuda.cu - CUDA implementation of the paged <-> contiguous copy.
//
// One launch moves every (layer, plane, id) entry. Rows (see kv_layout.h) are split over groups of
// `TPR` lanes (TPR = threads per row, a power of two <= 32 chosen from the row length, so a 256-byte
// row of 16-byte words keeps 16 lanes busy and a warp serves two rows). Each lane moves one vector word
// of width sizeof(VecT) (16 bytes when every address and stride allows) per iteration, with streaming
// cache hints: the data is touched once, so it should not evict the model's working set from L2.
// The contiguous side may be pinned host memory mapped into the device address space (UVA): the same
// kernel then reads/writes over PCIe, which is how small pages beat one DMA per block.
#include <cuda_runtime.h>

#include <cstdint>

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
    for (int64_t w = lane; w < words; w += TPR) store_stream(dst + w, load_stream(src + w));
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
