// Python bindings of the fp32 CPU kernels (engine/kernels/cpu_gemm.py builds them; engine/kernels/cpu_decode.py
// uses DecodeModel, engine/kernels/cpu_head.py EagleStep and MedusaStep). No body touches a Python object: the
// GIL is released like PyTorch's own ops, so other threads (callers streaming or detokenizing while the
// scheduler's worker decodes) keep running.
#include <torch/extension.h>

#include <vector>

#include "amx_gemm.h"
#include "decode.h"
#include "head.h"
#include "int8_amx.h"
#include "int8_gemm.h"
#include "small_gemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_gemm", &small_gemm, "fp32 y = x @ w^T for few rows, row-independent rounding",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm", &int8_gemm,
        "fp32 y = x @ (q * s)^T for few rows, int8 q with scales per row or group, dequantized in registers",
        py::call_guard<py::gil_scoped_release>());
  m.def("w8a8_gemm", &w8a8_gemm, "fp32 y = quant.matmul_kernels' w8a8 of x (smooth, per-row int8) and q",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_group_multiple", &int8_group_multiple, "int8_gemm's group sizes: 0 or a multiple of this");
  m.def("int8_amx_status", []() { return int8_amx_status(); }, "'' when AMX-INT8 tiles run here, else why not");
  m.def("int8_amx_gemm", &int8_amx_gemm,
        "fp32 y = x @ (q * s)^T on AMX-INT8 tiles, inputs split exactly into int8 parts, row-independent",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_amx_group_multiple", &int8_amx_group_multiple, "int8_amx_gemm's group sizes: 0 or a multiple of this");
  m.def("amx_status", []() { return amx_status(); }, "'' when AMX tiles run here, else why not");
  m.def("amx_pack", &amx_pack, "bf16 w [N, K] -> the tile order amx_gemm reads");
  m.def("amx_gemm", &amx_gemm, "fp32 y = x @ w^T on AMX tiles, w bf16-valued (packed), row-independent",
        py::call_guard<py::gil_scoped_release>());
  py::class_<DecodeModel>(m, "DecodeModel")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<int64_t>, int64_t, int64_t, int64_t, double, bool, bool>())
      .def("forward", &DecodeModel::forward, "fp32 Llama forward for few rows: embedding, layers, norm, head",
           py::call_guard<py::gil_scoped_release>())
      .def("forward_x", &DecodeModel::forward_x, "the same forward from the first layer's inputs [B, T, H]",
           py::call_guard<py::gil_scoped_release>())
      .def("forward_pair", &DecodeModel::forward_pair,
           "a wide first layer's forward: its q/k/v inputs [B, T, 2H] and the residual [B, T, H]",
           py::call_guard<py::gil_scoped_release>())
      .def("greedy", &DecodeModel::greedy, "greedy drafting: a forward, then steps - 1 steps on its argmax",
           py::call_guard<py::gil_scoped_release>());
  py::class_<EagleStep>(m, "EagleStep")
      .def(py::init<std::vector<torch::Tensor>, double>())
      .def("step", &EagleStep::step, "an EAGLE-style head's step: (features, tokens) -> (next features, logits)",
           py::call_guard<py::gil_scoped_release>())
      .def("greedy", &EagleStep::greedy, "steps greedy drafts of the head in one call",
           py::call_guard<py::gil_scoped_release>());
  py::class_<MedusaStep>(m, "MedusaStep")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t>())
      .def("step", &MedusaStep::step, "Medusa heads' step: h -> the first n heads' logits",
           py::call_guard<py::gil_scoped_release>())
      .def("greedy", &MedusaStep::greedy, "the first n heads' greedy drafts in one call",
           py::call_guard<py::gil_scoped_release>());
}
