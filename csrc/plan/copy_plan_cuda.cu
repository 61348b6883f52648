// copy_plan_cuda.cu - the CUDA executors of a copy plan (copy_plan.h): a leg's DMA runs and kernel launches as
// planned, on a stream. Nothing is computed here but the staging base added to the runs.
#include <cuda_runtime.h>

#include "../cuda/copy_cuda.h"
#include "copy_plan.h"

namespace kvx {

int CopyPlan::dma_cuda(int32_t leg, int64_t staging, int64_t stream) const {
  const Leg& p = legs_.at(leg);
  const int64_t n = p.run_hi - p.run_lo;
  if (n <= 0) return cudaSuccess;
  const bool host = !copies_.empty() && copies_[0].on_host;
  const bool g = gather();
  return cuda::copy_runs(run_dst_.data() + p.run_lo, run_src_.data() + p.run_lo, run_bytes_.data() + p.run_lo, n,
                         dst_staged() ? staging : 0, src_staged() ? staging : 0, /*src_host=*/!g && host,
                         /*dst_host=*/g && host, stream);
}

int CopyPlan::reshape_cuda(int32_t leg, int64_t staging, int64_t stream) {
  const Leg& p = legs_.at(leg);
  if (p.launch_lo == p.launch_hi) return cudaSuccess;
  if (path_ == kPathStaged && staging % 16) return cudaErrorMisalignedAddress;  // the launches assume 16
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (!ids_.empty() && take_upload()) {  // the id table, once, on the stream every reshape of the plan runs on
    void* d = nullptr;
    const size_t bytes = ids_.size() * sizeof(int64_t);
    cudaError_t err = cudaMallocAsync(&d, bytes, s);
    if (err != cudaSuccess) return err;
    err = cudaMemcpyAsync(d, ids_.data(), bytes, cudaMemcpyHostToDevice, s);
    if (err != cudaSuccess) {
      cudaFreeAsync(d, s);
      return err;
    }
    ids_dev_ = reinterpret_cast<int64_t>(d);
    ids_stream_ = stream;
    own_ids_ = true;
  }
  const int64_t base = path_ == kPathStaged ? staging : 0;
  const auto* layers = reinterpret_cast<const int64_t*>(layer_ptrs_dev_);
  const auto* ids = reinterpret_cast<const int64_t*>(ids_dev_);
  for (int32_t i = p.launch_lo; i < p.launch_hi; ++i) {
    const Launch& l = launches_[i];
    const int err = cuda::launch(l.config, layers + l.first_layer, ids + l.ids_at, base + l.contig, l.direction, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

CopyPlan::~CopyPlan() {
  if (own_ids_) {  // stream-ordered: after the last launch that reads the ids
    cudaFreeAsync(reinterpret_cast<void*>(ids_dev_), reinterpret_cast<cudaStream_t>(ids_stream_));
    cudaGetLastError();
  }
}

}  // namespace kvx
