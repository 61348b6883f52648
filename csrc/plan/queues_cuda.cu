// queues_cuda.cu - CudaQueues and StreamQueues (queues_cuda.h).
#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "queues_cuda.h"

namespace kvx::cuda {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("kvx CUDA ") + what + " failed: " + cudaGetErrorString(err) +
                             " (cudaError " + std::to_string(static_cast<int>(err)) + ")");
  }
}

}  // namespace

class EventPool {
 public:
  cudaEvent_t take() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return e;
  }
  void give(cudaEvent_t e) {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(e);
  }
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

class CudaEvent : public Event {
 public:
  CudaEvent(cudaEvent_t e, std::shared_ptr<EventPool> pool) : event(e), pool_(std::move(pool)) {}
  ~CudaEvent() override { pool_->give(event); }
  bool query() override {
    const cudaError_t err = cudaEventQuery(event);
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    check(err, "cudaEventQuery");
    return true;
  }
  void synchronize() override { check(cudaEventSynchronize(event), "cudaEventSynchronize"); }
  cudaEvent_t event;

 private:
  std::shared_ptr<EventPool> pool_;
};

CudaQueues::CudaQueues(const std::array<int64_t, 4>& streams)
    : streams_(streams), pool_(std::make_shared<EventPool>()) {}

CudaQueues::~CudaQueues() = default;

int64_t CudaQueues::stream(int32_t queue) const {
  if (queue == kQueueCompute) return compute_;
  if (queue < 0 || queue > 3) throw std::invalid_argument("queue: expected 0..4, got " + std::to_string(queue));
  return streams_[queue];
}

EventPtr CudaQueues::record(int32_t queue) {
  cudaEvent_t e = pool_->take();
  auto ev = std::make_shared<CudaEvent>(e, pool_);
  check(cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream(queue))), "cudaEventRecord");
  return ev;
}

void CudaQueues::wait(int32_t queue, const EventPtr& event) {
  auto* e = dynamic_cast<CudaEvent*>(event.get());
  if (e == nullptr) return;  // a point already passed
  check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream(queue)), e->event, 0), "cudaStreamWaitEvent");
}

void CudaQueues::dma(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) {
  check(static_cast<cudaError_t>(plan->dma_cuda(leg, staging, stream(queue))), "DMA runs");
}

void CudaQueues::reshape(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) {
  if (plan->impl() != kImplCuda) throw std::invalid_argument("reshape: a CUDA engine runs plans of impl cuda only");
  check(static_cast<cudaError_t>(plan->reshape_cuda(leg, staging, stream(queue))), "copy launch");
}

void StreamQueues::dma(int32_t, const PlanPtr& plan, int32_t leg, int64_t staging) {
  check(static_cast<cudaError_t>(plan->dma_cuda(leg, staging, stream_)), "DMA runs");
}

void StreamQueues::reshape(int32_t, const PlanPtr& plan, int32_t leg, int64_t staging) {
  check(static_cast<cudaError_t>(plan->reshape_cuda(leg, staging, stream_)), "copy launch");
}

}  // namespace kvx::cuda
