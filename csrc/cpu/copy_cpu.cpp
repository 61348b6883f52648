// copy_cpu.cpp - the CPU implementation: a persistent thread pool walking the row space of
// kv_layout.h and copying each row with memcpy (fixed-size specialisations for common row sizes).
#include "copy_cpu.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

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

// Copy `count` rows of a compile-time size: memcpy with a constant length compiles to vector moves.
template <int64_t N>
void copy_rows_fixed(const CopyParams& p, char* paged, char* contig, int64_t r0, int64_t count,
                     bool gather) {
  for (int64_t r = r0; r < r0 + count; ++r) {
    char* a = paged + row_paged_offset(p, r);
    char* b = contig + row_contig_offset(p, r);
    if (gather) std::memcpy(b, a, N); else std::memcpy(a, b, N);
  }
}

void copy_rows_any(const CopyParams& p, char* paged, char* contig, int64_t r0, int64_t count,
                   bool gather) {
  const int64_t n = p.row_bytes;
  for (int64_t r = r0; r < r0 + count; ++r) {
    char* a = paged + row_paged_offset(p, r);
    char* b = contig + row_contig_offset(p, r);
    if (gather) std::memcpy(b, a, n); else std::memcpy(a, b, n);
  }
}

using RowFn = void (*)(const CopyParams&, char*, char*, int64_t, int64_t, bool);

RowFn pick_row_fn(int64_t row_bytes) {
  switch (row_bytes) {
    case 64: return copy_rows_fixed<64>;
    case 128: return copy_rows_fixed<128>;
    case 256: return copy_rows_fixed<256>;
    case 512: return copy_rows_fixed<512>;
    case 576: return copy_rows_fixed<576>;
    case 1024: return copy_rows_fixed<1024>;
    case 1152: return copy_rows_fixed<1152>;
    case 2048: return copy_rows_fixed<2048>;
    default: return copy_rows_any;
  }
}

// Copy the flat rows [begin, end) of the (entry, row) space.
void copy_range(const CopyParams& p, const int64_t* layer_ptrs, const int64_t* ids, char* contig_base,
                bool gather, RowFn row_fn, int64_t begin, int64_t end) {
  const int64_t rpe = rows_per_entry(p);
  int64_t e = begin / rpe, r = begin % rpe;
  for (int64_t done = begin; done < end; ++e, r = 0) {
    const int64_t count = std::min(rpe - r, end - done);
    int32_t layer;
    int64_t paged_off, contig_off;
    if (entry_offsets(p, e, ids, &layer, &paged_off, &contig_off)) {
      char* paged = reinterpret_cast<char*>(layer_ptrs[layer]) + paged_off;
      row_fn(p, paged, contig_base + contig_off, r, count, gather);
    }
    done += count;
  }
}

}  // namespace

void copy(const CopyParams& params, const int64_t* layer_ptrs, const int64_t* ids, int64_t contig,
          int32_t direction, int num_threads) {
  CopyParams p = params;
  collapse_rows(p);
  const int64_t total_rows = num_entries(p) * rows_per_entry(p);
  if (total_rows == 0) return;
  const bool gather = direction == kGather;
  const RowFn row_fn = pick_row_fn(p.row_bytes);
  char* contig_base = reinterpret_cast<char*>(contig);
  Pool& pool = Pool::get();
  int n = num_threads > 0 ? num_threads : pool.size();
  if (total_rows * p.row_bytes < kSerialBytes) n = 1;
  n = static_cast<int>(std::min<int64_t>(n, total_rows));
  pool.run(n, [&](int w, int nw) {
    const int64_t begin = total_rows * w / nw, end = total_rows * (w + 1) / nw;
    copy_range(p, layer_ptrs, ids, contig_base, gather, row_fn, begin, end);
  });
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

int get_num_threads() { return Pool::get().size(); }
void set_num_threads(int n) { Pool::get().set_size(n); }

}  // namespace kvx::cpu
