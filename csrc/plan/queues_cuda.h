// queues_cuda.h - a CUDA engine's queues (queues.h) on streams, with pooled events. Compiled by nvcc only
// (KVX_WITH_CUDA); declared here so the bindings build with the host compiler.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "queues.h"

namespace kvx::cuda {

class EventPool;

// The four copy queues are four streams (handles); the compute stream is the one the forward runs on, set by the
// engine at each step (set_compute). Every operation is one CUDA API call of its own (record: cudaEventRecord,
// wait: cudaStreamWaitEvent, dma: the batched copies of copy_runs, reshape: the leg's kernel launches), on the
// current device; a failing call throws std::runtime_error naming it. Events come from a pool and go back to it
// when the last reference goes (a recorded event is reused only once no one can wait on it any more).
class CudaQueues : public Queues {
 public:
  explicit CudaQueues(const std::array<int64_t, 4>& streams);
  ~CudaQueues() override;
  void set_compute(int64_t stream) { compute_ = stream; }
  int64_t compute() const { return compute_; }
  int64_t stream(int32_t queue) const;
  EventPtr record(int32_t queue) override;
  void wait(int32_t queue, const EventPtr& event) override;
  void dma(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) override;
  void reshape(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) override;

 private:
  std::array<int64_t, 4> streams_;
  int64_t compute_ = 0;
  std::shared_ptr<EventPool> pool_;
};

// One stream for every queue (a one-off copy on the caller's stream): records and waits are nothing (the stream
// orders everything), a leg's DMA and launches go to the stream.
class StreamQueues : public Queues {
 public:
  explicit StreamQueues(int64_t stream) : stream_(stream) {}
  EventPtr record(int32_t) override { return passed_; }
  void wait(int32_t, const EventPtr&) override {}
  void dma(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) override;
  void reshape(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) override;

 private:
  int64_t stream_;
  EventPtr passed_ = std::make_shared<Event>();
};

}  // namespace kvx::cuda
