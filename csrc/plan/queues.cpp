// queues.cpp - the compiled issue path (queues.h): the order of a plan's jobs, the staging ring, NullQueues.
#include "queues.h"

#include <stdexcept>
#include <string>

namespace kvx {

// ---------------------------------------------------------------- NullQueues
EventPtr NullQueues::record(int32_t) {
  ++records;
  return passed_;
}

void NullQueues::wait(int32_t, const EventPtr& event) {
  if (event) ++waits;
}

void NullQueues::dma(int32_t, const PlanPtr& plan, int32_t leg, int64_t) {
  const Leg& p = plan->legs().at(leg);
  const int64_t n = p.run_hi - p.run_lo;
  if (n > 0) dma_calls += (n + 4095) / 4096;  // cudaMemcpyBatchAsync takes 4096 runs a call (copy_cuda.cu)
}

void NullQueues::reshape(int32_t, const PlanPtr& plan, int32_t leg, int64_t) {
  const Leg& p = plan->legs().at(leg);
  if (p.launch_lo == p.launch_hi) return;
  // a CUDA executor uploads the id table at the plan's first reshape: cudaMallocAsync + cudaMemcpyAsync
  if (!plan->ids().empty() && plan->take_upload()) uploads += 2;
  for (int32_t i = p.launch_lo; i < p.launch_hi; ++i)
    if (plan->launches()[i].config.ctas > 0) ++launches;  // a launch with nothing to copy is not made
}

// ---------------------------------------------------------------- StagingRing
StagingRing::StagingRing(std::vector<int64_t> buffers, int64_t capacity)
    : buffers_(std::move(buffers)), capacity_(capacity), users_(buffers_.size()) {
  if (buffers_.empty() || capacity < 1)
    throw std::invalid_argument("count, capacity: expected >= 1, got " + std::to_string(buffers_.size()) + ", " +
                                std::to_string(capacity));
}

int32_t StagingRing::acquire(std::vector<EventPtr>* users) {
  const int32_t i = next_;
  next_ = (i + 1) % count();
  users->clear();
  if (rule5) users->swap(users_[i]);
  users_[i].clear();
  return i;
}

void StagingRing::note(int32_t index, const EventPtr& user) {
  if (user) users_.at(index).push_back(user);
}

// ---------------------------------------------------------------- issue
namespace {

void check_legs(const CopyPlan& plan, int32_t lo, int32_t hi) {
  const int32_t n = static_cast<int32_t>(plan.legs().size());
  if (!(0 <= lo && lo <= hi && hi <= n))
    throw std::out_of_range("legs: expected 0 <= lo <= hi <= " + std::to_string(n) + ", got " + std::to_string(lo) +
                            ", " + std::to_string(hi));
}

void check_ring(const CopyPlan& plan, int32_t lo, int32_t hi, StagingRing* ring) {
  check_legs(plan, lo, hi);
  if (plan.path() != kPathStaged || lo == hi) return;
  if (ring == nullptr) throw std::invalid_argument("ring: path staged needs a staging ring, got none");
  for (int32_t k = lo; k < hi; ++k)
    if (plan.legs()[k].nbytes > ring->capacity())
      throw std::invalid_argument("ring: a leg of " + std::to_string(plan.legs()[k].nbytes) +
                                  " bytes exceeds the ring's buffers of " + std::to_string(ring->capacity()));
}

}  // namespace

void issue_load(Queues& q, const PlanPtr& plan, StagingRing* ring, int32_t lo, int32_t hi,
                const std::vector<EventPtr>& after) {
  check_ring(*plan, lo, hi, ring);
  std::vector<EventPtr> users;
  for (int32_t k = lo; k < hi; ++k) {
    EventPtr job;
    if (plan->path() == kPathStaged) {
      const int32_t i = ring->acquire(&users);
      const int64_t buf = ring->address(i);
      for (const EventPtr& u : users) q.wait(kQueueH2D, u);  // rule 5: the reshape that last read the buffer
      q.dma(kQueueH2D, plan, k, buf);
      EventPtr fill = q.record(kQueueH2D);
      if (k == lo)
        for (const EventPtr& e : after) q.wait(kQueueLoad, e);  // rule 1
      q.wait(kQueueLoad, fill);
      q.reshape(kQueueLoad, plan, k, buf);
      job = q.record(kQueueLoad);
      ring->note(i, job);  // the next DMA into it (on h2d, after this one's) follows the reshape
    } else {
      if (k == lo)
        for (const EventPtr& e : after) q.wait(kQueueLoad, e);
      if (plan->path() == kPathDma)
        q.dma(kQueueLoad, plan, k, 0);
      else
        q.reshape(kQueueLoad, plan, k, 0);
      job = q.record(kQueueLoad);
    }
    plan->touched[k] = job;
    plan->done[k] = job;
  }
}

void issue_save(Queues& q, const PlanPtr& plan, StagingRing* ring, int32_t lo, int32_t hi,
                const std::vector<EventPtr>& after, bool marker) {
  check_ring(*plan, lo, hi, ring);
  if (lo == hi) return;
  std::vector<EventPtr> edges = after;
  if (marker) edges.insert(edges.begin(), q.record(kQueueCompute));  // rule 2
  std::vector<EventPtr> users;
  for (int32_t k = lo; k < hi; ++k) {
    if (k == lo)
      for (const EventPtr& e : edges) q.wait(kQueueSave, e);
    if (plan->path() == kPathStaged) {
      const int32_t i = ring->acquire(&users);
      const int64_t buf = ring->address(i);
      for (const EventPtr& u : users) q.wait(kQueueSave, u);  // rule 5: the DMA that last emptied the buffer
      q.reshape(kQueueSave, plan, k, buf);
      EventPtr reader = q.record(kQueueSave);
      q.wait(kQueueD2H, reader);
      q.dma(kQueueD2H, plan, k, buf);
      EventPtr job = q.record(kQueueD2H);
      ring->note(i, job);  // the next gather into it (on save, after this one's) follows the DMA
      plan->touched[k] = reader;
      plan->done[k] = job;
    } else {
      if (plan->path() == kPathDma)
        q.dma(kQueueSave, plan, k, 0);
      else
        q.reshape(kQueueSave, plan, k, 0);
      EventPtr job = q.record(kQueueSave);
      plan->touched[k] = job;
      plan->done[k] = job;
    }
  }
}

void fence(Queues& q, const CopyPlan& plan, int32_t lo, int32_t hi) {
  check_legs(plan, lo, hi);
  for (int32_t k = lo; k < hi; ++k)
    if (plan.touched[k]) q.wait(kQueueCompute, plan.touched[k]);
}

void issue_in_order(Queues& q, const PlanPtr& plan, int64_t staging, int32_t lo, int32_t hi) {
  check_legs(*plan, lo, hi);
  for (int32_t k = lo; k < hi; ++k) {
    const int32_t queue = plan->gather() ? kQueueSave : kQueueLoad;
    if (plan->path() == kPathDma) {
      q.dma(queue, plan, k, 0);
    } else if (plan->path() == kPathKernel) {
      q.reshape(queue, plan, k, 0);
    } else if (plan->gather()) {
      q.reshape(queue, plan, k, staging);
      q.dma(queue, plan, k, staging);
    } else {
      q.dma(queue, plan, k, staging);
      q.reshape(queue, plan, k, staging);
    }
  }
}

}  // namespace kvx
