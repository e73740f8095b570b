// Python bindings of the fp32 CPU kernels (engine/cpu_gemm.py builds them, engine/cpu_decode.py uses
// decode_forward). Neither body touches a Python object: the GIL is released like PyTorch's own ops, so
// other threads (callers streaming or detokenizing while the scheduler's worker decodes) keep running.
#include <torch/extension.h>

#include <vector>

#include "small_gemm.h"

torch::Tensor decode_forward(const torch::Tensor& tokens, const torch::Tensor& pos, const torch::Tensor& rows,
                             const torch::Tensor& idx, int64_t kv_len, int64_t n_layers,
                             const std::vector<torch::Tensor>& weights, torch::Tensor k_cache, torch::Tensor v_cache,
                             const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads, int64_t n_kv,
                             int64_t window, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_gemm", &small_gemm, "fp32 y = x @ w^T for few rows, row-independent rounding",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_forward", &decode_forward, "fp32 Llama forward for few rows: embedding, layers, norm, head",
        py::call_guard<py::gil_scoped_release>());
}
