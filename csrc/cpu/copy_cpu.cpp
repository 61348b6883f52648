// copy_cpu.cpp - the CPU implementation: a persistent thread pool walking the row space of
// kv_layout.h and copying each row with memcpy (fixed-size specialisations for common row sizes).
#include "copy_cpu.h"

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvx::cpu {
namespace {

// Below this many bytes a copy runs on the calling thread: waking the pool costs ~10-20 us, which is
// what ~200 KiB take at this machine's ~12 GB/s.
constexpr int64_t kSerialBytes = 256 * 1024;

int env_threads() {
  if (const char* s = std::getenv("KVX_NUM_THREADS")) {
    int n = std::atoi(s);
    if (n > 0) return n;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

// A fixed pool of workers running one parallel-for at a time. Jobs from several caller threads are
// serialised by `submit_mu_`; the caller takes part as worker 0, so a 1-thread job never wakes anyone.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // leaked on purpose: no join during interpreter teardown
    return *pool;
  }

  int size() const { return num_threads_; }

  void set_size(int n) {
    std::lock_guard<std::mutex> job(submit_mu_);
    num_threads_ = std::max(1, n);
  }

  // Run fn(worker, num_workers) on `n` workers (the caller is worker 0); returns when all finished.
  void run(int n, const std::function<void(int, int)>& fn) {
    std::lock_guard<std::mutex> job(submit_mu_);
    n = std::max(1, std::min(n, num_threads_));
    if (n == 1) {
      fn(0, 1);
      return;
    }
    while (static_cast<int>(workers_.size()) < n - 1) {
      int idx = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, idx] { loop(idx); });
      workers_.back().detach();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      active_ = n;
      pending_ = n - 1;
      ++generation_;
    }
    cv_.notify_all();
    fn(0, n);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  Pool() : num_threads_(env_threads()) {}

  void loop(int idx) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int, int)>* fn;
      int n;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        fn = fn_;
        n = active_;
      }
      if (idx < n) {
        (*fn)(idx, n);
        std::lock_guard<std::mutex> lk(mu_);
        if (--pending_ == 0) done_cv_.notify_one();
      }
    }
  }

  std::mutex submit_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int active_ = 0, pending_ = 0;
  int num_threads_;
};

// Above this many bytes, copies store with non-temporal (streaming) stores: the destination is not
// read back soon and is larger than the last-level cache (32 MiB here), so skipping the
// read-for-ownership of every destination line turns 3 memory passes into 2 (measured: 0.62x -> see
// benchmarks/results) - the same trick glibc's memcpy uses for large sizes. The size is that of the
// whole transfer a call belongs to (`whole_bytes`): one layer of a 64 MiB layer-wise load streams too
// (measured: 16 chunks x 8 layers, per-layer runs 5.6 -> 4.8 ms on one thread).
constexpr int64_t kStreamingBytes = 16 * 1024 * 1024;

// Copy one row of `n` bytes (N > 0: compile-time size, so memcpy becomes inline vector moves).
template <int64_t N, bool kStream>
inline void copy_row(char* dst, const char* src, int64_t n) {
  if constexpr (N > 0) n = N;
#if defined(__SSE2__)
  if constexpr (kStream) {
    if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0 && (n & 15) == 0) {
      int64_t k = 0;
      for (; k + 64 <= n; k += 64) {
        __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
        __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 16));
        __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 32));
        __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 48), d);
      }
      for (; k < n; k += 16)
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
      return;
    }
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

// The rows of one (layer, id) pair, walked in the source's memory order: three nested dims (plane,
// token, head) sorted by source stride, so a gather from an LBNHC page reads K row, V row, next head...
// sequentially, and a scatter reads the canonical chunk front to back.
struct Walk {
  int64_t size[3];
  int64_t src_stride[3];
  int64_t dst_stride[3];
};

