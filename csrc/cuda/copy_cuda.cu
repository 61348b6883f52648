// copy_cuda.cu - CUDA implementation of the paged <-> contiguous copy.
//
// One launch moves every (layer, plane, id) entry. Its work items are equal segments of every row (whole
// vector words of sizeof(VecT) bytes, 16 when every address and stride allows), numbered row-major; each
// thread moves kWordsPerLane words per pass of a grid-stride loop (all loads, then all stores), with streaming
// cache hints: the data is touched once, so it should not evict the model's working set from L2. Indices are
// divided in 32 bits by precomputed FastDivmods when the host proved they fit, else in 64 bits.
// The kernel's body is copy_thread() in copy_kernel.cuh and every launch decision (width, segments, index
// width and divisors, grid) is kernel_launch_config() in launch_config.h: the CPU emulation (copy_sim.cu, impl
// "cuda_sim") runs both as they are, so this file holds only what a GPU alone can run (streaming accesses,
// the launch, DMA).
// The contiguous side may be pinned host memory mapped into the device address space (UVA): the same
// kernel then reads/writes over PCIe, which is how small pages beat one DMA per block.
//
// copy_dma() is the other host<->device path: the copy as runs of contiguous bytes (for_each_run in
// kv_layout.h) handed to the copy engines, batched (cudaMemcpyBatchAsync) where the runtime has it. No
// SM is used; each run costs a DMA descriptor, so it wins once runs are large. kvx/kernels/dma.py picks
// between the two per call by a threshold measured on the device.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "copy_cuda.h"
#include "copy_kernel.cuh"

namespace kvx::cuda {
namespace {

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

// The device side of copy_thread()'s Access: streaming loads and stores, no checks.
struct StreamAccess {
  __device__ __forceinline__ void begin_pass() {}
  __device__ __forceinline__ void begin_item(int, int64_t, int64_t, int32_t) {}
  template <typename VecT>
  __device__ __forceinline__ VecT load(int, const VecT* p) {
    return load_stream(p);
  }
  template <typename VecT>
  __device__ __forceinline__ void store(int, VecT* p, VecT v) {
    store_stream(p, v);
  }
};

// The body is copy_thread() (copy_kernel.cuh), which the CPU emulation (copy_sim.cu) runs too.
// c:          the launch (kernel_launch_config()): collapsed params, items, divisors; read from the
//             parameter space in place (__grid_constant__: no per-thread copy)
// layer_ptrs: [num_layers] device-accessible layer base addresses
// ids:        [num_ids] block or slot ids
// contig:     base of the contiguous side [layers, planes, tokens, heads, row_bytes] (strided)
// __launch_bounds__(kThreads, kCtasPerSm): at most 64 registers, so the kCtasPerSm CTAs the grid is sized for
// fit on an SM together.
template <typename VecT, typename Index, int kWpl, bool kGatherDir>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    copy_kernel(const __grid_constant__ LaunchConfig c, const int64_t* __restrict__ layer_ptrs,
                const int64_t* __restrict__ ids, char* contig) {
  StreamAccess access;
  copy_thread<VecT, Index, kWpl, kGatherDir>(c, layer_ptrs, ids, contig, blockIdx.x, threadIdx.x, gridDim.x,
                                             access);
}

int sm_count_of_current() {
  static int cached[64] = {0};  // per device; a benign race at worst queries twice
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= 0 && dev < 64 && cached[dev] > 0) return cached[dev];
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) return 1;
  if (dev >= 0 && dev < 64) cached[dev] = n;
  return n;
}

}  // namespace

int copy(const CopyParams& params, const int64_t* layer_ptrs_host, const int64_t* layer_ptrs_dev,
         const int64_t* ids_dev, int64_t contig, int32_t direction, int64_t stream_handle, int max_ctas,
         LaunchConfig* used) {
  // Width, items, index width and grid from the one host function the emulation (copy_sim.cu) calls too.
  const LaunchConfig c = kernel_launch_config(params, layer_ptrs_host, contig, sm_count_of_current(), max_ctas);
  if (used != nullptr) *used = c;
  return launch(c, layer_ptrs_dev, ids_dev, contig, direction, stream_handle);
}

