// copy_kernel.cuh - the body of the CUDA copy kernel, compiled for the device and for the host.
//
// One thread's work (launch_config.h has the decisions): rows are cut into segments of tpr * wpl vector words
// (a word is sizeof(VecT) bytes, 16 when every address and stride allows); a work item is one segment, served
// by a group of tpr lanes, lane l moving words l, l + tpr, ... of it. In each pass of its grid-stride loop a
// thread takes items_per_pass(wpl) items, `groups` apart (so a warp's groups hold consecutive items),
// locates them, issues all their loads, then all the stores: 4 words in flight per lane (2 for one-word
// items) whatever the row length, and long rows (pages) spread over the grid instead of walked by one warp.
//
// Locating an item is a chain of divisions (item -> row and segment -> entry and row in entry -> layer, plane
// and id index -> token and head; a paged token number -> block and token). When the host proved every index
// fits (index_bits == 32, launch_config.h) each is a FastDivmod: multiply-high, add, shift, and a multiply-add
// for the remainder, in 32 bits. Otherwise (copies of 2^31 items or more) the 64-bit path of kv_layout.h.
//
// The memory accesses go through `Access`:
//   - copy_cuda.cu's __global__ kernel passes (blockIdx.x, threadIdx.x, gridDim.x) and streaming
//     loads/stores (__ldcs/__stcs): the data is touched once, so it should not evict the model's working
//     set from L2;
//   - copy_sim.cu (impl "cuda_sim") calls the same body for every thread of every CTA on the CPU, with
//     loads/stores that first check what the GPU would fault on or silently corrupt.
// So the kernel's indexing runs, bit for bit, in CPU CI, although no GPU ever executes it there.
//
// Access must provide (its methods may be __device__-only or host-only; each side instantiates only its
// own policy); `k` is the item's slot in the pass, 0 <= k < items_per_pass(wpl):
//   void begin_pass()                                          at the top of each grid-stride pass
//   void begin_item(int k, int64_t item, int64_t row, int32_t layer)  before a live item's addresses are formed
//   VecT load(int k, const VecT* p)
//   void store(int k, VecT* p, VecT v)
#pragma once

#include <cuda_runtime.h>  // uint2 / uint4 (vector_types.h) on both sides

#include <cstdint>
#include <type_traits>

#include "../kv_layout.h"
#include "launch_config.h"

