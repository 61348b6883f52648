// copy_plan.cpp - planning a set of copies into legs (copy_plan.h), and the host executors.
#include "copy_plan.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../cpu/copy_cpu.h"
#if defined(KVX_WITH_CUDA)
#include "../cuda/copy_sim.h"
#endif

namespace kvx {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// One dim of a nest of rows: its size and its byte strides on the two sides (a: the buffer, b: the staging).
struct Dim {
  int64_t size, a, b;
};

// Emit the runs of a nest of `n` dims (outer -> inner) over rows of `row` bytes, dense on both sides: the inner dims
// whose rows continue each other on both sides are merged first, then the outer ones are walked (an odometer).
template <typename Emit>
void emit_nest(const Dim* d, int n, int64_t row, int64_t a0, int64_t b0, Emit&& emit) {
  int64_t run = row;
  int k = n;
  while (k > 0 && (d[k - 1].size == 1 || (d[k - 1].a == run && d[k - 1].b == run))) {
    run *= d[k - 1].size;
    --k;
  }
  for (int i = 0; i < k; ++i)
    if (d[i].size == 0) return;
  int64_t idx[4] = {0, 0, 0, 0};
  while (true) {
    int64_t a = a0, b = b0;
    for (int i = 0; i < k; ++i) {
      a += idx[i] * d[i].a;
      b += idx[i] * d[i].b;
    }
    emit(a, b, run);
    int i = k - 1;
    while (i >= 0 && ++idx[i] == d[i].size) idx[i--] = 0;
    if (i < 0) return;
  }
}

bool same_geometry(const CopyParams& x, const CopyParams& y) {
  return std::memcmp(&x.paged, &y.paged, sizeof(PagedDesc)) == 0 &&
         std::memcmp(&x.contig, &y.contig, sizeof(ContigDesc)) == 0 && x.row_bytes == y.row_bytes &&
         x.num_layers == y.num_layers && x.mode == y.mode;
}

}  // namespace

CopyPlan::CopyPlan(std::vector<int64_t> layer_ptrs, int64_t layer_ptrs_dev, std::vector<int64_t> layer_bounds,
                   int32_t impl)
    : layer_ptrs_(std::move(layer_ptrs)),
      layer_ptrs_dev_(layer_ptrs_dev),
      layer_bounds_(std::move(layer_bounds)),
      impl_(impl) {
  if (layer_ptrs_.empty()) throw std::invalid_argument("layer_ptrs: expected at least one layer, got none");
  if (layer_bounds_.size() != 2 * layer_ptrs_.size())
    throw std::invalid_argument("layer_bounds: expected 2 per layer (" + str(2 * layer_ptrs_.size()) + "), got " +
                                str(layer_bounds_.size()));
  if (impl < kImplCpu || impl > kImplPython)
    throw std::invalid_argument("impl: expected 0 (cpu), 1 (cuda), 2 (cuda_sim) or 3 (python), got " + str(impl));
}

int32_t CopyPlan::add(const CopySpec& spec, const int64_t* ids) {
  if (built_) throw std::logic_error("add: the plan is built; add copies before build()");
  if (spec.direction != kGather && spec.direction != kScatter)
    throw std::invalid_argument("direction: expected 0 (gather) or 1 (scatter), got " + str(spec.direction));
  if (direction_ >= 0 && spec.direction != direction_)
    throw std::invalid_argument(std::string("op: expected ") + (direction_ == kGather ? "gathers" : "scatters") +
                                " only (one direction per plan)");
  if (spec.params.num_layers != num_layers())
    throw std::invalid_argument("params.num_layers: expected the plan's " + str(num_layers()) + ", got " +
                                str(spec.params.num_layers));
  if (spec.unit < 1 || spec.group < 0 || spec.group > 2)
    throw std::invalid_argument("unit, group: expected unit >= 1 and group in 0..2, got " + str(spec.unit) + ", " +
                                str(spec.group));
  direction_ = spec.direction;
  copies_.push_back(spec);
  copy_ids_.emplace_back(ids, ids + spec.params.num_ids);
  return static_cast<int32_t>(copies_.size() - 1);
}

int64_t CopyPlan::id_bytes(const CopySpec& c) const {
  const CopyParams& p = c.params;
  return static_cast<int64_t>(p.paged.num_planes) * c.unit * p.paged.num_heads * p.row_bytes;
}

int64_t CopyPlan::nbytes() const {
  int64_t n = 0;
  for (const CopySpec& c : copies_) n += id_bytes(c) * c.params.num_ids;
  return n * num_layers();
}

