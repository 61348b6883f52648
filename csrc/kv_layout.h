// kv_layout.h - the address math of every paged KV layout kvx copies.
//
// One header, included by the CPU implementation (g++) and the CUDA kernels (nvcc), so both execute
// the same arithmetic. No torch, no CUDA runtime: plain integers and byte offsets.
//
// Model
// -----
// The paged side is a set of layers with identical geometry. In layer `l` (base pointer
// `layer_ptrs[l]`), the row of one head of one token of one plane (K, V, or the single MLA plane) is
// `row_bytes` contiguous bytes starting at
//
//     layer_ptrs[l] + plane * plane_stride + block * block_stride + token * token_stride
//                   + head * head_stride                                               (bytes)
//
// Every layout vLLM uses reduces to this (strides in bytes, D = head size, C = K|V content):
//   vLLM 0.32 LBNHC view [B, H, N, C=2D]: plane_stride = D*isz, token_stride = H*C*isz, head_stride = C*isz
//   vLLM 0.32 LBHNC view [B, H, N, C=2D]: plane_stride = D*isz, head_stride = N*C*isz, token_stride = C*isz
//   block-outer (BLNHC/BLHNC): as above, block_stride spans every layer of the allocation
//   legacy flash [2, B, N, H, D]: plane_stride = B*N*H*D*isz;  FlashInfer [B, 2, N, H, D]: N*H*D*isz
//   MLA [B, N, C]: one plane, one head, row = C elements
//   raw pages: one "token", one "head", row = a whole contiguous page (segment) of a block
//
// The contiguous side is [layers, planes, tokens, heads, row_bytes] with arbitrary byte strides over
// the first four dims (rows themselves are contiguous).
//
// Iteration space
// ---------------
// An *entry* is (layer l, plane p, id index i); entries are numbered (l * P + p) * num_ids + i.
// Each entry covers `iter_tokens x iter_heads` rows. Block mode: ids are block ids, the entry's
// contiguous tokens are [i * block_size, (i + 1) * block_size). Slot mode: ids are slot ids
// (block * block_size + offset), one token per entry, a negative slot is padding and is skipped.
// collapse_rows() merges adjacent heads (and, in block mode, tokens) into longer rows when both sides
// are dense, which turns e.g. a legacy-flash block into a single memcpy.
#pragma once

#include <cstdint>
#include <initializer_list>

#if defined(__CUDACC__)
#define KVX_HD __host__ __device__ __forceinline__
#else
#define KVX_HD inline
#endif

