// The extension module: spec's CPU kernels (kernels.h) as one Python module
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // every kernel runs without the GIL (its arguments are converted before, its result after): a server's event
  // loop and slot threads go on while a forward computes
  const auto without_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("mm", &mm, "int4 x bfloat16 (AVX-512 VNNI or AVX2)", without_gil);
  m.def("tiles", &tiles, "whether Q4_K products of 64 rows or more run on AMX tiles here (SPEC_AMX=0: never)");
  m.def("one_stream", &one_stream, "whether 4-bit products of 1-4 rows read one block of outputs at a time here");
  m.def("mm8", &mm8, "8-bit (Q8_0, Q5) x bfloat16 (AVX-512 VNNI or AVX2)", without_gil);
  m.def("mm6", &mm6, "6-bit (Q6_K) x bfloat16 (AVX-512 VNNI or AVX2)", without_gil);
  m.def("mmfp4", &mmfp4, "MXFP4 (4-bit floats, a power of two a group) x bfloat16 (AVX-512 VNNI or AVX2)", without_gil);
  m.def("mm16", &mm16, "bfloat16 x bfloat16, float sums (AVX2 and FMA)", without_gil);
  m.def("pack4", &pack4, "4-bit values in mm's layout", without_gil);
  m.def("pack6", &pack6, "6-bit values in mm6's layout", without_gil);
  m.def("pack8", &pack8, "8-bit values in mm8's layout", without_gil);
  m.def("rms_norm", &rms_norm, "weight * RMS-normalized rows, bfloat16", without_gil);
  m.def("head_norms", &head_norms, "q and k heads of one product RMS-normalized, bfloat16", without_gil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up, bfloat16", without_gil);
  m.def("gelu_new", &gelu_new, "GPT-2's activation in one pass, bfloat16 (AVX2 builds)", without_gil);
  m.def("fused_gelu", &fused_gelu, "gpt2_layer's activation by gelu_new (set 0/1, -1: ask; AVX2 builds)");
  m.def("rope", &rope, "q, k, v of one product, q and k rotated, bfloat16", without_gil);
  namespace py = pybind11;
  m.def("attend", &attend,
        "attention of a few rows over the cache, bfloat16 or float32 (sinks: gpt-oss's; softcap: Gemma 2's)",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("mask"), py::arg("scale"),
        py::arg("sinks") = py::none(), py::arg("softcap") = 0.0, without_gil);
  m.def("attention_dots", &attention_dots, "bfloat16 attention by AVX-512 BF16 dot products (set 0/1, -1: ask)");
  m.def("attention_avx2", &attention_avx2, "bfloat16 attention in AVX2's own registers (set 0/1, -1: ask; AVX2 builds)");
  m.def("attend_parts", &attend_parts,
        "several sequences' rows, each over its own cache, bfloat16 or float32 (sinks: gpt-oss's; softcap: Gemma 2's)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keys"), py::arg("values"), py::arg("rows_of"),
        py::arg("first"), py::arg("slots"), py::arg("span"), py::arg("masks"), py::arg("scale"),
        py::arg("sinks") = py::none(), py::arg("softcap") = 0.0, without_gil);
  m.def("argmax_rows", &argmax_rows, "each row's argmax, float32, as torch's max(-1).indices", without_gil);
  m.def("top_probs", &top_probs,
        "each row's k most probable tokens and their softmax probabilities, float32", without_gil);
  m.def("coupled_noise", &coupled_noise, "coupled sampling's Gumbel noise for int64 counters, float32", without_gil);
  m.def("coupled_top_k", &coupled_top_k,
        "coupled sampling's scores with temperature, top-k and top-p, float32", without_gil);
  m.def("coupled_nucleus", &coupled_nucleus,
        "coupled sampling's scores with temperature and top-p, no top-k, float32", without_gil);
  m.def("gpt2_layer", &gpt2_layer, "a GPT-2 block as one call, its products packed for oneDNN", without_gil);
  m.def("layer", &layer, "a Llama-family layer as one call, bfloat16, on spec's products", without_gil);
  m.def("layer_parts", &layer_parts, "a Llama-family layer as one call over several sequences' rows", without_gil);
  m.def("gpt2_layer_parts", &gpt2_layer_parts, "a GPT-2 block as one call over several sequences' rows", without_gil);
  pybind11::class_<MixtureExperts>(m, "Experts", pybind11::module_local(), "a mixture's experts as one call")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, double, double>(), py::arg("weights"),
           py::arg("bits"), py::arg("alpha") = 0.0, py::arg("limit") = 0.0)
      .def("run", &MixtureExperts::run, without_gil);
  pybind11::class_<Layers>(m, "Layers", pybind11::module_local(), "every layer of a model as one call a forward")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<int64_t>>,
                          std::vector<double>, std::vector<double>, int64_t, int64_t>())
      .def("run", &Layers::run, without_gil);
}
