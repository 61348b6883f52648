// bindings.cpp - the one pybind11 module, kvx._C. Torch-free: every tensor arrives as an address.
// Validation lives in kvx/kernels/ops.py; these entry points trust their arguments.
#include <pybind11/numpy.h>  // plan_runs returns int64 arrays
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::vector<int64_t> from a list of ints (plan_launch's layer addresses)

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/copy_cpu.h"
#include "cpu/crc32c.h"
#include "cuda/launch_config.h"  // host arithmetic only: bound with or without nvcc
#if defined(KVX_WITH_CUDA)
#include "cuda/copy_cuda.h"
#include "cuda/copy_sim.h"
#endif

namespace py = pybind11;

namespace kvx {
void bind_plan(py::module_& m);  // plan/bindings.cpp
}

namespace {

kvx::CopyParams params_from(const kvx::PagedDesc& paged, const kvx::ContigDesc& contig, int64_t row_bytes,
                            int32_t num_layers, int64_t num_ids, int32_t mode) {
  if (mode != kvx::kBlocks && mode != kvx::kSlots) throw std::invalid_argument("mode: expected 0 or 1");
  return kvx::make_params(paged, contig, row_bytes, num_layers, num_ids, mode);
}

std::string repr(const kvx::PagedDesc& d) {
  return "PagedDesc(plane_stride=" + std::to_string(d.plane_stride) + ", block_stride=" +
         std::to_string(d.block_stride) + ", token_stride=" + std::to_string(d.token_stride) +
         ", head_stride=" + std::to_string(d.head_stride) + ", num_blocks=" + std::to_string(d.num_blocks) +
         ", num_planes=" + std::to_string(d.num_planes) + ", block_size=" + std::to_string(d.block_size) +
         ", num_heads=" + std::to_string(d.num_heads) + ")";
}

std::string repr(const kvx::ContigDesc& d) {
  return "ContigDesc(layer_stride=" + std::to_string(d.layer_stride) + ", plane_stride=" +
         std::to_string(d.plane_stride) + ", token_stride=" + std::to_string(d.token_stride) +
         ", head_stride=" + std::to_string(d.head_stride) + ")";
}

template <typename T>
const T* as_ptr(int64_t addr) {
  return reinterpret_cast<const T*>(addr);
}

int32_t checked_direction(int32_t direction) {
  if (direction != kvx::kGather && direction != kvx::kScatter)
    throw std::invalid_argument("direction: expected 0 (gather) or 1 (scatter), got " + std::to_string(direction));
  return direction;
}

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
  return py::array_t<int64_t>(static_cast<py::ssize_t>(v.size()), v.data());
}

std::vector<int64_t> checked_layer_ptrs(const std::vector<int64_t>& layer_ptrs, int32_t num_layers) {
  if (num_layers < 1 || layer_ptrs.size() != static_cast<size_t>(num_layers))
    throw std::invalid_argument("layer_ptrs: expected num_layers = " + std::to_string(num_layers) +
                                " addresses, got " + std::to_string(layer_ptrs.size()));
  return layer_ptrs;
}

void check_index32_limit(int64_t limit) {
  if (limit < 1 || limit > kvx::cuda::kIndex32Limit)
    throw std::invalid_argument("index32_limit: expected 1 .. 2^31, got " + std::to_string(limit));
}

#if defined(KVX_WITH_CUDA)
// kvx._C.CudaSimFault (a RuntimeError): what the emulated kernel did that a GPU would fault on or corrupt.
struct SimFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvx compiled kernels (torch-free). Use kvx.kernels.ops, which validates arguments.";
  kvx::bind_plan(m);

  // The descriptors of kv_layout.h as named structs: built from kvx.kernels.layout.PagedDesc / ContigDesc by
  // field name (keyword-only constructors), so a reordering of fields on either side cannot swap strides.
  py::class_<kvx::PagedDesc>(m, "PagedDesc", "kvx::PagedDesc: byte geometry of the paged side (kv_layout.h).")
      .def(py::init([](int64_t plane_stride, int64_t block_stride, int64_t token_stride, int64_t head_stride,
                       int64_t num_blocks, int32_t num_planes, int32_t block_size, int32_t num_heads) {
             kvx::PagedDesc d{};
             d.plane_stride = plane_stride;
             d.block_stride = block_stride;
             d.token_stride = token_stride;
             d.head_stride = head_stride;
             d.num_blocks = num_blocks;
             d.num_planes = num_planes;
             d.block_size = block_size;
             d.num_heads = num_heads;
             return d;
           }),
           py::kw_only(), py::arg("plane_stride"), py::arg("block_stride"), py::arg("token_stride"),
           py::arg("head_stride"), py::arg("num_blocks"), py::arg("num_planes"), py::arg("block_size"),
           py::arg("num_heads"))
      .def_readwrite("plane_stride", &kvx::PagedDesc::plane_stride)
      .def_readwrite("block_stride", &kvx::PagedDesc::block_stride)
      .def_readwrite("token_stride", &kvx::PagedDesc::token_stride)
      .def_readwrite("head_stride", &kvx::PagedDesc::head_stride)
      .def_readwrite("num_blocks", &kvx::PagedDesc::num_blocks)
      .def_readwrite("num_planes", &kvx::PagedDesc::num_planes)
      .def_readwrite("block_size", &kvx::PagedDesc::block_size)
      .def_readwrite("num_heads", &kvx::PagedDesc::num_heads)
      .def("__repr__", [](const kvx::PagedDesc& d) { return repr(d); });

  py::class_<kvx::ContigDesc>(m, "ContigDesc",
                              "kvx::ContigDesc: byte strides of the contiguous side over [layers, planes, "
                              "tokens, heads] (kv_layout.h).")
      .def(py::init([](int64_t layer_stride, int64_t plane_stride, int64_t token_stride, int64_t head_stride) {
             kvx::ContigDesc d{};
             d.layer_stride = layer_stride;
             d.plane_stride = plane_stride;
             d.token_stride = token_stride;
             d.head_stride = head_stride;
             return d;
           }),
           py::kw_only(), py::arg("layer_stride"), py::arg("plane_stride"), py::arg("token_stride"),
           py::arg("head_stride"))
      .def_readwrite("layer_stride", &kvx::ContigDesc::layer_stride)
      .def_readwrite("plane_stride", &kvx::ContigDesc::plane_stride)
      .def_readwrite("token_stride", &kvx::ContigDesc::token_stride)
      .def_readwrite("head_stride", &kvx::ContigDesc::head_stride)
      .def("__repr__", [](const kvx::ContigDesc& d) { return repr(d); });

  py::class_<kvx::CopyParams>(m, "CopyParams", "kvx::CopyParams: one copy's geometry and iteration space.")
      .def_readonly("paged", &kvx::CopyParams::paged)
      .def_readonly("contig", &kvx::CopyParams::contig)
      .def_readonly("row_bytes", &kvx::CopyParams::row_bytes)
      .def_readonly("num_ids", &kvx::CopyParams::num_ids)
      .def_readonly("num_layers", &kvx::CopyParams::num_layers)
      .def_readonly("mode", &kvx::CopyParams::mode)
      .def_readonly("iter_tokens", &kvx::CopyParams::iter_tokens)
      .def_readonly("iter_heads", &kvx::CopyParams::iter_heads);

  py::class_<kvx::LaunchPlan>(m, "LaunchPlan",
                              "kvx::LaunchPlan: params after collapse_rows() with the strides that never move "
                              "an address set to 0 (moving_strides()), and width = copy_width() in bytes.")
      .def_readonly("params", &kvx::LaunchPlan::params)
      .def_readonly("width", &kvx::LaunchPlan::width);

  m.def(
      "plan_launch",
      [](const kvx::PagedDesc& paged, const kvx::ContigDesc& contig_strides, int64_t row_bytes, int32_t num_layers,
         int64_t num_ids, int32_t mode, const std::vector<int64_t>& layer_ptrs, int64_t contig) {
        const std::vector<int64_t> ptrs = checked_layer_ptrs(layer_ptrs, num_layers);
        return kvx::plan_launch(params_from(paged, contig_strides, row_bytes, num_layers, num_ids, mode),
                                ptrs.data(), contig);
      },
      py::arg("paged"), py::arg("contig_strides"), py::arg("row_bytes"), py::arg("num_layers"), py::arg("num_ids"),
      py::arg("mode"), py::arg("layer_ptrs"), py::arg("contig"),
      "Row merging and copy width of kv_layout.h (plan_launch) for a copy between layers at `layer_ptrs` and a "
      "contiguous side at address `contig` (only the addresses' alignment is read): the Triton launcher's plan.");

  py::class_<kvx::cuda::LaunchConfig>(
      m, "LaunchConfig",
      "kvx::cuda::LaunchConfig: how the CUDA copy kernel is launched (launch_config.h): vector width in bytes, "
      "words per row, row segments (the work items: `segments` per row of tpr lanes x wpl words each, "
      "total_items), lane groups per CTA (groups = 256 / tpr), items a CTA takes per pass (items_per_cta), the "
      "grid (ctas; 0 = no launch), the index width (32: FastDivmod, 64: plain division) with its divisors "
      "((div, mul, shift) per name) and id_tokens, the rows of the iteration space (total_rows, padding slots "
      "included) and the collapsed params the kernel gets.")
      .def_readonly("params", &kvx::cuda::LaunchConfig::params)
      .def_readonly("total_rows", &kvx::cuda::LaunchConfig::total_rows)
      .def_readonly("words", &kvx::cuda::LaunchConfig::words)
      .def_readonly("segments", &kvx::cuda::LaunchConfig::segments)
      .def_readonly("total_items", &kvx::cuda::LaunchConfig::total_items)
      .def_readonly("ctas", &kvx::cuda::LaunchConfig::ctas)
      .def_readonly("width", &kvx::cuda::LaunchConfig::width)
      .def_readonly("tpr", &kvx::cuda::LaunchConfig::tpr)
      .def_readonly("wpl", &kvx::cuda::LaunchConfig::wpl)
      .def_readonly("groups", &kvx::cuda::LaunchConfig::groups)
      .def_readonly("items_per_cta", &kvx::cuda::LaunchConfig::items_per_cta)
      .def_readonly("index_bits", &kvx::cuda::LaunchConfig::index_bits)
      .def_readonly("id_tokens", &kvx::cuda::LaunchConfig::id_tokens)
      .def_property_readonly(
          "divisors",
          [](const kvx::cuda::LaunchConfig& c) {
            py::dict d;
            auto put = [&](const char* name, const kvx::cuda::FastDivmod& f) {
              d[name] = py::make_tuple(f.div, f.mul, f.shift);
            };
            put("segments", c.by_segments);
            put("rows_per_entry", c.by_rows_per_entry);
            put("ids", c.by_ids);
            put("planes", c.by_planes);
            put("heads", c.by_heads);
            put("block_size", c.by_block_size);
            return d;
          })
      .def("__repr__", [](const kvx::cuda::LaunchConfig& c) {
        return "LaunchConfig(width=" + std::to_string(c.width) + ", words=" + std::to_string(c.words) +
               ", segments=" + std::to_string(c.segments) + ", tpr=" + std::to_string(c.tpr) +
               ", wpl=" + std::to_string(c.wpl) + ", total_items=" + std::to_string(c.total_items) +
               ", items_per_cta=" + std::to_string(c.items_per_cta) + ", ctas=" + std::to_string(c.ctas) +
               ", index_bits=" + std::to_string(c.index_bits) + ", total_rows=" + std::to_string(c.total_rows) +
               ", row_bytes=" + std::to_string(c.params.row_bytes) + ")";
      });

  m.def(
      "cuda_launch_config",
      [](const kvx::PagedDesc& paged, const kvx::ContigDesc& contig_strides, int64_t row_bytes, int32_t num_layers,
         int64_t num_ids, int32_t mode, const std::vector<int64_t>& layer_ptrs, int64_t contig, int sm_count,
         int max_ctas, int64_t index32_limit) {
        if (sm_count < 1) throw std::invalid_argument("sm_count: expected >= 1, got " + std::to_string(sm_count));
        check_index32_limit(index32_limit);
        const std::vector<int64_t> ptrs = checked_layer_ptrs(layer_ptrs, num_layers);
        return kvx::cuda::kernel_launch_config(params_from(paged, contig_strides, row_bytes, num_layers, num_ids, mode),
                                               ptrs.data(), contig, sm_count, max_ctas, index32_limit);
      },
      py::arg("paged"), py::arg("contig_strides"), py::arg("row_bytes"), py::arg("num_layers"), py::arg("num_ids"),
      py::arg("mode"), py::arg("layer_ptrs"), py::arg("contig"), py::arg("sm_count"), py::arg("max_ctas") = 0,
      py::arg("index32_limit") = kvx::cuda::kIndex32Limit,
      "The CUDA copy kernel's launch (launch_config.h kernel_launch_config) on a device of `sm_count` SMs: what "
      "cuda_copy launches and cuda_sim_copy emulates. Only the addresses' alignment is read. index32_limit (a "
      "test knob, 1 .. 2^31): indices must stay below it for 32-bit index math.");

  m.def(
      "plan_runs",
      [](int64_t layer_ptrs, int32_t num_layers, int64_t ids, int64_t num_ids, int64_t contig,
         const kvx::PagedDesc& paged, const kvx::ContigDesc& contig_strides, int64_t row_bytes, int32_t mode,
         int32_t direction, int64_t min_run_bytes) -> py::object {
        const kvx::CopyParams p = params_from(paged, contig_strides, row_bytes, num_layers, num_ids, mode);
        checked_direction(direction);
        std::vector<int64_t> dst, src, bytes;
        bool fits;
        {
          py::gil_scoped_release nogil;
          // the function copy_dma() issues its DMA from (kv_layout.h plan_runs)
          fits = kvx::plan_runs(p, as_ptr<int64_t>(layer_ptrs), as_ptr<int64_t>(ids), contig, direction,
                                min_run_bytes, [&](int64_t d, int64_t s, int64_t b) {
                                  dst.push_back(d);
                                  src.push_back(s);
                                  bytes.push_back(b);
                                });
        }
        if (!fits) return py::none();
        return py::make_tuple(to_array(dst), to_array(src), to_array(bytes));
      },
      py::arg("layer_ptrs"), py::arg("num_layers"), py::arg("ids"), py::arg("num_ids"), py::arg("contig"),
      py::arg("paged"), py::arg("contig_strides"), py::arg("row_bytes"), py::arg("mode"), py::arg("direction"),
      py::arg("min_run_bytes") = 0,
      "The copy as maximal runs of contiguous bytes (kv_layout.h for_each_run): int64 arrays (dst, src, bytes) "
      "of addresses, what the CUDA DMA path issues; None when the runs average fewer than `min_run_bytes` bytes "
      "(the DMA path then leaves the copy to the kernel). Reads only `ids` (host) and addresses.");

  m.def(
      "cpu_copy",
      [](int64_t layer_ptrs, int32_t num_layers, int64_t ids, int64_t num_ids, int64_t contig,
         const kvx::PagedDesc& paged, const kvx::ContigDesc& contig_strides, int64_t row_bytes, int32_t mode,
         int32_t direction, int num_threads) {
        const kvx::CopyParams p = params_from(paged, contig_strides, row_bytes, num_layers, num_ids, mode);
        py::gil_scoped_release nogil;
        kvx::cpu::copy(p, as_ptr<int64_t>(layer_ptrs), as_ptr<int64_t>(ids), contig, direction,
                       num_threads);
      },
      py::arg("layer_ptrs"), py::arg("num_layers"), py::arg("ids"), py::arg("num_ids"),
      py::arg("contig"), py::arg("paged"), py::arg("contig_strides"), py::arg("row_bytes"),
      py::arg("mode"), py::arg("direction"), py::arg("num_threads") = 0,
      "Copy rows between paged layers and a contiguous buffer on CPU threads (GIL released).");

  m.def(
      "cpu_copy_many",
      [](int64_t layer_ptrs, int32_t num_layers, const std::vector<int64_t>& ids,
         const std::vector<int64_t>& num_ids, const std::vector<int64_t>& contig, const kvx::PagedDesc& paged,
         const kvx::ContigDesc& contig_strides, int64_t row_bytes, int32_t mode, int32_t direction,
         int num_threads, int64_t whole_bytes) {
        if (num_ids.size() != ids.size() || contig.size() != ids.size())
          throw std::invalid_argument("ids, num_ids, contig: expected lists of one length, got " +
                                      std::to_string(ids.size()) + ", " + std::to_string(num_ids.size()) +
                                      ", " + std::to_string(contig.size()));
        const kvx::CopyParams p = params_from(paged, contig_strides, row_bytes, num_layers, 0, mode);
        std::vector<const int64_t*> id_ptrs;
        for (int64_t a : ids) id_ptrs.push_back(as_ptr<int64_t>(a));
        py::gil_scoped_release nogil;
        kvx::cpu::copy_many(p, as_ptr<int64_t>(layer_ptrs), id_ptrs.data(), num_ids.data(), contig.data(),
                            static_cast<int64_t>(ids.size()), checked_direction(direction), num_threads,
                            whole_bytes);
      },
      py::arg("layer_ptrs"), py::arg("num_layers"), py::arg("ids"), py::arg("num_ids"), py::arg("contig"),
      py::arg("paged"), py::arg("contig_strides"), py::arg("row_bytes"), py::arg("mode"), py::arg("direction"),
      py::arg("num_threads") = 0, py::arg("whole_bytes") = 0,
      "Several cpu_copy calls that share the geometry (one id list and contiguous buffer each) in one "
      "parallel region (GIL released). whole_bytes: the bytes of the whole transfer they belong to (streaming "
      "stores are chosen by it too).");

  m.def(
      "cpu_memcpy",
      [](int64_t dst, int64_t src, int64_t bytes, int num_threads) {
        py::gil_scoped_release nogil;
        kvx::cpu::parallel_memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                  static_cast<size_t>(bytes), num_threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("num_threads") = 0,
      "memcpy split over the kvx thread pool (the benchmarks' roof).");

  m.def(
      "copy_runs",
      [](int64_t dsts, int64_t srcs, int64_t sizes, int64_t n, int64_t dst_base, int64_t src_base, int num_threads) {
        py::gil_scoped_release nogil;
        kvx::cpu::copy_runs(as_ptr<int64_t>(dsts), as_ptr<int64_t>(srcs), as_ptr<int64_t>(sizes), n, dst_base,
                            src_base, num_threads);
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("n"), py::arg("dst_base") = 0,
      py::arg("src_base") = 0, py::arg("num_threads") = 0,
      "A DMA plan run by memcpy on the CPU, in order (GIL released): sizes[i] bytes from srcs[i] + src_base to "
      "dsts[i] + dst_base; dsts, srcs, sizes: addresses of [n] int64 arrays. What cuda_copy_runs issues to the "
      "copy engines.");

  m.def(
      "cpu_populate_write",
      [](int64_t addr, int64_t bytes, int num_threads) {
        py::gil_scoped_release nogil;
        return kvx::cpu::populate_write(reinterpret_cast<void*>(addr), static_cast<size_t>(bytes),
                                        num_threads);
      },
      py::arg("addr"), py::arg("bytes"), py::arg("num_threads") = 0,
      "Commit the whole pages of a host range now (MADV_POPULATE_WRITE on the kvx thread pool; GIL "
      "released). Returns 0 or an errno.");

  m.def("crc32c_accelerated", &kvx::cpu::crc32c_accelerated,
        "True when this CPU runs crc32c (AVX-512 VPCLMULQDQ).");
  m.def(
      "crc32c",
      [](py::handle data, uint32_t value) {
        if (!kvx::cpu::crc32c_accelerated())
          throw std::runtime_error("crc32c: this CPU lacks AVX-512 VPCLMULQDQ (see crc32c_accelerated())");
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) {
          PyErr_Clear();
          throw py::type_error(std::string("data: expected a C-contiguous bytes-like object, got ") +
                               Py_TYPE(data.ptr())->tp_name);
        }
        const auto* p = static_cast<const uint8_t*>(view.buf);
        const size_t n = static_cast<size_t>(view.len);
        uint32_t crc;
        if (n >= (64u << 10)) {  // long buffers: other Python threads run meanwhile
          py::gil_scoped_release nogil;
          crc = kvx::cpu::crc32c(value, p, n);
        } else {
          crc = kvx::cpu::crc32c(value, p, n);
        }
        PyBuffer_Release(&view);
        return crc;
      },
      py::arg("data"), py::arg("value") = 0,
      "CRC32C of a C-contiguous buffer, continuing from `value` (the CRC of the bytes before), as "
      "crc32c.crc32c(data, value). GIL released from 64 KiB.");

  m.def("cpu_get_num_threads", &kvx::cpu::get_num_threads);
  m.def("cpu_set_num_threads", &kvx::cpu::set_num_threads, py::arg("n"));

#if defined(KVX_WITH_CUDA)
  m.attr("has_cuda") = true;
  auto check = [](int err, const char* what) {
    if (err != 0)
      throw std::runtime_error(std::string("kvx CUDA ") + what + " failed: " + kvx::cuda::error_string(err) +
                               " (cudaError " + std::to_string(err) + ")");
  };
  m.def(
      "cuda_copy",
      [check](int64_t layer_ptrs_host, int64_t layer_ptrs_dev, int32_t num_layers, int64_t ids_dev,
              int64_t num_ids, int64_t contig, const kvx::PagedDesc& paged, const kvx::ContigDesc& contig_strides,
              int64_t row_bytes, int32_t mode, int32_t direction, int64_t stream, int max_ctas) {
        const kvx::CopyParams p = params_from(paged, contig_strides, row_bytes, num_layers, num_ids, mode);
        kvx::cuda::LaunchConfig used{};
        check(kvx::cuda::copy(p, as_ptr<int64_t>(layer_ptrs_host), as_ptr<int64_t>(layer_ptrs_dev),
                              as_ptr<int64_t>(ids_dev), contig, direction, stream, max_ctas, &used),
              "copy launch");
        return used;
      },
      py::arg("layer_ptrs_host"), py::arg("layer_ptrs_dev"), py::arg("num_layers"), py::arg("ids"),
      py::arg("num_ids"), py::arg("contig"), py::arg("paged"), py::arg("contig_strides"),
      py::arg("row_bytes"), py::arg("mode"), py::arg("direction"), py::arg("stream"),
      py::arg("max_ctas") = 0,
      "Launch the CUDA copy kernel on `stream` (no sync); returns the LaunchConfig it launched with.");

  // impl "cuda_sim": the kernel above, its body and launch decisions run on the CPU (copy_sim.h)
  m.attr("has_cuda_sim") = true;
  py::register_exception<SimFault>(m, "CudaSimFault", PyExc_RuntimeError);
  py::class_<kvx::cuda::SimReport>(m, "CudaSimReport",
                                   "What one emulated launch did (copy_sim.h SimReport): its config, threads run, "
                                   "work items copied, most grid-stride passes of one thread, vector accesses.")
      .def_readonly("config", &kvx::cuda::SimReport::config)
      .def_readonly("threads", &kvx::cuda::SimReport::threads)
      .def_readonly("item_visits", &kvx::cuda::SimReport::item_visits)
      .def_readonly("passes_per_thread", &kvx::cuda::SimReport::passes_per_thread)
      .def_readonly("accesses", &kvx::cuda::SimReport::accesses);
  m.def(
      "cuda_sim_copy",
      [](int64_t layer_ptrs, int64_t layer_bounds, int32_t num_layers, int64_t ids, int64_t num_ids, int64_t contig,
         int64_t contig_lo, int64_t contig_hi, const kvx::PagedDesc& paged, const kvx::ContigDesc& contig_strides,
         int64_t row_bytes, int32_t mode, int32_t direction, int sm_count, int max_ctas, int force_width,
         int64_t index32_limit) {
        const kvx::CopyParams p = params_from(paged, contig_strides, row_bytes, num_layers, num_ids, mode);
        checked_direction(direction);
        if (num_layers < 1) throw std::invalid_argument("num_layers: expected >= 1, got " + std::to_string(num_layers));
        if (sm_count < 1) throw std::invalid_argument("sm_count: expected >= 1, got " + std::to_string(sm_count));
        if (force_width != 0 && force_width != 1 && force_width != 2 && force_width != 4 && force_width != 8 &&
            force_width != 16)
          throw std::invalid_argument("force_width: expected 0 (copy_width()'s) or 1, 2, 4, 8, 16, got " +
                                      std::to_string(force_width));
        check_index32_limit(index32_limit);
        kvx::cuda::SimReport report;
        {
          py::gil_scoped_release nogil;
          report = kvx::cuda::simulate_copy(p, as_ptr<int64_t>(layer_ptrs), as_ptr<int64_t>(layer_bounds),
                                            as_ptr<int64_t>(ids), contig, contig_lo, contig_hi, direction, sm_count,
                                            max_ctas, force_width, index32_limit);
        }
        if (!report.fault.empty()) throw SimFault(report.fault);
        return report;
      },
      py::arg("layer_ptrs"), py::arg("layer_bounds"), py::arg("num_layers"), py::arg("ids"), py::arg("num_ids"),
      py::arg("contig"), py::arg("contig_lo"), py::arg("contig_hi"), py::arg("paged"), py::arg("contig_strides"),
      py::arg("row_bytes"), py::arg("mode"), py::arg("direction"), py::arg("sm_count"), py::arg("max_ctas") = 0,
      py::arg("force_width") = 0, py::arg("index32_limit") = kvx::cuda::kIndex32Limit,
      "Run the CUDA copy kernel's body for every thread of its launch on CPU memory (GIL released), each vector "
      "access checked against alignment, its buffer (layer l: [layer_bounds[2l], layer_bounds[2l+1]); the "
      "contiguous side: [contig_lo, contig_hi)) and earlier writes of the launch. Raises CudaSimFault at the first "
      "violation. Test knobs: force_width, a vector width to use instead of copy_width()'s; index32_limit, as "
      "cuda_launch_config's (smaller: the 64-bit index path on small copies).");
  m.def(
      "cuda_copy_dma",
      [check](int64_t layer_ptrs_host, int32_t num_layers, int64_t ids_host, int64_t num_ids, int64_t contig,
              bool contig_on_host, const kvx::PagedDesc& paged, const kvx::ContigDesc& contig_strides,
              int64_t row_bytes, int32_t mode, int32_t direction, int64_t stream, int64_t min_run_bytes) {
        const kvx::CopyParams p = params_from(paged, contig_strides, row_bytes, num_layers, num_ids, mode);
        checked_direction(direction);
        bool issued = false;
        int err;
        {
          py::gil_scoped_release nogil;  // walking the runs of a large copy takes a while
          err = kvx::cuda::copy_dma(p, as_ptr<int64_t>(layer_ptrs_host), as_ptr<int64_t>(ids_host), contig,
                                    contig_on_host, direction, stream, min_run_bytes, &issued);
        }
        check(err, "DMA copy");
        return issued;
      },
      py::arg("layer_ptrs_host"), py::arg("num_layers"), py::arg("ids"), py::arg("num_ids"), py::arg("contig"),
      py::arg("contig_on_host"), py::arg("paged"), py::arg("contig_strides"), py::arg("row_bytes"),
      py::arg("mode"), py::arg("direction"), py::arg("stream"), py::arg("min_run_bytes") = 0,
      "Issue the copy as DMA runs on `stream` (no sync) if its runs average at least `min_run_bytes` bytes; "
      "returns whether it did (False: nothing issued, launch the kernel). Host arrays for layers and ids.");
  m.def(
      "cuda_copy_runs",
      [check](int64_t dsts, int64_t srcs, int64_t sizes, int64_t n, int64_t dst_base, int64_t src_base,
              bool src_host, bool dst_host, int64_t stream) {
        int err;
        {
          py::gil_scoped_release nogil;
          err = kvx::cuda::copy_runs(as_ptr<int64_t>(dsts), as_ptr<int64_t>(srcs), as_ptr<int64_t>(sizes), n,
                                     dst_base, src_base, src_host, dst_host, stream);
        }
        check(err, "DMA runs");
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("n"), py::arg("dst_base"), py::arg("src_base"),
      py::kw_only(), py::arg("src_host"), py::arg("dst_host"), py::arg("stream"),
      "Issue a DMA plan on `stream` (no sync): sizes[i] bytes from srcs[i] + src_base to dsts[i] + dst_base, "
      "batched with cudaMemcpyBatchAsync where available; dsts, srcs, sizes: addresses of [n] int64 host arrays.");
  m.def("cuda_batch_memcpy", &kvx::cuda::batch_memcpy_available,
        "Whether the DMA path batches its runs (cudaMemcpyBatchAsync: CUDA >= 12.8, accepted by the driver).");
  m.def(
      "cuda_memcpy_each",
      [check](int64_t dsts, int64_t srcs, int64_t sizes, int64_t n, int64_t stream) {
        check(kvx::cuda::memcpy_each(as_ptr<int64_t>(dsts), as_ptr<int64_t>(srcs), as_ptr<int64_t>(sizes),
                                     n, stream),
              "memcpy_each");
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("n"), py::arg("stream"),
      "Baseline: one cudaMemcpyAsync per triple.");
  m.def(
      "cuda_host_device_pointer",
      [check](int64_t host_ptr) {
        int64_t out = 0;
        check(kvx::cuda::host_device_pointer(host_ptr, &out), "cudaHostGetDevicePointer");
        return out;
      },
      py::arg("host_ptr"), "Device alias of pinned host memory.");
  m.def("cuda_device_count", &kvx::cuda::device_count);
#else
  m.attr("has_cuda") = false;
  m.attr("has_cuda_sim") = false;  // the emulation is the CUDA kernel's source: compiled by nvcc only
#endif
}