int64_t CopyPlan::min_staging_bytes() const {
  int64_t n = 0;
  for (const CopySpec& c : copies_) n = std::max(n, id_bytes(c));
  return n;
}

std::pair<int32_t, int32_t> CopyPlan::range_legs(int32_t r) const {
  if (r < 0 || r >= num_ranges())
    throw std::out_of_range("range: expected 0 <= range < " + str(num_ranges()) + ", got " + str(r));
  return range_legs_[r];
}

bool CopyPlan::direct_fits(int32_t i, int64_t min_run) const {
  const CopySpec& c = copies_.at(i);
  CopyParams p = c.params;
  p.num_layers = 1;
  return plan_runs(p, layer_ptrs_.data(), copy_ids_[i].data(), c.contig, c.direction, min_run,
                   [](int64_t, int64_t, int64_t) {});
}

void CopyPlan::emit(int64_t dst, int64_t src, int64_t bytes) {
  if (bytes <= 0) return;
  if (!run_bytes_.empty()) {
    const size_t k = run_bytes_.size() - 1;
    if (static_cast<int64_t>(run_bytes_.size()) > legs_.back().run_lo && run_dst_[k] + run_bytes_[k] == dst &&
        run_src_[k] + run_bytes_[k] == src) {
      run_bytes_[k] += bytes;
      return;
    }
  }
  run_dst_.push_back(dst);
  run_src_.push_back(src);
  run_bytes_.push_back(bytes);
}

void CopyPlan::build(int32_t path, const std::vector<std::pair<int32_t, int32_t>>& ranges, int64_t capacity,
                     int64_t dma_min_run, int sm_count, int max_ctas) {
  if (built_) throw std::logic_error("build: the plan is built already");
  if (path < kPathKernel || path > kPathAuto)
    throw std::invalid_argument("path: expected 0 (kernel), 1 (dma), 2 (staged) or 3 (auto), got " + str(path));
  const int32_t L = num_layers();
  for (const auto& r : ranges)
    if (!(0 <= r.first && r.first < r.second && r.second <= L))
      throw std::invalid_argument("ranges: expected (start, end) with 0 <= start < end <= " + str(L) + ", got (" +
                                  str(r.first) + ", " + str(r.second) + ")");
  sm_count_ = sm_count;
  max_ctas_ = max_ctas;
  if (path == kPathAuto) {
    bool direct = !copies_.empty();
    for (int32_t i = 0; direct && i < static_cast<int32_t>(copies_.size()); ++i) direct = direct_fits(i, dma_min_run);
    path = direct ? kPathDma : kPathStaged;
  }
  path_ = path;
  built_ = true;
  if (copies_.empty()) {
    range_legs_.assign(ranges.size(), {0, 0});
    return;
  }
  // the kernel path's ids: every copy's, as added
  if (path_ == kPathKernel) {
    for (size_t i = 0; i < copies_.size(); ++i) {
      copy_ids_at_.push_back(static_cast<int64_t>(ids_.size()));
      ids_.insert(ids_.end(), copy_ids_[i].begin(), copy_ids_[i].end());
    }
  }
  int64_t per_layer = 0;
  for (const CopySpec& c : copies_) per_layer += id_bytes(c) * c.params.num_ids;
  std::vector<Piece> whole;
  for (size_t i = 0; i < copies_.size(); ++i)
    whole.push_back(Piece{static_cast<int32_t>(i), 0, copies_[i].params.num_ids});
  std::vector<std::pair<std::vector<Piece>, int64_t>> specs;  // staged: each share's pieces and its groups' ids
  if (path_ == kPathStaged) {
    const int64_t least = min_staging_bytes();
    if (capacity < least)
      throw std::invalid_argument("capacity: expected at least " + str(least) +
                                  " bytes (one block of one layer of this batch) for a staging buffer, got " +
                                  str(capacity));
  }
  for (int32_t r = 0; r < static_cast<int32_t>(ranges.size()); ++r) {
    const int32_t a = ranges[r].first, b = ranges[r].second;
    const int32_t first = static_cast<int32_t>(legs_.size());
    if (path_ == kPathKernel) {
      plan_kernel(a, b, r);
    } else if (path_ == kPathDma) {
      plan_direct(a, b, r);
    } else {
      const int64_t fit = capacity / per_layer;
      if (fit >= 1) {
        const int32_t layers = static_cast<int32_t>(std::min<int64_t>(b - a, fit));
        for (int32_t s = a; s < b; s += layers) plan_staged(whole, s, std::min(b, s + layers), r, &specs);
      } else {
        // the copies of one layer in shares of at most `capacity` bytes, in order, cut between ids
        std::vector<std::vector<Piece>> shares(1);
        int64_t used = 0;
        for (size_t i = 0; i < copies_.size(); ++i) {
          const int64_t ib = id_bytes(copies_[i]), n = copies_[i].params.num_ids;
          int64_t lo = 0;
          while (lo < n) {
            const int64_t fits = (capacity - used) / ib;
            if (fits <= 0) {
              shares.emplace_back();
              used = 0;
              continue;
            }
            const int64_t hi = std::min(n, lo + fits);
            shares.back().push_back(Piece{static_cast<int32_t>(i), lo, hi});
            used += (hi - lo) * ib;
            lo = hi;
          }
        }
        for (const auto& share : shares)
          if (!share.empty())
            for (int32_t l = a; l < b; ++l) plan_staged(share, l, l + 1, r, &specs);
      }
    }
    range_legs_.emplace_back(first, static_cast<int32_t>(legs_.size()));
  }
  touched.assign(legs_.size(), nullptr);
  done.assign(legs_.size(), nullptr);
}