Walk make_walk(const CopyParams& p, bool gather) {
  const int64_t sizes[3] = {p.paged.num_planes, p.iter_tokens, p.iter_heads};
  const int64_t paged[3] = {p.paged.plane_stride, p.paged.token_stride, p.paged.head_stride};
  const int64_t contig[3] = {p.contig.plane_stride, p.contig.token_stride, p.contig.head_stride};
  const int64_t* src = gather ? paged : contig;
  const int64_t* dst = gather ? contig : paged;
  int order[3] = {0, 1, 2};
  std::sort(order, order + 3, [&](int a, int b) { return std::llabs(src[a]) > std::llabs(src[b]); });
  Walk w{};
  for (int k = 0; k < 3; ++k) {
    w.size[k] = sizes[order[k]];
    w.src_stride[k] = src[order[k]];
    w.dst_stride[k] = dst[order[k]];
  }
  return w;
}

using PairFn = void (*)(const Walk&, char*, const char*, int64_t);

template <int64_t N, bool kStream>
void copy_pair(const Walk& w, char* dst, const char* src, int64_t row_bytes) {
  for (int64_t a = 0; a < w.size[0]; ++a)
    for (int64_t b = 0; b < w.size[1]; ++b) {
      const char* s = src + a * w.src_stride[0] + b * w.src_stride[1];
      char* d = dst + a * w.dst_stride[0] + b * w.dst_stride[1];
      for (int64_t c = 0; c < w.size[2]; ++c)
        copy_row<N, kStream>(d + c * w.dst_stride[2], s + c * w.src_stride[2], row_bytes);
    }
}

template <bool kStream>
PairFn pick_pair_fn(int64_t row_bytes) {
  switch (row_bytes) {
    case 64: return copy_pair<64, kStream>;
    case 128: return copy_pair<128, kStream>;
    case 256: return copy_pair<256, kStream>;
    case 512: return copy_pair<512, kStream>;
    case 576: return copy_pair<576, kStream>;
    case 1024: return copy_pair<1024, kStream>;
    case 1152: return copy_pair<1152, kStream>;
    case 2048: return copy_pair<2048, kStream>;
    default: return copy_pair<0, kStream>;
  }
}

// Copy the (layer, id) pairs [begin, end). Plane 0's offsets come from entry_offsets (kv_layout.h);
// the other planes are one plane stride away on each side.
void copy_pairs(const CopyParams& p, const Walk& w, PairFn fn, const int64_t* layer_ptrs, const int64_t* ids,
                char* contig_base, bool gather, int64_t begin, int64_t end) {
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t layer_idx = pair / p.num_ids, i = pair % p.num_ids;
    const int64_t e = layer_idx * p.paged.num_planes * p.num_ids + i;  // entry (layer, plane 0, i)
    int32_t layer;
    int64_t paged_off, contig_off;
    if (!entry_offsets(p, e, ids, &layer, &paged_off, &contig_off)) continue;
    char* paged = reinterpret_cast<char*>(layer_ptrs[layer]) + paged_off;
    char* contig = contig_base + contig_off;
    if (gather) fn(w, contig, paged, p.row_bytes); else fn(w, paged, contig, p.row_bytes);
  }
#if defined(__SSE2__)
  _mm_sfence();  // order this thread's streaming stores before the pool reports completion
#endif
}

}  // namespace

