// copy_sim.cu - impl "cuda_sim": the CUDA copy kernel's own body (copy_thread() of copy_kernel.cuh) and
// launch decisions (kernel_launch_config() of launch_config.h), run on the CPU for every thread of the
// grid, each vector access checked first.
//
// Why: no GPU runs in CI, so the kernel's indexing (items and rows, the 32-bit FastDivmod and 64-bit index
// paths, the items of a pass and the tail of the last one, the grid-stride loop, the grid's size and caps,
// the vector width chosen from alignment) would otherwise be checked by reading only. Here the same source executes on CPU tensors through the
// bit-exact kernel tests, and what a GPU would fault on (a misaligned vector, an access outside its
// allocation) or corrupt silently (two threads writing one byte) stops the run with the thread and row.
//
// Order: CTAs, then threads, ascending, one at a time. A correct launch has no two threads touching one
// destination byte (checked) and never reads what it writes (kvx/kernels/ops.py refuses overlapping sides), so
// every order a GPU could pick gives these bytes; the emulation need not guess one.
//
// Cost: a thread is a few inlined calls and a check per vector word.
// Compiled by nvcc as host code only: no device code is generated for this file.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "copy_kernel.cuh"
#include "copy_sim.h"

namespace kvx::cuda {
namespace {

// Thrown by a checked access to stop the emulated launch at once (the access is not made); caught in
// simulate_copy() and returned as text. Never leaves this file.
struct Fault {
  std::string what;
};

std::string hex(int64_t a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

// A buffer accesses must stay in: [lo, hi), plus (destination side) which thread of this launch wrote each
// of its bytes: 4 bytes of shadow per byte of the buffer's extent, allocated on its first store (the test
// copies are a few MiB).
struct Buffer {
  std::string name;
  int64_t lo = 0, hi = 0;
  std::vector<int32_t> writer;  // per byte of [lo, hi): 1 + cta * kThreads + thread of its writer, 0 = none
};

// copy_thread()'s Access for the emulation: loads and stores through memcpy (no aliasing assumptions),
// after the checks. Knows which thread runs (at()) and which item each of the pass's slots holds
// (begin_item()), so a fault names the item, row and layer of the very access that made it.
class CheckedAccess {
 public:
  CheckedAccess(const LaunchConfig& c, const int64_t* layer_bounds, int64_t contig_lo, int64_t contig_hi,
                bool gather)
      : c_(c), gather_(gather), contig_{"the contiguous side", contig_lo, contig_hi, {}} {
    layers_.resize(static_cast<size_t>(c.params.num_layers));
    for (size_t l = 0; l < layers_.size(); ++l)
      layers_[l] = Buffer{"paged layer " + std::to_string(l), layer_bounds[2 * l], layer_bounds[2 * l + 1], {}};
  }

  void at(unsigned cta, unsigned thread) {
    cta_ = cta;
    thread_ = thread;
    slot_ = -1;
    thread_passes_ = 0;
  }

  void begin_pass() {
    slot_ = -1;
    if (++thread_passes_ > passes_per_thread) passes_per_thread = thread_passes_;
  }

  void begin_item(int k, int64_t item, int64_t row, int32_t layer) {
    slot_ = k;
    slots_[k] = Slot{item, row, layer};
    if (layer < 0 || layer >= c_.params.num_layers)
      fail("bad layer", "layer " + std::to_string(layer) + " outside [0, " +
                            std::to_string(c_.params.num_layers) + ") (the layer table would be read out of bounds)");
    ++item_visits;
  }

  template <typename VecT>
  VecT load(int k, const VecT* p) {
    slot_ = k;
    check(reinterpret_cast<int64_t>(p), sizeof(VecT), "load", gather_ ? layers_[slots_[k].layer] : contig_);
    VecT v;
    std::memcpy(&v, p, sizeof(VecT));
    return v;
  }

  template <typename VecT>
  void store(int k, VecT* p, VecT v) {
    slot_ = k;
    const int64_t a = reinterpret_cast<int64_t>(p);
    Buffer& b = gather_ ? contig_ : layers_[slots_[k].layer];
    check(a, sizeof(VecT), "store", b);
    if (b.writer.empty()) b.writer.assign(static_cast<size_t>(b.hi - b.lo), 0);
    int32_t* writer = b.writer.data() + (a - b.lo);
    for (size_t i = 0; i < sizeof(VecT); ++i)
      if (writer[i] != 0) {
        const int32_t first = writer[i] - 1;
        fail("written twice",
             "byte " + hex(a + static_cast<int64_t>(i)) + " of " + b.name + " [" + hex(b.lo) + ", " + hex(b.hi) +
                 ") was already written in this launch by CTA " + std::to_string(first / kThreads) + " thread " +
                 std::to_string(first % kThreads) + " (" + lane_of(first % kThreads) + "): a race on a GPU",
             sizeof(VecT), "store", a);
      }
    const int32_t me = 1 + static_cast<int32_t>(cta_) * kThreads + static_cast<int32_t>(thread_);
    for (size_t i = 0; i < sizeof(VecT); ++i) writer[i] = me;
    std::memcpy(p, &v, sizeof(VecT));
  }

  int64_t item_visits = 0, passes_per_thread = 0, accesses = 0;

 private:
  struct Slot {
    int64_t item = -1, row = -1;
    int32_t layer = 0;
  };

  void check(int64_t a, size_t width, const char* op, const Buffer& b) {
    // What the GPU faults on: a vector access not aligned to its width ("misaligned address") ...
    if (a % static_cast<int64_t>(width) != 0)
      fail("misaligned", "address % " + std::to_string(width) + " = " + std::to_string(a % width) + "; " + b.name +
                             " is [" + hex(b.lo) + ", " + hex(b.hi) + ")",
           width, op, a);
    // ... and one reaching outside its buffer: an illegal address, or another allocation's bytes.
    if (a < b.lo || a + static_cast<int64_t>(width) > b.hi)
      fail("out of bounds", "bytes [" + hex(a) + ", " + hex(a + static_cast<int64_t>(width)) + ") are not all in " +
                                b.name + " [" + hex(b.lo) + ", " + hex(b.hi) + ")",
           width, op, a);
    ++accesses;
  }

  std::string lane_of(unsigned thread) const {
    return "lane " + std::to_string(thread % c_.tpr) + " of group " + std::to_string(thread / c_.tpr);
  }

  [[noreturn]] void fail(const char* kind, const std::string& detail, size_t width = 0, const char* op = nullptr,
                         int64_t a = 0) {
    const int64_t rpe = rows_per_entry(c_.params);
    std::string where = "CTA " + std::to_string(cta_) + " thread " + std::to_string(thread_) + " (" +
                        lane_of(thread_) + ")";
    if (slot_ >= 0) {
      const Slot& s = slots_[slot_];
      where += ", item " + std::to_string(s.item) + " (row " + std::to_string(s.row) + " segment " +
               std::to_string(s.item - s.row * c_.segments) + " of " + std::to_string(c_.segments) + "; entry " +
               std::to_string(s.row / rpe) + ", row " + std::to_string(s.row % rpe) + " of " + std::to_string(rpe) +
               ")";
    }
    std::string access = op ? std::to_string(width) + "-byte " + op + " at " + hex(a) + " by " : "";
    throw Fault{"cuda_sim: " + std::string(kind) + ": " + access + where + ": " + detail + " [launch: " +
                std::to_string(c_.ctas) + " CTAs x " + std::to_string(kThreads) + " threads x " +
                std::to_string(kWordsPerLane) + " words per pass, width " + std::to_string(c_.width) + ", row_bytes " +
                std::to_string(c_.params.row_bytes) + " = " + std::to_string(c_.segments) + " segments x " +
                std::to_string(c_.tpr) + " lanes x " + std::to_string(c_.wpl) + " words, " +
                std::to_string(c_.index_bits) + "-bit indices]"};
  }

  const LaunchConfig& c_;
  const bool gather_;
  Buffer contig_;
  std::vector<Buffer> layers_;
  unsigned cta_ = 0, thread_ = 0;
  int slot_ = -1;  // the slot of the access or item being checked; -1: none yet this pass
  Slot slots_[kWordsPerLane];
  int64_t thread_passes_ = 0;
};

}  // namespace

SimReport simulate_copy(const CopyParams& params, const int64_t* layer_ptrs, const int64_t* layer_bounds,
                        const int64_t* ids, int64_t contig, int64_t contig_lo, int64_t contig_hi,
                        int32_t direction, int sm_count, int max_ctas, int force_width, int64_t index32_limit) {
  SimReport report;
  if (force_width > 0) {
    CopyParams p = params;
    collapse_rows(p);
    report.config = launch_config_for_width(p, force_width, sm_count, max_ctas, index32_limit);
  } else {
    report.config = kernel_launch_config(params, layer_ptrs, contig, sm_count, max_ctas, index32_limit);
  }
  const LaunchConfig& c = report.config;
  if (c.ctas == 0) return report;
  const bool gather = direction == kGather;
  CheckedAccess access(c, layer_bounds, contig_lo, contig_hi, gather);
  char* base = reinterpret_cast<char*>(contig);
  const unsigned grid = static_cast<unsigned>(c.ctas);
  try {
    with_kernel_types(c.width, c.index_bits, c.wpl, gather, [&](auto vec, auto index, auto wpl, auto gather_dir) {
      using VecT = typename decltype(vec)::type;
      using Index = typename decltype(index)::type;
      for (unsigned cta = 0; cta < grid; ++cta) {
        for (unsigned thread = 0; thread < static_cast<unsigned>(kThreads); ++thread) {
          access.at(cta, thread);
          copy_thread<VecT, Index, decltype(wpl)::value, decltype(gather_dir)::value>(c, layer_ptrs, ids, base,
                                                                                      cta, thread, grid, access);
          ++report.threads;
        }
      }
    });
  } catch (const Fault& f) {
    report.fault = f.what;
  }
  report.item_visits = access.item_visits;
  report.passes_per_thread = access.passes_per_thread;
  report.accesses = access.accesses;
  return report;
}

}  // namespace kvx::cuda