void CopyPlan::plan_kernel(int32_t start, int32_t end, int32_t range) {
  Leg leg{start, end, range, 0, 0, 0, 0, static_cast<int32_t>(launches_.size()), 0};
  for (size_t i = 0; i < copies_.size(); ++i) {
    const CopySpec& c = copies_[i];
    Launch l{};
    l.params = c.params;
    l.params.num_layers = end - start;
    l.direction = c.direction;
    l.first_layer = start;
    l.group = c.group;
    l.copy = static_cast<int32_t>(i);
    l.ids_at = copy_ids_at_[i];
    l.contig = c.contig + static_cast<int64_t>(start) * c.params.contig.layer_stride;
    l.span_lo = c.span_lo;
    l.span_hi = c.span_hi;
    if (sm_count_ > 0)
      l.config = cuda::kernel_launch_config(l.params, layer_ptrs_.data() + start, l.contig, sm_count_, max_ctas_);
    launches_.push_back(l);
    leg.nbytes += id_bytes(c) * c.params.num_ids * (end - start);
  }
  leg.launch_hi = static_cast<int32_t>(launches_.size());
  leg.run_lo = leg.run_hi = static_cast<int64_t>(run_bytes_.size());
  legs_.push_back(leg);
}

void CopyPlan::plan_direct(int32_t start, int32_t end, int32_t range) {
  Leg leg{start, end, range, 0, 0, static_cast<int64_t>(run_bytes_.size()), 0,
          static_cast<int32_t>(launches_.size()), static_cast<int32_t>(launches_.size())};
  legs_.push_back(leg);
  const bool gather = direction_ == kGather;
  // one layer's runs per copy (kv_layout.h plan_runs, what a DMA executor issues), then every layer's: the block
  // side moves with the layer's base, the buffer side by its layer stride
  std::vector<std::vector<int64_t>> tmpl(copies_.size());
  for (size_t i = 0; i < copies_.size(); ++i) {
    CopyParams p = copies_[i].params;
    p.num_layers = 1;
    auto& t = tmpl[i];
    plan_runs(p, layer_ptrs_.data(), copy_ids_[i].data(), copies_[i].contig, copies_[i].direction, 0,
              [&t](int64_t d, int64_t s, int64_t n) {
                t.push_back(d);
                t.push_back(s);
                t.push_back(n);
              });
  }
  int64_t moved = 0;
  for (int32_t l = start; l < end; ++l) {
    const int64_t paged = layer_ptrs_[l] - layer_ptrs_[0];
    for (size_t i = 0; i < copies_.size(); ++i) {
      const int64_t host = static_cast<int64_t>(l) * copies_[i].params.contig.layer_stride;
      const auto& t = tmpl[i];
      for (size_t k = 0; k < t.size(); k += 3) {
        emit(t[k] + (gather ? host : paged), t[k + 1] + (gather ? paged : host), t[k + 2]);
        moved += t[k + 2];
      }
    }
  }
  legs_.back().nbytes = moved;
  legs_.back().run_hi = static_cast<int64_t>(run_bytes_.size());
}

