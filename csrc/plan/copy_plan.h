// copy_plan.h - a set of copies between the paged layers and contiguous buffers, planned once.
//
// The door into every copy kvx makes: Python checks the copies (kvx/kernels/plan.py), this class plans them,
// and an executor runs the plan leg by leg (queues.h: an engine's copy queues, one stream, the host now, or
// nothing at all). Planning does every host computation a copy needs up front, so that running a leg issues
// calls and computes nothing:
//
// - *copies*: one op each (gather/scatter of blocks, slots or raw pages) between the layers and one buffer
//   holding every layer of its contiguous side, all in one direction;
// - *legs*: the plan cut by layer range ("ranges", the layer groups a layer-wise pipeline fences) and, on path
//   staged, by the staging buffer's capacity (fewer layers, else the copies of one layer split between ids). A
//   leg is the unit an executor runs and the issue path orders: its DMA and its launches ("part" in kvx means
//   something else: a worker's share of a chunk in the stores, kvx/connector/parts.py);
// - per leg, the *runs* of its DMA (dst, src, bytes; the staging side as offsets from the buffer the ring hands
//   out) and its *launches* of the copy kernel (one per op group, with the CUDA launch decided when planned).
//
// Paths (Path): kernel (the copy kernel between the buffers and the blocks: the CPU kernel on a CPU cache, the
// CUDA kernel on device or mapped host memory), dma (the runs straight between the buffers and the blocks),
// staged (a DMA between the buffers and a staging buffer on the cache's device and one kernel launch per op
// group between it and the blocks, inside the device). Auto is resolved when planned: dma when every copy's
// runs average at least `dma_min_run` bytes, else staged.
//
// The staging buffer of a leg, per layer [start, end): one region per op group, each the group's pieces back
// to back in the canonical order of its contiguous side, [P, T, H, row] (or [H, P, T, row] when its buffers
// are head-major, so a head's tokens cross in one run). A whole chunk's layer is then one run.
//
// Threads: built by one thread, then read-only but for `events` (the issuing thread) and `ids_dev` (set by the
// executor that uploads the ids). Executors may run on other threads (the CPU copy queues) once built.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../cuda/launch_config.h"
#include "../kv_layout.h"

namespace kvx {

enum Path : int32_t { kPathKernel = 0, kPathDma = 1, kPathStaged = 2, kPathAuto = 3 };
// What runs a leg's reshape: the CPU kernel, the CUDA kernel, the CUDA kernel emulated on the CPU (cuda_sim), or
// a Python implementation (reference, triton: kvx/kernels/plan.py runs those from the launches' geometry).
enum Impl : int32_t { kImplCpu = 0, kImplCuda = 1, kImplSim = 2, kImplPython = 3 };

// One copy of a plan, as added.
struct CopySpec {
  CopyParams params;    // over every layer of the plan; num_ids: this copy's ids
  int32_t direction;    // kGather or kScatter (every copy of a plan has the same)
  int32_t unit;         // contiguous-side entries (dim 2) per id: block_size for blocks, 1 for slots and pages
  int32_t group;        // its op group (staged: one region and one launch per group and leg)
  int32_t head_major;  // its buffer holds each head's rows together ([H, L, P, T, row]): staged head-major
  int32_t on_host;      // its buffer is host memory (a CUDA cache: pinned; the DMA's location hint)
  int64_t contig;       // address of its contiguous side (layer 0)
  int64_t span_lo;      // the byte extent of its buffer (cuda_sim's bounds)
  int64_t span_hi;
};

struct Piece {
  int32_t copy;
  int64_t lo, hi;  // ids [lo, hi) of the copy
};

// One launch of the copy kernel: a leg's op group and its staging region (staged), or one copy (kernel).
struct Launch {
  CopyParams params;  // over the leg's layers; contig strides: of the region (staged) or the buffer (kernel)
  int32_t direction;
  int32_t first_layer;  // the leg's first layer: its layer table starts there
  int32_t group;
  int32_t copy;         // kernel path: the copy; staged: -1
  int32_t head_major;  // staged: the region is [H, P, entries, row]
  int64_t ids_at;       // the launch's ids in the plan's id table (params.num_ids of them)
  int64_t contig;       // staged: offset of the region in the staging buffer; kernel: the buffer's address
  int64_t entries;      // staged: the region's extent along the entries (tokens, slots, pages)
  int64_t region_bytes;  // staged: the region's bytes in one layer
  int64_t span_lo, span_hi;  // kernel: the buffer's extent; staged: the region's, from the staging base
  cuda::LaunchConfig config;  // decided when planned (a CUDA target): the launch issues it as is
};

struct Leg {
  int32_t start, end;  // layers [start, end)
  int32_t range;       // the layer range (group) it belongs to
  int64_t nbytes;      // bytes it moves: the staging it needs (staged)
  int64_t layer_bytes;  // staging bytes per layer
  int64_t run_lo, run_hi;    // its DMA runs
  int32_t launch_lo, launch_hi;  // its launches
};

class Event;  // queues.h

class CopyPlan {
 public:
  // layer_ptrs: [L] the layers' base addresses; layer_ptrs_dev: the same table in device memory (0: none);
  // layer_bounds: [2L] each layer's byte extent (cuda_sim's bounds); impl: the reshape's executor.
  CopyPlan(std::vector<int64_t> layer_ptrs, int64_t layer_ptrs_dev, std::vector<int64_t> layer_bounds, int32_t impl);
  ~CopyPlan();
  CopyPlan(const CopyPlan&) = delete;
  CopyPlan& operator=(const CopyPlan&) = delete;

  // Add one copy (before build()); `ids` [spec.params.num_ids] are copied. Returns its index.
  int32_t add(const CopySpec& spec, const int64_t* ids);

