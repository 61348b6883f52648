// queues.h - where a plan's legs run, and the order between them: the compiled issue path.
//
// A transfer engine (kvx/engine.py) has four copy queues beside the compute stream: `load` (copies that write
// blocks), `save` (copies that read blocks), `h2d` and `d2h` (the DMAs of staged copies). The issue functions
// below put a plan's legs on them with the ordering rules of kvx.engine.BlockOrder that concern one plan:
//
//   rule 1 / 2: a plan's first leg follows `after` (the compute stream's marker and the queued copies of the
//               same blocks, which the caller, BlockOrder, finds per step); a save may take the marker itself;
//   rule 4:     fence() makes the compute stream wait for the legs of a layer group;
//   rule 5:     a staging buffer of the ring is written only after the job of the other queue that last used it
//               (a load's reshape, a save's DMA): StagingRing::acquire returns it.
//
// A staged load leg is a DMA on h2d into a ring buffer, then its reshape on load; a staged save leg a gather on
// save into a ring buffer, then its DMA on d2h. Every call here is one engine operation: a CUDA engine makes one
// CUDA API call of each (queues_cuda.cu), NullQueues counts them (the host-only benchmark), and the CPU engines
// implement Queues in Python (kvx/engine.py), so the deferred copy queue checks this very code's ordering on CPU.
//
// Threads: an engine's Queues, its rings and the plans it issues belong to the worker thread that issues them.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "copy_plan.h"

namespace kvx {

enum Queue : int32_t { kQueueLoad = 0, kQueueSave = 1, kQueueH2D = 2, kQueueD2H = 3, kQueueCompute = 4 };

// A point on a queue: later work may be ordered after it. The base class is a point already passed.
class Event {
 public:
  virtual ~Event() = default;
  virtual bool query() { return true; }  // it passed (never waits)
  virtual void synchronize() {}          // the host waits until it passed
};
using EventPtr = std::shared_ptr<Event>;
using PlanPtr = std::shared_ptr<CopyPlan>;

class Queues {
 public:
  virtual ~Queues() = default;
  virtual EventPtr record(int32_t queue) = 0;                  // a point after everything issued on `queue`
  virtual void wait(int32_t queue, const EventPtr& event) = 0;  // later work on `queue` follows `event`
  virtual void dma(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) = 0;
  virtual void reshape(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) = 0;
};

// What a CUDA engine would call, counted, and nothing run: the host-only benchmark's engine.
class NullQueues : public Queues {
 public:
  EventPtr record(int32_t queue) override;
  void wait(int32_t queue, const EventPtr& event) override;
  void dma(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) override;
  void reshape(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) override;
  // CUDA API calls a CUDA engine would make: event records, stream waits, batched DMA calls, kernel launches, and
  // the id table's upload (an allocation and a copy, once per plan)
  int64_t records = 0, waits = 0, dma_calls = 0, launches = 0, uploads = 0;
  int64_t total() const { return records + waits + dma_calls + launches + uploads; }

 private:
  EventPtr passed_ = std::make_shared<Event>();
};

// A fixed set of staging buffers handed out in turn, each with the jobs its next writer must follow (rule 5).
class StagingRing {
 public:
  StagingRing(std::vector<int64_t> buffers, int64_t capacity);
  // The next buffer's index; `users` receives the jobs it was last used by (cleared in the ring).
  int32_t acquire(std::vector<EventPtr>* users);
  void note(int32_t index, const EventPtr& user);
  int64_t address(int32_t index) const { return buffers_.at(index); }
  int64_t capacity() const { return capacity_; }
  int32_t count() const { return static_cast<int32_t>(buffers_.size()); }
  bool rule5 = true;  // a test's seeded bug: false hands a buffer out without its users

 private:
  std::vector<int64_t> buffers_;
  int64_t capacity_;
  std::vector<std::vector<EventPtr>> users_;
  int32_t next_ = 0;
};

// Issue legs [lo, hi) of a load plan (it writes blocks); the first follows `after` (rule 1).
void issue_load(Queues& q, const PlanPtr& plan, StagingRing* ring, int32_t lo, int32_t hi,
                const std::vector<EventPtr>& after);
// Issue legs [lo, hi) of a save plan (it reads blocks); the first follows `after` and, with `marker`, a point
// recorded on the compute stream now (rule 2: right after the forward wrote the blocks).
void issue_save(Queues& q, const PlanPtr& plan, StagingRing* ring, int32_t lo, int32_t hi,
                const std::vector<EventPtr>& after, bool marker);
// The compute stream waits for legs [lo, hi) (rule 4).
void fence(Queues& q, const CopyPlan& plan, int32_t lo, int32_t hi);
// Legs [lo, hi) on one queue in the direction's order (a one-off copy: a stream orders the staging buffer's reuse).
void issue_in_order(Queues& q, const PlanPtr& plan, int64_t staging, int32_t lo, int32_t hi);

}  // namespace kvx