namespace kvx {

enum Mode : int32_t { kBlocks = 0, kSlots = 1 };
enum Direction : int32_t { kGather = 0 /* paged -> contiguous */, kScatter = 1 /* contiguous -> paged */ };

// Geometry of the paged side (identical for every layer). Strides in bytes.
struct PagedDesc {
  int64_t plane_stride;
  int64_t block_stride;
  int64_t token_stride;
  int64_t head_stride;
  int64_t num_blocks;
  int32_t num_planes;  // 2 (K, V) or 1 (MLA, raw pages)
  int32_t block_size;  // tokens per block
  int32_t num_heads;
  int32_t pad_;
};

// Strides in bytes of the contiguous side over [layers, planes, tokens, heads]; rows are dense.
struct ContigDesc {
  int64_t layer_stride;
  int64_t plane_stride;
  int64_t token_stride;
  int64_t head_stride;
};

struct CopyParams {
  PagedDesc paged;
  ContigDesc contig;
  int64_t row_bytes;    // bytes copied per row (after collapse_rows)
  int64_t num_ids;      // length of the id list
  int32_t num_layers;
  int32_t mode;         // Mode
  int32_t iter_tokens;  // rows along the token axis per entry (block_size, 1 for slots or merged)
  int32_t iter_heads;   // rows along the head axis per entry (num_heads, or 1 when merged)
};

// Fill the iteration fields from the geometry. Host-side helper shared by every backend.
inline CopyParams make_params(const PagedDesc& paged, const ContigDesc& contig, int64_t row_bytes,
                              int32_t num_layers, int64_t num_ids, int32_t mode) {
  CopyParams p{};
  p.paged = paged;
  p.contig = contig;
  p.row_bytes = row_bytes;
  p.num_ids = num_ids;
  p.num_layers = num_layers;
  p.mode = mode;
  p.iter_tokens = mode == kBlocks ? paged.block_size : 1;
  p.iter_heads = paged.num_heads;
  return p;
}

// Merge rows that are adjacent on both sides into one longer row. Host-side, called once per op.
inline void collapse_rows(CopyParams& p) {
  if (p.iter_heads > 1 && p.paged.head_stride == p.row_bytes && p.contig.head_stride == p.row_bytes) {
    p.row_bytes *= p.iter_heads;
    p.iter_heads = 1;
  }
  if (p.iter_heads == 1 && p.iter_tokens > 1 && p.paged.token_stride == p.row_bytes &&
      p.contig.token_stride == p.row_bytes) {
    p.row_bytes *= p.iter_tokens;
    p.iter_tokens = 1;
  }
}

KVX_HD int64_t num_entries(const CopyParams& p) {
  return static_cast<int64_t>(p.num_layers) * p.paged.num_planes * p.num_ids;
}

KVX_HD int64_t rows_per_entry(const CopyParams& p) {
  return static_cast<int64_t>(p.iter_tokens) * p.iter_heads;
}

// Where entry `e` starts on both sides. Returns false for a padding slot (nothing to copy).
//   ids: [num_ids] block ids (block mode) or slot ids (slot mode)
KVX_HD bool entry_offsets(const CopyParams& p, int64_t e, const int64_t* ids, int32_t* layer,
                          int64_t* paged_off, int64_t* contig_off) {
  const int64_t i = e % p.num_ids;
  const int64_t lp = e / p.num_ids;
  const int32_t plane = static_cast<int32_t>(lp % p.paged.num_planes);
  *layer = static_cast<int32_t>(lp / p.paged.num_planes);
  const int64_t id = ids[i];
  int64_t block, token, contig_token;
  if (p.mode == kBlocks) {
    block = id;
    token = 0;
    contig_token = i * p.paged.block_size;
  } else {
    if (id < 0) return false;
    block = id / p.paged.block_size;
    token = id % p.paged.block_size;
    contig_token = i;
  }
  *paged_off = plane * p.paged.plane_stride + block * p.paged.block_stride + token * p.paged.token_stride;
  *contig_off = *layer * p.contig.layer_stride + plane * p.contig.plane_stride +
                contig_token * p.contig.token_stride;
  return true;
}

// Offsets of row `r` (0 <= r < rows_per_entry) inside an entry, on the paged and contiguous side.
KVX_HD int64_t row_paged_offset(const CopyParams& p, int64_t r) {
  const int64_t t = r / p.iter_heads, h = r % p.iter_heads;
  return t * p.paged.token_stride + h * p.paged.head_stride;
}

KVX_HD int64_t row_contig_offset(const CopyParams& p, int64_t r) {
  const int64_t t = r / p.iter_heads, h = r % p.iter_heads;
  return t * p.contig.token_stride + h * p.contig.head_stride;
}

// `p` with every stride whose index is always 0 set to 0. Call after collapse_rows(). Such a stride
// never moves an address, so it must not narrow the copy width (copy_width()) nor be divided into
// word units (the Triton launcher): e.g. the layer stride of a one-layer chunk cut from a larger
// pool, or the head strides once collapse_rows() merged the heads into one row, may be odd without
// forcing byte-wide copies of whole rows. The block stride always moves (block ids are arbitrary).
// Addresses computed from the result are those computed from `p`.
inline CopyParams moving_strides(const CopyParams& p) {
  CopyParams m = p;
  const bool token_moves = p.mode == kBlocks ? p.iter_tokens > 1 : p.paged.block_size > 1;
  if (p.paged.num_planes <= 1) m.paged.plane_stride = m.contig.plane_stride = 0;
  if (!token_moves) m.paged.token_stride = 0;
  if (p.iter_heads <= 1) m.paged.head_stride = m.contig.head_stride = 0;
  if (p.num_layers <= 1) m.contig.layer_stride = 0;
  if (p.num_ids <= 1 && p.iter_tokens <= 1) m.contig.token_stride = 0;
  return m;
}

// Largest power-of-two width (<= 16) that divides every address and size the copy touches: the row
// length, the contiguous base, every layer base and every stride of moving_strides(p). Call after
// collapse_rows().
//   layer_ptrs: [num_layers] layer base addresses (only their alignment is read)
inline int copy_width(const CopyParams& p, const int64_t* layer_ptrs, int64_t contig_ptr) {
  const CopyParams m = moving_strides(p);
  uint64_t bits = static_cast<uint64_t>(m.row_bytes) | static_cast<uint64_t>(contig_ptr);
  for (int64_t s : {m.paged.plane_stride, m.paged.block_stride, m.paged.token_stride, m.paged.head_stride,
                    m.contig.layer_stride, m.contig.plane_stride, m.contig.token_stride, m.contig.head_stride})
    bits |= static_cast<uint64_t>(s);
  for (int32_t l = 0; l < p.num_layers; ++l) bits |= static_cast<uint64_t>(layer_ptrs[l]);
  int w = 16;
  while (w > 1 && (bits & static_cast<uint64_t>(w - 1))) w >>= 1;
  return w;
}

// What a launcher decides on the host, once per op: the rows after collapse_rows(), the strides of
// moving_strides() and copy_width(). The Triton launcher (triton_kernels/copy.py) takes its whole plan
// from here through kvx._C.plan_launch, so Triton and the C++ kernels (which call collapse_rows() and
// copy_width() themselves) cannot disagree on row merging or alignment.
struct LaunchPlan {
  CopyParams params;  // collapsed; strides that never move an address are 0
  int32_t width;      // bytes: 16, 8, 4, 2 or 1
};

//   layer_ptrs: [num_layers] layer base addresses (only their alignment is read)
inline LaunchPlan plan_launch(const CopyParams& params, const int64_t* layer_ptrs, int64_t contig_ptr) {
  CopyParams p = params;
  collapse_rows(p);
  return LaunchPlan{moving_strides(p), copy_width(p, layer_ptrs, contig_ptr)};
}

// Runs (the DMA plan)
// ------------------
// For copy engines a copy is a list of runs: (dst, src, bytes) of contiguous bytes on both sides, one DMA
// each. for_each_run() walks the rows of the copy in the order the kernel numbers them (entry by entry:
// layer, plane, id; then token, head) after collapse_rows(), and extends the current run while the next
// row continues it on both sides, so consecutive block ids whose pages are adjacent on both sides (a
// legacy-flash plane, raw pages of consecutive blocks, a whole cache) become one run. Padding slots
// are skipped. Host-side only: the CUDA DMA executor (copy_cuda.cu) and kvx._C.plan_runs use it, both
// through plan_runs() below.

// Bytes the copy moves: the rows of every non-padding entry (the same before and after collapse_rows()).
//   ids: [num_ids] block or slot ids (only slot mode reads them)
inline int64_t payload_bytes(const CopyParams& p, const int64_t* ids) {
  int64_t valid = p.num_ids;
  if (p.mode == kSlots) {
    valid = 0;
    for (int64_t i = 0; i < p.num_ids; ++i) valid += ids[i] >= 0;
  }
  return static_cast<int64_t>(p.num_layers) * p.paged.num_planes * valid * rows_per_entry(p) * p.row_bytes;
}

// Most runs a copy of `payload` bytes may have so that its runs average at least `min_run_bytes`
// (the DMA side of the kernel-or-DMA rule in kvx/kernels/dma.py); -1 (no limit) when min_run_bytes <= 0.
inline int64_t max_runs_for(int64_t payload, int64_t min_run_bytes) {
  return min_run_bytes > 0 ? payload / min_run_bytes : -1;
}

// Call emit(dst, src, bytes) (addresses as int64) for every maximal run of the copy, in row order.
// With max_runs >= 0, stop as soon as the copy turns out to have more than max_runs runs and return
// false: `emit` has then been called for the first max_runs runs only, which the caller discards.
//   layer_ptrs: [num_layers] layer base addresses
//   ids:        [num_ids] block ids (kBlocks) or slot ids, negative = padding (kSlots)
//   contig:     base address of the contiguous side
template <typename Emit>
inline bool for_each_run(const CopyParams& params, const int64_t* layer_ptrs, const int64_t* ids, int64_t contig,
                         int32_t direction, int64_t max_runs, Emit&& emit) {
  CopyParams p = params;
  collapse_rows(p);
  if (p.row_bytes <= 0) return true;
  const bool gather = direction == kGather;
  const int64_t entries = num_entries(p), rpe = rows_per_entry(p);
  int64_t runs = 0, dst = 0, src = 0, bytes = 0;
  for (int64_t e = 0; e < entries; ++e) {
    int32_t layer;
    int64_t paged_off, contig_off;
    if (!entry_offsets(p, e, ids, &layer, &paged_off, &contig_off)) continue;
    const int64_t paged = layer_ptrs[layer] + paged_off, flat = contig + contig_off;
    for (int64_t r = 0; r < rpe; ++r) {
      const int64_t a = paged + row_paged_offset(p, r), b = flat + row_contig_offset(p, r);
      const int64_t d = gather ? b : a, s = gather ? a : b;
      if (bytes > 0 && d == dst + bytes && s == src + bytes) {
        bytes += p.row_bytes;
        continue;
      }
      if (bytes > 0) emit(dst, src, bytes);
      if (max_runs >= 0 && runs == max_runs) return false;
      ++runs;
      dst = d;
      src = s;
      bytes = p.row_bytes;
    }
  }
  if (bytes > 0) emit(dst, src, bytes);
  return true;
}

// The run list a DMA executor issues: emit(dst, src, bytes) for every run of the copy, or false when its
// runs average fewer than `min_run_bytes` (<= 0: never), emit having then seen a prefix to discard. The one
// place that decides both the runs and the cutoff: copy_dma() (copy_cuda.cu) issues what this emits, and
// kvx._C.plan_runs returns it, so the CPU tests that memmove each run execute exactly the DMA plan.
//   layer_ptrs: [num_layers] layer base addresses
//   ids:        [num_ids] block ids (kBlocks) or slot ids, negative = padding (kSlots)
//   contig:     base address of the contiguous side (as the copy engines see it)
template <typename Emit>
inline bool plan_runs(const CopyParams& p, const int64_t* layer_ptrs, const int64_t* ids, int64_t contig,
                      int32_t direction, int64_t min_run_bytes, Emit&& emit) {
  const int64_t max_runs = max_runs_for(payload_bytes(p, ids), min_run_bytes);
  return for_each_run(p, layer_ptrs, ids, contig, direction, max_runs, emit);
}

}  // namespace kvx
