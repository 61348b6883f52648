// plan/bindings.cpp - kvx._C's plan classes: CopyPlan, Event, Queues (and its engines), StagingRing, the issue
// functions. Called from the module's init in ../bindings.cpp. Validation of the copies lives in
// kvx/kernels/plan.py; these entry points check what a wrong call would turn into a fault.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "copy_plan.h"
#include "queues.h"
#if defined(KVX_WITH_CUDA)
#include "queues_cuda.h"
#endif

namespace py = pybind11;

namespace kvx {
namespace {

// A point on a queue of a Python engine (kvx/engine.py): its payload is that engine's Job.
class PyEvent : public Event {
 public:
  explicit PyEvent(py::object job) : job_(std::move(job)) {}
  ~PyEvent() override {
    py::gil_scoped_acquire gil;
    job_ = py::object();
  }
  bool query() override {
    py::gil_scoped_acquire gil;
    return job_.is_none() || job_.attr("done")().cast<bool>();
  }
  void synchronize() override {
    py::gil_scoped_acquire gil;
    if (!job_.is_none()) job_.attr("wait")();
  }
  py::object job() const { return job_; }

 private:
  py::object job_;
};

// Queues implemented in Python: the CPU engines' (thread, deferred).
class PyQueues : public Queues {
 public:
  using Queues::Queues;
  EventPtr record(int32_t queue) override { PYBIND11_OVERRIDE_PURE(EventPtr, Queues, record, queue); }
  void wait(int32_t queue, const EventPtr& event) override {
    PYBIND11_OVERRIDE_PURE(void, Queues, wait, queue, event);
  }
  void dma(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) override {
    PYBIND11_OVERRIDE_PURE(void, Queues, dma, queue, plan, leg, staging);
  }
  void reshape(int32_t queue, const PlanPtr& plan, int32_t leg, int64_t staging) override {
    PYBIND11_OVERRIDE_PURE(void, Queues, reshape, queue, plan, leg, staging);
  }
};

template <typename T>
py::array_t<int64_t> slice(const std::vector<T>& v, int64_t lo, int64_t hi) {
  return py::array_t<int64_t>(static_cast<py::ssize_t>(hi - lo), v.data() + lo);
}

const Leg& leg_of(const CopyPlan& plan, int32_t k) {
  if (k < 0 || k >= static_cast<int32_t>(plan.legs().size()))
    throw std::out_of_range("leg: expected 0 <= leg < " + std::to_string(plan.legs().size()) + ", got " +
                            std::to_string(k));
  return plan.legs()[k];
}

py::dict launch_dict(const Launch& l) {
  py::dict d;
  d["first_layer"] = l.first_layer;
  d["num_layers"] = l.params.num_layers;
  d["group"] = l.group;
  d["copy"] = l.copy;
  d["head_major"] = static_cast<bool>(l.head_major);
  d["ids_at"] = l.ids_at;
  d["num_ids"] = l.params.num_ids;
  d["contig"] = l.contig;
  d["entries"] = l.entries;
  d["region_bytes"] = l.region_bytes;
  d["layer_stride"] = l.params.contig.layer_stride;
  d["plane_stride"] = l.params.contig.plane_stride;
  d["token_stride"] = l.params.contig.token_stride;
  d["head_stride"] = l.params.contig.head_stride;
  d["row_bytes"] = l.params.row_bytes;
  d["ctas"] = l.config.ctas;
  d["width"] = l.config.width;
  return d;
}

}  // namespace

void bind_plan(py::module_& m) {
  py::class_<Event, std::shared_ptr<Event>>(
      m, "Event",
      "A point on a copy queue (queues.h): later work may be ordered after it. Event() is a point already passed; "
      "Event.of(job) is a Python engine's job; a CUDA engine's are pooled CUDA events.")
      .def(py::init<>())
      .def_static(
          "of", [](py::object job) -> EventPtr { return std::make_shared<PyEvent>(std::move(job)); }, py::arg("job"))
      .def("query", &Event::query, "Whether it passed (never waits).")
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Wait on the host until it passed.")
      .def_property_readonly(
          "payload",
          [](const EventPtr& e) -> py::object {
            auto* p = dynamic_cast<PyEvent*>(e.get());
            return p != nullptr ? p->job() : py::object(py::none());
          },
          "The Python engine's job this point is (None: another engine's event, or a point passed).");

  py::class_<Queues, PyQueues, std::shared_ptr<Queues>>(
      m, "Queues",
      "An engine's copy queues as the compiled issue path sees them (queues.h): record(queue) -> Event, "
      "wait(queue, event), dma(queue, plan, leg, staging), reshape(queue, plan, leg, staging). Queues 0 load, 1 "
      "save, 2 h2d, 3 d2h, 4 compute. Subclass it in Python for an engine of Python jobs.")
      .def(py::init<>())
      .def("record", &Queues::record, py::arg("queue"))
      .def("wait", &Queues::wait, py::arg("queue"), py::arg("event"));

  py::class_<NullQueues, Queues, std::shared_ptr<NullQueues>>(
      m, "NullQueues", "Queues that run nothing and count the CUDA API calls a CUDA engine would make.")
      .def(py::init<>())
      .def_readonly("records", &NullQueues::records)
      .def_readonly("waits", &NullQueues::waits)
      .def_readonly("dma_calls", &NullQueues::dma_calls)
      .def_readonly("launches", &NullQueues::launches)
      .def_readonly("uploads", &NullQueues::uploads)
      .def_property_readonly("total", &NullQueues::total)
      .def("reset", [](NullQueues& q) { q.records = q.waits = q.dma_calls = q.launches = q.uploads = 0; });

#if defined(KVX_WITH_CUDA)
  py::class_<cuda::CudaQueues, Queues, std::shared_ptr<cuda::CudaQueues>>(
      m, "CudaQueues", "A CUDA engine's queues: streams (load, save, h2d, d2h handles) and pooled events.")
      .def(py::init([](int64_t load, int64_t save, int64_t h2d, int64_t d2h) {
             return std::make_shared<cuda::CudaQueues>(std::array<int64_t, 4>{load, save, h2d, d2h});
           }),
           py::arg("load"), py::arg("save"), py::arg("h2d"), py::arg("d2h"))
      .def_property("compute", &cuda::CudaQueues::compute, &cuda::CudaQueues::set_compute,
                    "The compute stream's handle (the forward's: set by the engine at each step).");
  py::class_<cuda::StreamQueues, Queues, std::shared_ptr<cuda::StreamQueues>>(
      m, "StreamQueues", "Every queue on one CUDA stream (a one-off copy on the caller's stream).")
      .def(py::init<int64_t>(), py::arg("stream"));
#endif

  py::class_<StagingRing, std::shared_ptr<StagingRing>>(
      m, "StagingRing",
      "Staging buffers (addresses) of `capacity` bytes handed out in turn, each with the jobs its next writer "
      "follows (rule 5). rule5 = False is a test's seeded bug.")
      .def(py::init<std::vector<int64_t>, int64_t>(), py::arg("buffers"), py::arg("capacity"))
      .def("acquire",
           [](StagingRing& r) {
             std::vector<EventPtr> users;
             const int32_t i = r.acquire(&users);
             return py::make_tuple(i, r.address(i), users);
           })
      .def("note", &StagingRing::note, py::arg("index"), py::arg("user"))
      .def("address", &StagingRing::address, py::arg("index"))
      .def_property_readonly("capacity", &StagingRing::capacity)
      .def_property_readonly("count", &StagingRing::count)
      .def_readwrite("rule5", &StagingRing::rule5);

  py::class_<CopyPlan, std::shared_ptr<CopyPlan>>(
      m, "CopyPlan",
      "A set of copies between the paged layers and contiguous buffers, planned into legs (copy_plan.h). Built "
      "by kvx.kernels.plan, which checks the copies first.")
      .def(py::init([](int64_t layer_ptrs, int32_t num_layers, int64_t layer_ptrs_dev, int64_t layer_bounds,
                       int32_t impl) {
             if (num_layers < 1) throw std::invalid_argument("num_layers: expected >= 1");
             const auto* p = reinterpret_cast<const int64_t*>(layer_ptrs);
             const auto* b = reinterpret_cast<const int64_t*>(layer_bounds);
             return std::make_shared<CopyPlan>(std::vector<int64_t>(p, p + num_layers), layer_ptrs_dev,
                                               std::vector<int64_t>(b, b + 2 * num_layers), impl);
           }),
           py::arg("layer_ptrs"), py::arg("num_layers"), py::arg("layer_ptrs_dev"), py::arg("layer_bounds"),
           py::arg("impl"),
           "layer_ptrs: address of [num_layers] int64 layer bases; layer_bounds: of [num_layers, 2] byte extents; "
           "layer_ptrs_dev: the device table (0: none); impl: 0 cpu, 1 cuda, 2 cuda_sim, 3 python.")
      .def(
          "add",
          [](CopyPlan& plan, const PagedDesc& paged, int64_t layer_stride, int64_t plane_stride, int64_t token_stride,
             int64_t head_stride, int64_t row_bytes, int32_t mode, int32_t direction, int64_t ids, int64_t num_ids,
             int64_t contig, int64_t span_lo, int64_t span_hi, int32_t unit, int32_t group, bool head_major,
             bool on_host) {
            if (mode != kBlocks && mode != kSlots) throw std::invalid_argument("mode: expected 0 or 1");
            CopySpec s{};
            s.params = make_params(paged, ContigDesc{layer_stride, plane_stride, token_stride, head_stride}, row_bytes,
                                   plan.num_layers(), num_ids, mode);
            s.direction = direction;
            s.unit = unit;
            s.group = group;
            s.head_major = head_major;
            s.on_host = on_host;
            s.contig = contig;
            s.span_lo = span_lo;
            s.span_hi = span_hi;
            return plan.add(s, reinterpret_cast<const int64_t*>(ids));
          },
          py::arg("paged"), py::arg("layer_stride"), py::arg("plane_stride"), py::arg("token_stride"),
          py::arg("head_stride"), py::arg("row_bytes"), py::arg("mode"), py::arg("direction"), py::arg("ids"),
          py::arg("num_ids"), py::arg("contig"), py::arg("span_lo"), py::arg("span_hi"), py::arg("unit"),
          py::arg("group"), py::arg("head_major"), py::arg("on_host"),
          "Add a copy: the paged side's descriptor, the buffer's byte strides over [layers, planes, tokens, heads] "
          "(rows dense), ids (address of num_ids int64, copied), the buffer's address and extent. Returns its index.")
      .def("direct_fits", &CopyPlan::direct_fits, py::arg("copy"), py::arg("min_run"))
      .def(
          "build",
          [](CopyPlan& plan, int32_t path, const std::vector<std::pair<int32_t, int32_t>>& ranges, int64_t capacity,
             int64_t dma_min_run, int sm_count, int max_ctas) {
            plan.build(path, ranges, capacity, dma_min_run, sm_count, max_ctas);
          },
          py::arg("path"), py::arg("ranges"), py::arg("capacity"), py::arg("dma_min_run"), py::arg("sm_count"),
          py::arg("max_ctas"))
      .def_property_readonly("path", &CopyPlan::path)
      .def_property_readonly("gather", &CopyPlan::gather)
      .def_property_readonly("impl", &CopyPlan::impl)
      .def_property_readonly("num_legs", [](const CopyPlan& p) { return static_cast<int32_t>(p.legs().size()); })
      .def_property_readonly("num_ranges", &CopyPlan::num_ranges)
      .def_property_readonly("nbytes", &CopyPlan::nbytes)
      .def_property_readonly("min_staging_bytes", &CopyPlan::min_staging_bytes)
      .def_property_readonly("num_ids", [](const CopyPlan& p) { return static_cast<int64_t>(p.ids().size()); },
                             "Ids in the plan's id table (its launches').")
      .def("set_device_ids", &CopyPlan::set_device_ids, py::arg("address"),
           "The id table on the device (num_ids int64, uploaded by the caller on a stream the plan's reshapes follow); "
           "kept alive by the caller. The executor then uploads nothing.")
      .def(
          "leg",
          [](const CopyPlan& plan, int32_t k) {
            const Leg& p = leg_of(plan, k);
            return py::make_tuple(p.start, p.end, p.range, p.nbytes, p.layer_bytes);
          },
          py::arg("leg"), "(start, end, range, nbytes, layer_bytes) of leg `leg`.")
      .def("range_legs", &CopyPlan::range_legs, py::arg("range"))
      .def(
          "runs",
          [](const CopyPlan& plan, int32_t k) {
            const Leg& p = leg_of(plan, k);
            return py::make_tuple(slice(plan.run_dst(), p.run_lo, p.run_hi), slice(plan.run_src(), p.run_lo, p.run_hi),
                                  slice(plan.run_bytes(), p.run_lo, p.run_hi));
          },
          py::arg("leg"),
          "The leg's DMA runs (dst, src, bytes) as int64 arrays; the staging side as offsets from the buffer.")
      .def(
          "launches",
          [](const CopyPlan& plan, int32_t k) {
            const Leg& p = leg_of(plan, k);
            py::list out;
            for (int32_t i = p.launch_lo; i < p.launch_hi; ++i) out.append(launch_dict(plan.launches()[i]));
            return out;
          },
          py::arg("leg"), "The leg's launches, each as a dict of its geometry.")
      .def(
          "ids",
          [](const CopyPlan& plan, int64_t at, int64_t n) {
            if (at < 0 || n < 0 || at + n > static_cast<int64_t>(plan.ids().size()))
              throw std::out_of_range("ids: outside the plan's id table");
            return slice(plan.ids(), at, at + n);
          },
          py::arg("at"), py::arg("n"))
      .def(
          "touched", [](const CopyPlan& plan, int32_t k) { return plan.touched.at(k); }, py::arg("leg"),
          "The job that wrote (a load) or read (a save) leg `leg`'s blocks, once issued (None before).")
      .def(
          "done", [](const CopyPlan& plan, int32_t k) { return plan.done.at(k); }, py::arg("leg"),
          "Leg `leg`'s last job, once issued (None before).")
      .def("dma_host", &CopyPlan::dma_host, py::arg("leg"), py::arg("staging"), py::arg("num_threads") = 0,
           py::call_guard<py::gil_scoped_release>(), "The leg's runs by memcpy (GIL released).")
      .def("reshape_host", &CopyPlan::reshape_host, py::arg("leg"), py::arg("staging"), py::arg("num_threads") = 0,
           py::arg("sim_sm_count") = 132, py::arg("sim_max_ctas") = 0, py::call_guard<py::gil_scoped_release>(),
           "The leg's launches by the CPU kernel or the CUDA kernel's emulation (GIL released).")
      .def(
          "dma_cuda",
          [](const CopyPlan& plan, int32_t k, int64_t staging, int64_t stream) {
            leg_of(plan, k);
            const int err = plan.dma_cuda(k, staging, stream);
            if (err != 0) throw std::runtime_error("kvx CUDA DMA runs failed (cudaError " + std::to_string(err) + ")");
          },
          py::arg("leg"), py::arg("staging"), py::arg("stream"))
      .def(
          "reshape_cuda",
          [](CopyPlan& plan, int32_t k, int64_t staging, int64_t stream) {
            leg_of(plan, k);
            const int err = plan.reshape_cuda(k, staging, stream);
            if (err != 0) throw std::runtime_error("kvx CUDA copy launch failed (cudaError " + std::to_string(err) + ")");
          },
          py::arg("leg"), py::arg("staging"), py::arg("stream"));

  m.def(
      "run_host",
      [](const PlanPtr& plan, int64_t staging, int32_t lo, int32_t hi, int num_threads, int sim_sm_count,
         int sim_max_ctas) {
        const int32_t n = static_cast<int32_t>(plan->legs().size());
        if (hi < 0) hi = n;
        if (!(0 <= lo && lo <= hi && hi <= n))
          throw std::out_of_range("lo, hi: expected 0 <= lo <= hi <= " + std::to_string(n));
        py::gil_scoped_release nogil;
        for (int32_t k = lo; k < hi; ++k) {
          const bool dma = plan->path() != kPathKernel, reshape = plan->path() != kPathDma;
          if (dma && !plan->gather()) plan->dma_host(k, staging, num_threads);
          if (reshape) plan->reshape_host(k, staging, num_threads, sim_sm_count, sim_max_ctas);
          if (dma && plan->gather()) plan->dma_host(k, staging, num_threads);
        }
      },
      py::arg("plan"), py::arg("staging"), py::arg("lo") = 0, py::arg("hi") = -1, py::arg("num_threads") = 0,
      py::arg("sim_sm_count") = 132, py::arg("sim_max_ctas") = 0,
      "Run legs [lo, hi) (hi < 0: to the end) of a host-executable plan now, in order (GIL released): a one-off "
      "copy on the CPU.");
  m.def(
      "issue_in_order",
      [](Queues& q, const PlanPtr& plan, int64_t staging, int32_t lo, int32_t hi) {
        issue_in_order(q, plan, staging, lo, hi < 0 ? static_cast<int32_t>(plan->legs().size()) : hi);
      },
      py::arg("queues"), py::arg("plan"), py::arg("staging"), py::arg("lo") = 0, py::arg("hi") = -1,
      "Legs [lo, hi) on one queue in the direction's order: a one-off copy (StreamQueues: the caller's stream).");
  m.def(
      "issue_load",
      [](Queues& q, const PlanPtr& plan, StagingRing* ring, int32_t lo, int32_t hi, const std::vector<EventPtr>& after) {
        issue_load(q, plan, ring, lo, hi, after);
      },
      py::arg("queues"), py::arg("plan"), py::arg("ring"), py::arg("lo"), py::arg("hi"), py::arg("after"),
      "Issue legs [lo, hi) of a load plan; the first follows `after` (queues.h).");
  m.def(
      "issue_save",
      [](Queues& q, const PlanPtr& plan, StagingRing* ring, int32_t lo, int32_t hi, const std::vector<EventPtr>& after,
         bool marker) { issue_save(q, plan, ring, lo, hi, after, marker); },
      py::arg("queues"), py::arg("plan"), py::arg("ring"), py::arg("lo"), py::arg("hi"), py::arg("after"),
      py::arg("marker"), "Issue legs [lo, hi) of a save plan; the first follows `after` and, with `marker`, now.");
  m.def(
      "issue_save_range",
      [](Queues& q, const PlanPtr& plan, StagingRing* ring, int32_t r, const std::vector<EventPtr>& after,
         bool marker) {
        const auto legs = plan->range_legs(r);
        issue_save(q, plan, ring, legs.first, legs.second, after, marker);
      },
      py::arg("queues"), py::arg("plan"), py::arg("ring"), py::arg("range"), py::arg("after"), py::arg("marker"),
      "issue_save of the legs of layer range `range`: a layer's saves, one call.");
  m.def(
      "fence_range",
      [](Queues& q, const CopyPlan& plan, int32_t r) {
        const auto legs = plan.range_legs(r);
        fence(q, plan, legs.first, legs.second);
      },
      py::arg("queues"), py::arg("plan"), py::arg("range"),
      "The compute stream waits for the legs of layer range `range` (rule 4): a layer's fence, one call.");
  m.def(
      "fence", [](Queues& q, const CopyPlan& plan, int32_t lo, int32_t hi) { fence(q, plan, lo, hi); },
      py::arg("queues"), py::arg("plan"), py::arg("lo"), py::arg("hi"));
}

}  // namespace kvx