void CopyPlan::plan_staged(const std::vector<Piece>& pieces, int32_t start, int32_t end, int32_t range,
                           std::vector<std::pair<std::vector<Piece>, int64_t>>* specs) {
  // the share's groups: their ids once per share (every layer's leg of it launches with the same ids)
  size_t spec = 0;
  while (spec < specs->size()) {
    const auto& s = (*specs)[spec].first;
    if (s.size() == pieces.size() &&
        std::equal(s.begin(), s.end(), pieces.begin(), [](const Piece& x, const Piece& y) {
          return x.copy == y.copy && x.lo == y.lo && x.hi == y.hi;
        }))
      break;
    ++spec;
  }
  const bool fresh = spec == specs->size();
  if (fresh) specs->emplace_back(pieces, static_cast<int64_t>(ids_.size()));
  int64_t ids_at = (*specs)[spec].second;

  Leg leg{start, end, range, 0, 0, static_cast<int64_t>(run_bytes_.size()), 0,
          static_cast<int32_t>(launches_.size()), 0};
  struct Group {
    int32_t group = -1;
    std::vector<Piece> pieces;
    int64_t entries = 0, offset = 0, bytes = 0;
    bool outer = true;
  };
  std::vector<Group> groups;
  for (int32_t g = 0; g < 3; ++g) {
    Group grp;
    grp.group = g;
    for (const Piece& pc : pieces)
      if (copies_[pc.copy].group == g) {
        const CopySpec& c = copies_[pc.copy];
        grp.pieces.push_back(pc);
        grp.entries += (pc.hi - pc.lo) * c.unit;
        grp.bytes += (pc.hi - pc.lo) * id_bytes(c);
        grp.outer = grp.outer && c.head_major;
      }
    if (grp.pieces.empty()) continue;
    grp.offset = leg.layer_bytes;
    leg.layer_bytes += grp.bytes;
    groups.push_back(std::move(grp));
  }
  leg.nbytes = leg.layer_bytes * (end - start);
  legs_.push_back(leg);
  for (const Group& grp : groups) {
    const CopySpec& c0 = copies_[grp.pieces[0].copy];
    const int64_t P = c0.params.paged.num_planes, H = c0.params.paged.num_heads, R = c0.params.row_bytes;
    ContigDesc region{};
    region.layer_stride = leg.layer_bytes;
    if (grp.outer) {
      region.head_stride = P * grp.entries * R;
      region.plane_stride = grp.entries * R;
      region.token_stride = R;
    } else {
      region.plane_stride = grp.entries * H * R;
      region.token_stride = H * R;
      region.head_stride = R;
    }
    int64_t n = 0;
    for (const Piece& pc : grp.pieces) n += pc.hi - pc.lo;
    if (fresh)
      for (const Piece& pc : grp.pieces)
        ids_.insert(ids_.end(), copy_ids_[pc.copy].begin() + pc.lo, copy_ids_[pc.copy].begin() + pc.hi);
    Launch l{};
    l.params = make_params(c0.params.paged, region, R, end - start, n, c0.params.mode);
    l.direction = direction_;
    l.first_layer = start;
    l.group = grp.group;
    l.copy = -1;
    l.head_major = grp.outer;
    l.ids_at = ids_at;
    l.contig = grp.offset;
    l.entries = grp.entries;
    l.region_bytes = grp.bytes;
    l.span_lo = grp.offset;
    l.span_hi = (end - start - 1) * leg.layer_bytes + grp.offset + grp.bytes;
    if (sm_count_ > 0)
      l.config = cuda::kernel_launch_config(l.params, layer_ptrs_.data() + start, l.contig, sm_count_, 0);
    launches_.push_back(l);
    ids_at += n;
  }
  legs_.back().launch_hi = static_cast<int32_t>(launches_.size());
  // the runs between each piece's rows in its buffer and its place in the group's region, layer by layer
  const bool gather = direction_ == kGather;
  for (int32_t layer = start; layer < end; ++layer) {
    const int64_t stage_layer = static_cast<int64_t>(layer - start) * leg.layer_bytes;
    for (const Group& grp : groups) {
      int64_t at = 0;  // entries of the group before this piece
      for (const Piece& pc : grp.pieces) {
        const CopySpec& c = copies_[pc.copy];
        const CopyParams& p = c.params;
        const int64_t P = p.paged.num_planes, H = p.paged.num_heads, R = p.row_bytes;
        const int64_t sp = grp.outer ? grp.entries * R : grp.entries * H * R;
        const int64_t st = grp.outer ? R : H * R;
        const int64_t sh = grp.outer ? P * grp.entries * R : R;
        const int64_t host0 = c.contig + layer * p.contig.layer_stride;
        const int64_t stage0 = stage_layer + grp.offset;
        auto span = [&](int64_t t0, int64_t t1) {  // entries [t0, t1) of the copy's contiguous side
          const Dim pd{P, p.contig.plane_stride, sp}, td{t1 - t0, p.contig.token_stride, st},
              hd{H, p.contig.head_stride, sh};
          const Dim dims[3] = {grp.outer ? hd : pd, grp.outer ? pd : td, grp.outer ? td : hd};
          const int64_t a0 = host0 + t0 * p.contig.token_stride;
          const int64_t b0 = stage0 + (at + t0 - pc.lo * c.unit) * st;
          emit_nest(dims, 3, R, a0, b0, [&](int64_t a, int64_t b, int64_t bytes) {
            if (gather)
              emit(a, b, bytes);
            else
              emit(b, a, bytes);
          });
        };
        if (p.mode == kSlots) {  // padding slots move nothing: the valid spans
          const int64_t* ids = copy_ids_[pc.copy].data();
          int64_t s = -1;
          for (int64_t j = pc.lo; j <= pc.hi; ++j) {
            const bool ok = j < pc.hi && ids[j] >= 0;
            if (ok && s < 0) s = j;
            if (!ok && s >= 0) {
              span(s, j);
              s = -1;
            }
          }
        } else {
          span(pc.lo * c.unit, pc.hi * c.unit);
        }
        at += (pc.hi - pc.lo) * c.unit;
      }
    }
  }
  legs_.back().run_hi = static_cast<int64_t>(run_bytes_.size());
}

