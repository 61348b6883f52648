// launch_config.h - every host-side decision of a copy-kernel launch, in one function.
//
// The CUDA launcher (copy_cuda.cu) and its CPU emulation (copy_sim.cu, impl "cuda_sim") both call
// kernel_launch_config(), so the grid the emulation runs is the grid the GPU gets: same vector width, same
// work items, same index width and divisors, same CTA count and cap. Plain host C++ (no CUDA header): the
// bindings expose it as kvx._C.cuda_launch_config whether or not nvcc built the kernels, so the decisions
// are testable anywhere.
//
// The kernel's work (copy_kernel.cuh). A row of `words` vector words (row_bytes / width) is cut into
// `segments` equal segments of tpr * wpl words; the *work item* is one segment of one row, numbered
// row-major (item = row * segments + segment), so the work unit has the same size whatever the row length:
// a 64 KiB page is 32 items like 32 rows of 2 KiB, spread over the grid instead of walked by one warp. A
// segment is served by a group of tpr lanes (threads per row segment), lane l moving words l, l + tpr, ...,
// l + (wpl - 1) * tpr of it (wpl = words per lane): each load instruction of a group reads tpr consecutive
// words. Each thread takes items_per_pass(wpl) items per pass of its grid-stride loop (kWordsPerLane words;
// 2 for one-word items): it locates them, issues all their loads, then the stores. Locating an item is the
// costly part (a chain of divisions and 64-bit multiply-adds), so wide segments (wpl 4) are preferred: one
// per 4 words instead of one per word. The choice (choose_segments()): the largest wpl (4, then 2), then the
// largest tpr (32 .. 2) that divide the row into whole segments, with tpr * width >= 32 bytes (each group's
// load covers whole 32-byte sectors); rows no such segment divides take tpr = 1 (a lane moves wpl consecutive
// words, 4 or 2 if they divide the row) or, for an odd number of words, tpr = wpl = 1: one word per item, the
// 32 lanes of a warp on 32 consecutive words of the flattened rows.
#pragma once

#include <cstdint>

#include "../kv_layout.h"

namespace kvx::cuda {

constexpr int kThreads = 256;     // threads per CTA: 8 warps
constexpr int kCtasPerSm = 4;     // resident CTAs of kThreads each per SM: the grid's fill cap and __launch_bounds__
constexpr int kWordsPerLane = 4;  // vector words a thread moves per pass: its loads in flight before its stores
// Items a thread takes per pass for `wpl` words per lane per item: kWordsPerLane words, except for one-word
// items: four address chains at once took 74-80 registers (sm_90), more than the 64 __launch_bounds__ allows
// at kCtasPerSm, so two (<= 60).
constexpr int items_per_pass(int wpl) { return wpl == 1 ? 2 : kWordsPerLane / wpl; }
constexpr int kMinGroupBytes = 32;  // a group's load instruction covers at least one 32-byte sector
// Indices (items, rows, entries, paged token numbers) below this are divided in 32 bits with FastDivmod.
constexpr int64_t kIndex32Limit = int64_t{1} << 31;

// n / div for 0 <= n < 2^31 and 1 <= div < 2^31, as (umulhi(n, mul) + n) >> shift: a multiply-high, an add and
// a shift instead of a division (Granlund & Montgomery's round-up method, as in CUTLASS's FastDivmod and
// PyTorch's IntDivider). shift = ceil(log2(div)), mul = floor(2^32 * (2^shift - div) / div) + 1; the sum
// stays below 2^32 exactly when n < 2^31, which is what the host proves before choosing 32-bit indices.
struct FastDivmod {
  uint32_t div;
  uint32_t mul;
  uint32_t shift;
};

inline FastDivmod make_fast_divmod(int64_t d) {
  const uint64_t div = d < 1 ? 1 : static_cast<uint64_t>(d);  // unused divisors (nothing to divide) stay valid
  uint32_t shift = 0;
  while (shift < 31 && (uint64_t{1} << shift) < div) ++shift;
  const uint64_t mul = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - div)) / div + 1;
  return FastDivmod{static_cast<uint32_t>(div), static_cast<uint32_t>(mul), shift};
}

KVX_HD uint32_t fast_div(const FastDivmod& f, uint32_t n) {
#if defined(__CUDA_ARCH__)
  const uint32_t hi = __umulhi(n, f.mul);
#else
  const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * f.mul) >> 32);
#endif
  return (hi + n) >> f.shift;
}

struct LaunchConfig {
  CopyParams params;    // after collapse_rows(): what the kernel receives
  int64_t total_rows;   // rows of the iteration space (padding slots included; the kernel skips them)
  int64_t words;        // vector words per row: row_bytes / width
  int64_t segments;     // work items per row: words / (tpr * wpl)
  int64_t total_items;  // total_rows * segments
  int64_t ctas;         // grid size; 0 = nothing to copy, no launch
  int32_t width;        // bytes per vector access: 16, 8, 4, 2 or 1 (sizeof(VecT))
  int32_t tpr;          // lanes per segment: 32, 16, 8, 4, 2 (or 1 with wpl 1)
  int32_t wpl;          // words per lane per segment: 4, 2 or 1; a pass takes items_per_pass(wpl) items
  int32_t groups;       // lane groups per CTA: kThreads / tpr
  int64_t items_per_cta;  // items one CTA takes per pass: groups * items_per_pass(wpl)
  int32_t index_bits;   // 32: indices divided with the FastDivmods below; 64: plain 64-bit division
  // 32-bit index math only (index_bits == 32): item -> (row, segment), row -> (entry, row in entry),
  // entry -> (layer * planes + plane, id index), that -> (layer, plane), row in entry -> (token, head),
  // paged token number -> (block, token); id_tokens: tokens an id stands for (block_size for block ids, 1 for
  // slot ids), so that id * id_tokens + token is the paged token number in both modes.
  FastDivmod by_segments, by_rows_per_entry, by_ids, by_planes, by_heads, by_block_size;
  uint32_t id_tokens;
};