int launch(const LaunchConfig& c, const int64_t* layer_ptrs_dev, const int64_t* ids_dev, int64_t contig,
           int32_t direction, int64_t stream_handle) {
  if (c.ctas == 0) return cudaSuccess;
  char* base = reinterpret_cast<char*>(contig);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  with_kernel_types(c.width, c.index_bits, c.wpl, direction == kGather, [&](auto vec, auto index, auto wpl,
                                                                             auto gather) {
    using VecT = typename decltype(vec)::type;
    using Index = typename decltype(index)::type;
    copy_kernel<VecT, Index, decltype(wpl)::value, decltype(gather)::value>
        <<<static_cast<unsigned>(c.ctas), kThreads, 0, stream>>>(c, layer_ptrs_dev, ids_dev, base);
  });
  return cudaGetLastError();
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

namespace {

// Issue runs[0, n) on `stream`: batched where the runtime and driver allow it, else one cudaMemcpyAsync each.
cudaError_t issue_runs(Runs& runs, bool src_host, bool dst_host, cudaStream_t stream) {
  const size_t n = runs.sizes.size();
  // The batched API refuses the legacy default stream; copies there take one cudaMemcpyAsync per run.
  const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
#if CUDART_VERSION >= 12080
  if (!legacy && batch_usable.load(std::memory_order_relaxed)) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    cudaMemcpyAttributes attrs{};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources are written by earlier stream work
    attrs.srcLocHint = location(src_host, device);
    attrs.dstLocHint = location(dst_host, device);
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
  (void)src_host;
  (void)dst_host;
  return memcpy_runs(runs, 0, n, stream);
}

}  // namespace

int copy_runs(const int64_t* dsts, const int64_t* srcs, const int64_t* sizes, int64_t n, int64_t dst_base,
              int64_t src_base, bool src_host, bool dst_host, int64_t stream_handle) {
  thread_local Runs runs;  // reused: no allocation once a thread has seen its largest plan
  runs.dsts.clear();
  runs.srcs.clear();
  runs.sizes.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (sizes[i] <= 0) continue;
    runs.dsts.push_back(reinterpret_cast<void*>(dsts[i] + dst_base));
    runs.srcs.push_back(reinterpret_cast<void*>(srcs[i] + src_base));
    runs.sizes.push_back(static_cast<size_t>(sizes[i]));
  }
  if (runs.sizes.empty()) return cudaSuccess;
  return issue_runs(runs, src_host, dst_host, reinterpret_cast<cudaStream_t>(stream_handle));
}

int copy_dma(const CopyParams& p, const int64_t* layer_ptrs_host, const int64_t* ids_host, int64_t contig,
             bool contig_on_host, int32_t direction, int64_t stream_handle, int64_t min_run_bytes, bool* issued) {
  *issued = false;
  thread_local Runs runs;  // reused: no allocation once a thread has seen its largest copy
  runs.dsts.clear();
  runs.srcs.clear();
  runs.sizes.clear();
  // plan_runs() (kv_layout.h) is what kvx._C.plan_runs returns, so the CPU tests execute these very runs.
  const bool fits = plan_runs(p, layer_ptrs_host, ids_host, contig, direction, min_run_bytes,
                              [](int64_t dst, int64_t src, int64_t bytes) {
                                runs.dsts.push_back(reinterpret_cast<void*>(dst));
                                runs.srcs.push_back(reinterpret_cast<void*>(src));
                                runs.sizes.push_back(static_cast<size_t>(bytes));
                              });
  if (!fits) return cudaSuccess;  // runs too small on average: the caller launches the kernel instead
  *issued = true;
  const bool gather = direction == kGather;
  return issue_runs(runs, gather ? false : contig_on_host, gather ? contig_on_host : false,
                    reinterpret_cast<cudaStream_t>(stream_handle));
}

int sm_count() { return sm_count_of_current(); }

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