  // Whether copy `i`'s runs straight into the blocks (one layer) average at least `min_run` bytes.
  bool direct_fits(int32_t i, int64_t min_run) const;

  // Plan the legs. path: Path (auto resolved with dma_min_run); ranges: layer ranges in order; capacity: one
  // staging buffer's bytes (staged); sm_count > 0: decide each launch as the CUDA launcher does on a device of that
  // many SMs (a CUDA target), with `max_ctas` (0: no cap). Throws std::invalid_argument naming what is wrong.
  void build(int32_t path, const std::vector<std::pair<int32_t, int32_t>>& ranges, int64_t capacity,
             int64_t dma_min_run, int sm_count, int max_ctas);

  // ---- what was planned
  int32_t path() const { return path_; }
  int32_t direction() const { return direction_; }
  int32_t impl() const { return impl_; }
  bool gather() const { return direction_ == kGather; }
  int32_t num_layers() const { return static_cast<int32_t>(layer_ptrs_.size()); }
  int64_t nbytes() const;  // every copy, every layer
  int64_t min_staging_bytes() const;  // one id of one layer: the smallest leg
  const std::vector<CopySpec>& copies() const { return copies_; }
  const std::vector<Leg>& legs() const { return legs_; }
  const std::vector<Launch>& launches() const { return launches_; }
  const std::vector<int64_t>& ids() const { return ids_; }
  const std::vector<int64_t>& run_dst() const { return run_dst_; }
  const std::vector<int64_t>& run_src() const { return run_src_; }
  const std::vector<int64_t>& run_bytes() const { return run_bytes_; }
  const std::vector<int64_t>& layer_ptrs() const { return layer_ptrs_; }
  int64_t layer_ptrs_dev() const { return layer_ptrs_dev_; }
  // Legs [first, second) of layer range `r`.
  std::pair<int32_t, int32_t> range_legs(int32_t r) const;
  int32_t num_ranges() const { return static_cast<int32_t>(range_legs_.size()); }
  // The runs' staging side: dst (a load) or src (a save); none off path staged.
  bool dst_staged() const { return path_ == kPathStaged && direction_ == kScatter; }
  bool src_staged() const { return path_ == kPathStaged && direction_ == kGather; }

  // ---- executors on the host (call without the GIL: they touch only memory the plan names)
  // The leg's runs by memcpy (staging: the staging buffer's address, path staged).
  void dma_host(int32_t leg, int64_t staging, int num_threads) const;
  // The leg's launches by the CPU kernel (impl cpu) or the CUDA kernel's emulation (impl cuda_sim: sm_count,
  // max_ctas as the emulated launcher takes them; a violation throws std::runtime_error naming it).
  void reshape_host(int32_t leg, int64_t staging, int num_threads, int sim_sm_count, int sim_max_ctas) const;

  // ---- the CUDA executors (copy_plan_cuda.cu; cudaError_t, 0 = success; never sync)
  int dma_cuda(int32_t leg, int64_t staging, int64_t stream) const;
  int reshape_cuda(int32_t leg, int64_t staging, int64_t stream);  // uploads the ids at the first call
  // The id table (``ids()``) already on the device, uploaded by the caller on a stream every reshape of the plan is
  // ordered after (kvx/kernels/plan.py: torch's copy from pinned memory, on the stream the plan is built on, which
  // the plan's first leg follows); kept alive by the caller while the plan lives. The CUDA executor then uploads
  // nothing.
  void set_device_ids(int64_t address) {
    ids_dev_ = address;
    uploaded_ = true;
  }
  // True the first time only: the executor that runs the plan's first reshape uploads its id table then.
  bool take_upload() {
    const bool first = !uploaded_;
    uploaded_ = true;
    return first;
  }

  // ---- per leg, the events of its jobs (set by the issuing code, queues.h)
  std::vector<std::shared_ptr<Event>> touched;  // the job that wrote (load) or read (save) the leg's blocks
  std::vector<std::shared_ptr<Event>> done;     // the leg's last job

 private:
  void plan_staged(const std::vector<Piece>& pieces, int32_t start, int32_t end, int32_t range,
                   std::vector<std::pair<std::vector<Piece>, int64_t>>* specs);
  void plan_direct(int32_t start, int32_t end, int32_t range);
  void plan_kernel(int32_t start, int32_t end, int32_t range);
  void emit(int64_t dst, int64_t src, int64_t bytes);
  int64_t id_bytes(const CopySpec& c) const;

  std::vector<int64_t> layer_ptrs_;
  int64_t layer_ptrs_dev_;
  std::vector<int64_t> layer_bounds_;
  int32_t impl_;
  int32_t path_ = kPathAuto;
  int32_t direction_ = -1;
  int sm_count_ = 0;
  int max_ctas_ = 0;
  std::vector<CopySpec> copies_;
  std::vector<std::vector<int64_t>> copy_ids_;  // as added
  std::vector<int64_t> copy_ids_at_;            // each copy's ids in ids_ (kernel path)
  std::vector<int64_t> ids_;                    // the launches' ids
  std::vector<Leg> legs_;
  std::vector<Launch> launches_;
  std::vector<std::pair<int32_t, int32_t>> range_legs_;
  std::vector<int64_t> run_dst_, run_src_, run_bytes_;
  int64_t ids_dev_ = 0;  // the id table on the device (CUDA), uploaded by the first reshape
  int64_t ids_stream_ = 0;  // the stream it was uploaded (and is freed) on
  bool own_ids_ = false;    // ids_dev_ was allocated here (freed with the plan)
  bool uploaded_ = false;
  bool built_ = false;
};

}  // namespace kvx