// (tpr, wpl) for rows of `words` words of `width` bytes: see the top of this file.
inline void choose_segments(int64_t words, int32_t width, int32_t* tpr, int32_t* wpl) {
  for (int32_t w : {4, 2})
    for (int32_t t : {32, 16, 8, 4, 2})
      if (t * width >= kMinGroupBytes && words % (static_cast<int64_t>(t) * w) == 0) {
        *tpr = t;
        *wpl = w;
        return;
      }
  // No group reading whole sectors divides the row: one lane per segment of wpl consecutive words (a load
  // instruction then reads every other word, or every fourth, the next instruction the rest of the same
  // sectors), still one address chain per wpl words; else one word per item.
  *tpr = 1;
  *wpl = words % 4 == 0 ? 4 : words % 2 == 0 ? 2 : 1;
}

// The launch for a copy of `width`-byte vectors. Split from kernel_launch_config() so the emulation can be
// asked for a wider vector than the alignment allows (its checker's own test) and still get the items and
// grid the launcher would derive from that width.
//   p:             params after collapse_rows()
//   sm_count:      SMs of the device (the emulation takes an emulated count)
//   max_ctas:      cap on CTAs (<= 0: none), e.g. H2D_MAX_CTAS for copies over PCIe
//   index32_limit: indices must stay below this for 32-bit index math (kIndex32Limit, at most). Smaller values
//                  are a test knob only: they make small copies take the 64-bit path.
inline LaunchConfig launch_config_for_width(const CopyParams& p, int32_t width, int sm_count, int max_ctas,
                                            int64_t index32_limit = kIndex32Limit) {
  LaunchConfig c{};
  c.params = p;
  c.width = width;
  c.index_bits = 64;
  c.total_rows = num_entries(p) * rows_per_entry(p);
  c.words = p.row_bytes > 0 ? p.row_bytes / width : 0;
  choose_segments(c.words, width, &c.tpr, &c.wpl);
  c.segments = c.words / (static_cast<int64_t>(c.tpr) * c.wpl);
  c.groups = kThreads / c.tpr;
  c.items_per_cta = static_cast<int64_t>(c.groups) * items_per_pass(c.wpl);
  c.total_items = c.total_rows * c.segments;
  if (c.total_items <= 0) {  // ctas = 0: nothing to launch
    c.total_items = 0;
    return c;
  }
  // Enough CTAs to keep every SM busy (kCtasPerSm resident CTAs of kThreads each), never more than one pass
  // of the items needs; items beyond ctas * items_per_cta are taken by the kernel's grid-stride loop.
  int64_t ctas = (c.total_items + c.items_per_cta - 1) / c.items_per_cta;
  const int64_t fill = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * kCtasPerSm;
  if (ctas > fill) ctas = fill;
  if (max_ctas > 0 && ctas > max_ctas) ctas = max_ctas;
  c.ctas = ctas;
  // 32-bit index math when every index the kernel divides or multiplies in 32 bits stays below the limit: the
  // item counter up to its last grid-stride step (total_items + one grid's worth), the word index in a row,
  // the paged token number of every valid id (block * block_size + token < num_blocks * block_size; ops
  // checks the ids) and the contiguous token (< num_ids * id_tokens). The quotients (rows, entries, ...) are
  // smaller still.
  const int64_t limit = index32_limit < kIndex32Limit ? index32_limit : kIndex32Limit;
  const int64_t id_tokens = p.mode == kBlocks ? p.paged.block_size : 1;
  const bool fits = c.total_items + ctas * c.items_per_cta <= limit && c.words <= limit &&
                    p.paged.num_blocks * static_cast<int64_t>(p.paged.block_size) <= limit &&
                    p.num_ids * id_tokens <= limit;
  if (fits) {
    c.index_bits = 32;
    c.by_segments = make_fast_divmod(c.segments);
    c.by_rows_per_entry = make_fast_divmod(rows_per_entry(p));
    c.by_ids = make_fast_divmod(p.num_ids);
    c.by_planes = make_fast_divmod(p.paged.num_planes);
    c.by_heads = make_fast_divmod(p.iter_heads);
    c.by_block_size = make_fast_divmod(p.paged.block_size);
    c.id_tokens = static_cast<uint32_t>(id_tokens);
  }
  return c;
}

// Collapse the rows, pick the vector width from the alignment of every address and stride (copy_width()),
// then the segments, items, index width and grid.
//   layer_ptrs_host: [num_layers] layer base addresses (only their alignment is read)
//   contig:          address of the contiguous side as the kernel sees it (only its alignment is read)
inline LaunchConfig kernel_launch_config(const CopyParams& params, const int64_t* layer_ptrs_host, int64_t contig,
                                         int sm_count, int max_ctas, int64_t index32_limit = kIndex32Limit) {
  CopyParams p = params;
  collapse_rows(p);
  return launch_config_for_width(p, copy_width(p, layer_ptrs_host, contig), sm_count, max_ctas, index32_limit);
}

}  // namespace kvx::cuda
