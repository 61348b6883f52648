// bindings.cpp - the one pybind11 module, kvx._C. Torch-free: every tensor arrives as an address.
// Validation lives in kvx/ops.py; these entry points trust their arguments.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>

#include "cpu/copy_cpu.h"
#if defined(KVX_WITH_CUDA)
#include "cuda/copy_cuda.h"
#endif

namespace py = pybind11;

namespace {

using PagedTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int32_t, int32_t, int32_t>;
using ContigTuple = std::tuple<int64_t, int64_t, int64_t, int64_t>;

// paged = (plane_stride, block_stride, token_stride, head_stride, num_blocks, num_planes,
//          block_size, num_heads); contig = (layer_stride, plane_stride, token_stride, head_stride)
kvx::CopyParams params_from(const PagedTuple& pg, const ContigTuple& ct, int64_t row_bytes,
                            int32_t num_layers, int64_t num_ids, int32_t mode) {
  kvx::PagedDesc paged{};
  std::tie(paged.plane_stride, paged.block_stride, paged.token_stride, paged.head_stride,
           paged.num_blocks, paged.num_planes, paged.block_size, paged.num_heads) = pg;
  kvx::ContigDesc contig{};
  std::tie(contig.layer_stride, contig.plane_stride, contig.token_stride, contig.head_stride) = ct;
  if (mode != kvx::kBlocks && mode != kvx::kSlots) throw std::invalid_argument("mode: expected 0 or 1");
  return kvx::make_params(paged, contig, row_bytes, num_layers, num_ids, mode);
}

template <typename T>
const T* as_ptr(int64_t addr) {
  return reinterpret_cast<const T*>(addr);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvx compiled kernels (torch-free). Use kvx.ops, which validates arguments.";

  m.def(
      "cpu_copy",
      [](int64_t layer_ptrs, int32_t num_layers, int64_t ids, int64_t num_ids, int64_t contig,
         const PagedTuple& paged, const ContigTuple& contig_strides, int64_t row_bytes, int32_t mode,
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
      "cpu_memcpy",
      [](int64_t dst, int64_t src, int64_t bytes, int num_threads) {
        py::gil_scoped_release nogil;
        kvx::cpu::parallel_memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                  static_cast<size_t>(bytes), num_threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("num_threads") = 0,
      "memcpy split over the kvx thread pool (the benchmarks' roof).");

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
              int64_t num_ids, int64_t contig, const PagedTuple& paged, const ContigTuple& contig_strides,
              int64_t row_bytes, int32_t mode, int32_t direction, int64_t stream, int max_ctas) {
        const kvx::CopyParams p = params_from(paged, contig_strides, row_bytes, num_layers, num_ids, mode);
        check(kvx::cuda::copy(p, as_ptr<int64_t>(layer_ptrs_host), as_ptr<int64_t>(layer_ptrs_dev),
                              as_ptr<int64_t>(ids_dev), contig, direction, stream, max_ctas),
              "copy launch");
      },
      py::arg("layer_ptrs_host"), py::arg("layer_ptrs_dev"), py::arg("num_layers"), py::arg("ids"),
      py::arg("num_ids"), py::arg("contig"), py::arg("paged"), py::arg("contig_strides"),
      py::arg("row_bytes"), py::arg("mode"), py::arg("direction"), py::arg("stream"),
      py::arg("max_ctas") = 0, "Launch the CUDA copy kernel on `stream` (no sync).");
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
#endif
}