void CopyPlan::dma_host(int32_t leg, int64_t staging, int num_threads) const {
  const Leg& p = legs_.at(leg);
  const int64_t n = p.run_hi - p.run_lo;
  if (n <= 0) return;
  cpu::copy_runs(run_dst_.data() + p.run_lo, run_src_.data() + p.run_lo, run_bytes_.data() + p.run_lo, n,
                 dst_staged() ? staging : 0, src_staged() ? staging : 0, num_threads);
}

void CopyPlan::reshape_host(int32_t leg, int64_t staging, int num_threads, int sim_sm_count, int sim_max_ctas) const {
  const Leg& p = legs_.at(leg);
  const int64_t base = path_ == kPathStaged ? staging : 0;
  const int64_t whole = nbytes();
  for (int32_t i = p.launch_lo; i < p.launch_hi;) {
    const Launch& l = launches_[i];
    const int64_t* layers = layer_ptrs_.data() + l.first_layer;
    if (impl_ == kImplSim) {
#if defined(KVX_WITH_CUDA)
      const cuda::SimReport r =
          cuda::simulate_copy(l.params, layers, layer_bounds_.data() + 2 * l.first_layer, ids_.data() + l.ids_at,
                              base + l.contig, base + l.span_lo, base + l.span_hi, l.direction, sim_sm_count,
                              path_ == kPathStaged ? 0 : sim_max_ctas, 0);
      if (!r.fault.empty()) throw std::runtime_error(r.fault);
      ++i;
      continue;
#else
      throw std::runtime_error("impl cuda_sim: kvx._C was built without nvcc");
#endif
    }
    if (impl_ != kImplCpu) throw std::runtime_error("reshape_host: the plan's impl does not run on the host");
    // the launches after this one with the same geometry (a layer of every chunk): one parallel region
    int32_t j = i + 1;
    while (j < p.launch_hi && same_geometry(launches_[j].params, l.params) && launches_[j].direction == l.direction)
      ++j;
    std::vector<const int64_t*> ids;
    std::vector<int64_t> num_ids, contig;
    for (int32_t k = i; k < j; ++k) {
      ids.push_back(ids_.data() + launches_[k].ids_at);
      num_ids.push_back(launches_[k].params.num_ids);
      contig.push_back(base + launches_[k].contig);
    }
    cpu::copy_many(l.params, layers, ids.data(), num_ids.data(), contig.data(), j - i, l.direction, num_threads,
                   whole);
    i = j;
  }
}

#if !defined(KVX_WITH_CUDA)
int CopyPlan::dma_cuda(int32_t, int64_t, int64_t) const {
  throw std::runtime_error("dma_cuda: kvx._C was built without the CUDA kernels");
}
int CopyPlan::reshape_cuda(int32_t, int64_t, int64_t) {
  throw std::runtime_error("reshape_cuda: kvx._C was built without the CUDA kernels");
}
CopyPlan::~CopyPlan() = default;
#endif

}  // namespace kvx
