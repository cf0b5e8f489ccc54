// spec's CPU kernels: what each file defines for the others and for module.cpp's bindings. Every .cpp here
// includes this header and compiles alone.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

// int4.cpp: int4 (`mm`), 8-bit (`mm8`) and 6-bit (`mm6`, Q6_K) weights x bfloat16 rows on AVX-512 VNNI
bool tiles();
bool one_stream();
torch::Tensor mm(torch::Tensor x, torch::Tensor w, torch::Tensor sz);
torch::Tensor mm8(torch::Tensor x, torch::Tensor w, torch::Tensor sz);
torch::Tensor mm6(torch::Tensor x, torch::Tensor w, torch::Tensor sz);
torch::Tensor mmfp4(torch::Tensor x, torch::Tensor w, torch::Tensor sz);
// the layouts they take, made from plain values (as `native.pack`, `pack6`, `pack8` do in torch)
torch::Tensor pack4(torch::Tensor nibbles);
torch::Tensor pack6(torch::Tensor values);
torch::Tensor pack8(torch::Tensor values, int64_t group);

// bf16.cpp: bfloat16 weights [N, K] x bfloat16 rows [M, K], float sums (CPUs where oneDNN has no bfloat16)
torch::Tensor mm16(torch::Tensor x, torch::Tensor w);

// glue.cpp: the operations between a layer's products, bfloat16 (attend: float32 too)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor head_norms(torch::Tensor qkv, torch::Tensor q_weight, torch::Tensor k_weight, int64_t heads,
                         int64_t kv_heads, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor gelu_new(torch::Tensor x);
extern bool use_fused_gelu;  // (gpt2_layer's activation by gelu_new: AVX2 builds, unless `fused_gelu(0)`)
bool fused_gelu(int64_t set);
std::vector<torch::Tensor> rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                int64_t kv_heads);
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> mask,
                     double scale, c10::optional<torch::Tensor> sinks = c10::nullopt,  // sinks: gpt-oss's, [heads]
                     double softcap = 0.0);  // softcap: scores as softcap x tanh(score / softcap), Gemma 2's (0: none)
// whether bfloat16 attention sums by bfloat16 dot products (AVX-512 BF16: where the CPU has them, unless set off;
// `set` 0 or 1 sets it, -1 only asks), returning what it was; else as float32 does
bool attention_dots(int64_t set);
bool attention_avx2(int64_t set);
torch::Tensor attend_parts(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<torch::Tensor> keys,
                           std::vector<torch::Tensor> values, std::vector<int64_t> rows_of, std::vector<int64_t> first,
                           std::vector<c10::optional<torch::Tensor>> slots, std::vector<int64_t> span,
                           std::vector<c10::optional<torch::Tensor>> masks, double scale,
                           c10::optional<torch::Tensor> sinks = c10::nullopt, double softcap = 0.0);
// Rows start..start + rows of new keys and values k, v [1, kv heads, total, d] (contiguous) into a cache's keys and
// values [1, kv heads, slots, d] (d contiguous, k's dtype), row r at slot `slot_of(r)`: one copy a head and row
template <typename SlotOf>
inline void write_rows(torch::Tensor& keys, torch::Tensor& values, const torch::Tensor& k, const torch::Tensor& v,
                       int64_t start, int64_t rows, SlotOf&& slot_of) {
  const int64_t heads = k.size(1), total = k.size(2), bytes = k.size(3) * k.element_size();
  const int64_t size = keys.element_size();
  auto* kp = static_cast<char*>(keys.data_ptr());
  auto* vp = static_cast<char*>(values.data_ptr());
  const auto* nk = static_cast<const char*>(k.data_ptr());
  const auto* nv = static_cast<const char*>(v.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = slot_of(r);
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kp + (h * keys.stride(1) + slot * keys.stride(2)) * size, nk + (h * total + start + r) * bytes, bytes);
      std::memcpy(vp + (h * values.stride(1) + slot * values.stride(2)) * size, nv + (h * total + start + r) * bytes,
                  bytes);
    }
  }
}