namespace kvx::cuda {

// Where the first word of one lane's share of a work item lies.
struct ItemPlace {
  int64_t row;         // the item's row (the emulation names it in its reports)
  int64_t paged_off;   // bytes from its layer's base
  int64_t contig_off;  // bytes from the contiguous side's base
  int32_t layer;
};

// Locate lane `lane`'s first word of work item `item` (< c.total_items). False for a padding slot (nothing
// to copy; *at is still a valid place: layer in range).
//   ids: [num_ids] block or slot ids
template <typename Index, int kWidth>
KVX_HD bool locate_item(const LaunchConfig& c, Index item, uint32_t lane, const int64_t* __restrict__ ids,
                        ItemPlace* at) {
  const CopyParams& p = c.params;
  if constexpr (sizeof(Index) == 4) {
    // 32-bit: every dividend is below 2^31 (launch_config_for_width() checked it), so each FastDivmod is exact.
    // No branch: both modes go through the same arithmetic. An id stands for c.id_tokens tokens (block_size for
    // block ids, 1 for slot ids) and its row's token t is added: s = id * id_tokens + t is the paged token
    // number (block * block_size + token) in either mode, < num_blocks * block_size <= 2^31.
    const uint32_t row = fast_div(c.by_segments, item), seg = item - row * c.by_segments.div;
    const uint32_t word = seg * static_cast<uint32_t>(c.tpr * c.wpl) + lane;
    const uint32_t e = fast_div(c.by_rows_per_entry, row), r = row - e * c.by_rows_per_entry.div;
    const uint32_t lp = fast_div(c.by_ids, e), i = e - lp * c.by_ids.div;
    const uint32_t layer = fast_div(c.by_planes, lp), plane = lp - layer * c.by_planes.div;
    const uint32_t t = fast_div(c.by_heads, r), h = r - t * c.by_heads.div;
    const int64_t id = ids[i];
    const uint32_t s = static_cast<uint32_t>(id) * c.id_tokens + t;
    const uint32_t block = fast_div(c.by_block_size, s), token = s - block * c.by_block_size.div;
    const uint32_t contig_token = i * c.id_tokens + t;  // < num_ids * id_tokens <= 2^31
    const int64_t byte = static_cast<int64_t>(word) * kWidth;
    at->row = row;
    at->layer = static_cast<int32_t>(layer);
    at->paged_off = static_cast<int64_t>(plane) * p.paged.plane_stride +
                    static_cast<int64_t>(block) * p.paged.block_stride +
                    static_cast<int64_t>(token) * p.paged.token_stride +
                    static_cast<int64_t>(h) * p.paged.head_stride + byte;
    at->contig_off = static_cast<int64_t>(layer) * p.contig.layer_stride +
                     static_cast<int64_t>(plane) * p.contig.plane_stride +
                     static_cast<int64_t>(contig_token) * p.contig.token_stride +
                     static_cast<int64_t>(h) * p.contig.head_stride + byte;
    return id >= 0;  // a negative slot id is padding (block ids are >= 0)
  } else {
    // 64-bit: kv_layout.h's own functions, plain divisions.
    const int64_t n = static_cast<int64_t>(item);
    const int64_t row = n / c.segments, seg = n - row * c.segments;
    const int64_t word = seg * c.tpr * c.wpl + lane;
    const int64_t rpe = rows_per_entry(p);
    const int64_t e = row / rpe, r = row - e * rpe;
    int32_t layer = 0;
    int64_t paged_off = 0, contig_off = 0;
    const bool real = entry_offsets(p, e, ids, &layer, &paged_off, &contig_off);  // sets the layer either way
    at->row = row;
    at->layer = layer;
    at->paged_off = paged_off + row_paged_offset(p, r) + word * kWidth;
    at->contig_off = contig_off + row_contig_offset(p, r) + word * kWidth;
    return real;
  }
}

// One thread of the copy kernel: thread `thread` (of kThreads) of CTA `cta` in a grid of `grid` CTAs
// (grid == c.ctas).
//   layer_ptrs: [num_layers] layer base addresses, readable where this runs
//   ids:        [num_ids] block or slot ids, readable where this runs
//   contig:     base of the contiguous side [layers, planes, tokens, heads, row_bytes] (strided)
// Index is uint32_t when c.index_bits == 32, else uint64_t; kWpl == c.wpl; kGatherDir: paged -> contiguous,
// else the reverse. The exec check is off because the template is __host__ __device__ while each Access is
// one-sided: the device kernel instantiates it only with the device policy, the emulation only with the host
// one.
#pragma nv_exec_check_disable
template <typename VecT, typename Index, int kWpl, bool kGatherDir, typename Access>
__host__ __device__ __forceinline__ void copy_thread(const LaunchConfig& c, const int64_t* __restrict__ layer_ptrs,
                                                     const int64_t* __restrict__ ids, char* contig, unsigned cta,
                                                     unsigned thread, unsigned grid, Access& access) {
  constexpr int K = items_per_pass(kWpl);
  constexpr int kWidth = static_cast<int>(sizeof(VecT));
  const uint32_t tpr = static_cast<uint32_t>(c.tpr);  // a power of two
  const uint32_t lane = thread & (tpr - 1);
  const Index groups = static_cast<Index>(c.groups);
  const Index total = static_cast<Index>(c.total_items);
  const Index per_cta = static_cast<Index>(c.items_per_cta);
  const int64_t lane_step = static_cast<int64_t>(tpr) * kWidth;  // bytes between a lane's words in a segment
  const int64_t flat_base = reinterpret_cast<int64_t>(contig);
  // With 32-bit indices the host proved total + grid * per_cta fits, so neither `first` nor an item overflows.
  const uint32_t group = thread * static_cast<uint32_t>(c.groups) / kThreads;  // thread / tpr, by a shift
  for (Index first = static_cast<Index>(cta) * per_cta + group; first < total;
       first += static_cast<Index>(grid) * per_cta) {
    access.begin_pass();
    // Locate the K items, issuing each one's kWpl loads at once, then all the stores: K * kWpl loads in flight
    // per lane (kWordsPerLane; 2 for one-word items). Fixed-size arrays indexed by unrolled constants only, so
    // they live in registers. An item past the end is located as item 0 (a valid place) and not moved, so the
    // address math has no branch.
    VecT v[K * kWpl];
    int64_t dst[K];
    bool live[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const Index item = first + static_cast<Index>(k) * groups;
      const bool in_range = item < total;
      ItemPlace at;
      live[k] = locate_item<Index, kWidth>(c, in_range ? item : Index{0}, lane, ids, &at) && in_range;
      if (live[k]) access.begin_item(k, static_cast<int64_t>(item), at.row, at.layer);
      const int64_t paged = (live[k] ? layer_ptrs[at.layer] : 0) + at.paged_off;
      const int64_t flat = flat_base + at.contig_off;
      const int64_t src = kGatherDir ? paged : flat;
      dst[k] = kGatherDir ? flat : paged;
#pragma unroll
      for (int j = 0; j < kWpl; ++j)
        if (live[k]) v[k * kWpl + j] = access.load(k, reinterpret_cast<const VecT*>(src + j * lane_step));
    }
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int j = 0; j < kWpl; ++j)
        if (live[k]) access.store(k, reinterpret_cast<VecT*>(dst[k] + j * lane_step), v[k * kWpl + j]);
  }
}

template <typename T>
struct VecTag {
  using type = T;
};

// Call f(VecTag<VecT>{}, VecTag<Index>{}, std::integral_constant<int, wpl>{}, std::bool_constant<gather>{})
// for the kernel instance of a launch: its width, index width, words per lane and the copy's direction. The
// one mapping from launch decisions to template arguments, for the launcher and the emulation alike.
// 5 widths x 2 index widths x 3 wpl x 2 directions = 60 instances.
template <typename F>
void with_kernel_types(int32_t width, int32_t index_bits, int32_t wpl, bool gather, F&& f) {
  auto by_dir = [&](auto vec, auto index, auto w) {
    if (gather) return f(vec, index, w, std::true_type{});
    return f(vec, index, w, std::false_type{});
  };
  auto by_wpl = [&](auto vec, auto index) {
    switch (wpl) {
      case 4: return by_dir(vec, index, std::integral_constant<int, 4>{});
      case 2: return by_dir(vec, index, std::integral_constant<int, 2>{});
      default: return by_dir(vec, index, std::integral_constant<int, 1>{});
    }
  };
  auto by_index = [&](auto vec) {
    if (index_bits == 32) return by_wpl(vec, VecTag<uint32_t>{});
    return by_wpl(vec, VecTag<uint64_t>{});
  };
  switch (width) {
    case 16: return by_index(VecTag<uint4>{});
    case 8: return by_index(VecTag<uint2>{});
    case 4: return by_index(VecTag<uint32_t>{});
    case 2: return by_index(VecTag<uint16_t>{});
    default: return by_index(VecTag<uint8_t>{});
  }
}

}  // namespace kvx::cuda
