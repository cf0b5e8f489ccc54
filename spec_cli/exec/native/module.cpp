// The extension module: spec's CPU kernels (int4.cpp, glue.cpp) as one Python module.
#include <torch/extension.h>

torch::Tensor mm(torch::Tensor x, torch::Tensor w, torch::Tensor sz);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                int64_t kv_heads);
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> mask,
                     double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm", &mm, "int4 x bfloat16 on AVX-512 VNNI");
  m.def("rms_norm", &rms_norm, "weight * RMS-normalized rows, bfloat16");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, bfloat16");
  m.def("rope", &rope, "q, k, v of one product, q and k rotated, bfloat16");
  m.def("attend", &attend, "attention of a few rows over the cache, bfloat16");
}