// whether `attend` spreads rows x span x heads x d of work over threads (below it, one thread: they would not pay)
inline bool attend_spreads(int64_t rows, int64_t span, int64_t heads, int64_t d) {
  return rows * span * heads * d >= (1 << 17);
}

// logits.cpp: what the host reads of the logits, float32
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor top_probs(torch::Tensor x, int64_t k);
torch::Tensor coupled_noise(torch::Tensor counters, int64_t key);
torch::Tensor coupled_top_k(torch::Tensor x, torch::Tensor at, double temperature, int64_t k, double top_p,
                            int64_t key, int64_t vocab);
torch::Tensor coupled_nucleus(torch::Tensor x, torch::Tensor at, double temperature, double top_p, int64_t key,
                              int64_t vocab);

// layer.cpp: whole layers as one call
torch::Tensor layer(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> bits, torch::Tensor cos,
                    torch::Tensor sin, int64_t heads, int64_t kv_heads, torch::Tensor keys, torch::Tensor values,
                    int64_t first, c10::optional<torch::Tensor> slots, int64_t span,
                    c10::optional<torch::Tensor> mask, double scale, double eps, bool attention, bool mlp);
torch::Tensor gpt2_layer(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> kinds, double eps_1,
                         double eps_2, int64_t heads, torch::Tensor keys, torch::Tensor values, int64_t first,
                         c10::optional<torch::Tensor> slots, int64_t span, c10::optional<torch::Tensor> mask,
                         double scale, bool attention, bool mlp);

torch::Tensor layer_parts(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> bits, torch::Tensor cos,
                          torch::Tensor sin, int64_t heads, int64_t kv_heads, std::vector<torch::Tensor> keys,
                          std::vector<torch::Tensor> values, std::vector<int64_t> rows_of, std::vector<int64_t> first,
                          std::vector<c10::optional<torch::Tensor>> slots, std::vector<int64_t> span,
                          std::vector<c10::optional<torch::Tensor>> masks, double scale, double eps, bool attention,
                          bool mlp);
torch::Tensor gpt2_layer_parts(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> kinds, double eps_1,
                               double eps_2, int64_t heads, std::vector<torch::Tensor> keys,
                               std::vector<torch::Tensor> values, std::vector<int64_t> rows_of,
                               std::vector<int64_t> first, std::vector<c10::optional<torch::Tensor>> slots,
                               std::vector<int64_t> span, std::vector<c10::optional<torch::Tensor>> masks,
                               double scale, bool attention, bool mlp);

// A mixture's experts as one call (`quant.Experts`): each expert's gate_up and down products (values, scales, bias
// each, `bits` a product) held here; `run` takes a forward's rows, each row's experts and their weights.
struct MixtureExperts {
  std::vector<torch::Tensor> weights;  // 6 an expert: gate_up's values, scales, bias, then down's
  std::vector<int64_t> bits;           // 2 an expert
  double alpha, limit;                 // alpha 0: SiLU(gate) x up; else gpt-oss's clamped SwiGLU (`quant.ClampedSwiGLU`)
  MixtureExperts(std::vector<torch::Tensor> weights, std::vector<int64_t> bits, double alpha = 0, double limit = 0);
  torch::Tensor run(torch::Tensor x, torch::Tensor index, torch::Tensor routing) const;
};

// Every layer of a model (all of them fused) as one call a forward: their weights held here, the caches stacked
// [layers, 1, kv heads, slots, d] as the runner keeps them, a mask a layer (its window's).
struct Layers {
  std::vector<std::vector<torch::Tensor>> weights;
  std::vector<std::vector<int64_t>> bits;
  std::vector<double> eps, scales;
  int64_t heads, kv_heads;

  Layers(std::vector<std::vector<torch::Tensor>> weights, std::vector<std::vector<int64_t>> bits,
         std::vector<double> eps, std::vector<double> scales, int64_t heads, int64_t kv_heads);
  torch::Tensor run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys, torch::Tensor values,
                    int64_t first, c10::optional<torch::Tensor> slots, int64_t span,
                    std::vector<c10::optional<torch::Tensor>> masks, std::vector<int64_t> skip_attention,
                    std::vector<int64_t> skip_mlp);
};