void copy_many(const CopyParams& params, const int64_t* layer_ptrs, const int64_t* const* ids,
               const int64_t* num_ids, const int64_t* contig, int64_t count, int32_t direction, int num_threads,
               int64_t whole_bytes) {
  // Copy s: `params` with num_ids[s] ids and its own contiguous buffer. Their (layer, id) pairs are
  // numbered one after the other and split evenly over the pool, so the whole batch costs one wake.
  std::vector<CopyParams> ps(static_cast<size_t>(count), params);
  std::vector<int64_t> first(static_cast<size_t>(count) + 1, 0);
  int64_t bytes = 0;
  for (int64_t s = 0; s < count; ++s) {
    CopyParams& p = ps[static_cast<size_t>(s)];
    p.num_ids = num_ids[s];
    collapse_rows(p);  // depends on the strides only: the same rows for every copy
    first[static_cast<size_t>(s) + 1] = first[static_cast<size_t>(s)] + static_cast<int64_t>(p.num_layers) * p.num_ids;
    bytes += num_entries(p) * rows_per_entry(p) * p.row_bytes;
  }
  const int64_t pairs = first.back();
  if (bytes == 0) return;
  const bool gather = direction == kGather;
  const Walk w = make_walk(ps[0], gather);
  const int64_t row_bytes = ps[0].row_bytes;
  const bool stream = std::max(bytes, whole_bytes) >= kStreamingBytes;
  const PairFn fn = stream ? pick_pair_fn<true>(row_bytes) : pick_pair_fn<false>(row_bytes);
  Pool& pool = Pool::get();
  int n = num_threads > 0 ? num_threads : pool.size();
  if (bytes < kSerialBytes) n = 1;
  n = static_cast<int>(std::min<int64_t>(n, pairs));
  pool.run(n, [&](int t, int nt) {
    const int64_t begin = pairs * t / nt, end = pairs * (t + 1) / nt;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t lo = std::max(begin, first[static_cast<size_t>(s)]);
      const int64_t hi = std::min(end, first[static_cast<size_t>(s) + 1]);
      if (lo < hi)
        copy_pairs(ps[static_cast<size_t>(s)], w, fn, layer_ptrs, ids[s], reinterpret_cast<char*>(contig[s]),
                   gather, lo - first[static_cast<size_t>(s)], hi - first[static_cast<size_t>(s)]);
    }
  });
}

void copy(const CopyParams& params, const int64_t* layer_ptrs, const int64_t* ids, int64_t contig,
          int32_t direction, int num_threads) {
  const int64_t num_ids = params.num_ids;
  copy_many(params, layer_ptrs, &ids, &num_ids, &contig, 1, direction, num_threads, 0);
}

void parallel_memcpy(void* dst, const void* src, size_t bytes, int num_threads) {
  Pool& pool = Pool::get();
  int n = num_threads > 0 ? num_threads : pool.size();
  if (static_cast<int64_t>(bytes) < kSerialBytes) n = 1;
  pool.run(n, [&](int w, int nw) {
    // Split on 4 KiB boundaries so every thread streams whole pages.
    const size_t pages = (bytes + 4095) / 4096;
    const size_t b = std::min(bytes, pages * w / nw * 4096), e = std::min(bytes, pages * (w + 1) / nw * 4096);
    if (e > b) std::memcpy(static_cast<char*>(dst) + b, static_cast<const char*>(src) + b, e - b);
  });
}

void copy_runs(const int64_t* dsts, const int64_t* srcs, const int64_t* sizes, int64_t n, int64_t dst_base,
               int64_t src_base, int num_threads) {
  if (num_threads == 1) {  // the calling thread alone: no pool (its lock and dispatch cost ~1 us a run)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(reinterpret_cast<void*>(dsts[i] + dst_base), reinterpret_cast<const void*>(srcs[i] + src_base),
                  static_cast<size_t>(sizes[i]));
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    parallel_memcpy(reinterpret_cast<void*>(dsts[i] + dst_base), reinterpret_cast<const void*>(srcs[i] + src_base),
                    static_cast<size_t>(sizes[i]), num_threads);
}

int populate_write(void* addr, size_t bytes, int num_threads) {
#if defined(__linux__)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t b = (reinterpret_cast<uintptr_t>(addr) + page - 1) / page * page;
  const uintptr_t e = (reinterpret_cast<uintptr_t>(addr) + bytes) / page * page;
  if (e <= b) return 0;
  const size_t pages = (e - b) / page;
  Pool& pool = Pool::get();
  int n = num_threads > 0 ? num_threads : pool.size();
  n = static_cast<int>(std::min<size_t>(static_cast<size_t>(n), pages));
  std::vector<int> errs(static_cast<size_t>(n), 0);
  pool.run(n, [&](int w, int nw) {
    const uintptr_t lo = b + pages * w / nw * page, hi = b + pages * (w + 1) / nw * page;
    if (hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE) != 0) errs[w] = errno;
  });
  for (int err : errs)
    if (err) return err;
  return 0;
#else
  (void)addr;
  (void)bytes;
  (void)num_threads;
  return ENOSYS;
#endif
}

int get_num_threads() { return Pool::get().size(); }
void set_num_threads(int n) { Pool::get().set_size(n); }

}  // namespace kvx::cpu
