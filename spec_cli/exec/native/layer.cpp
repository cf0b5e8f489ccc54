// A Llama-family layer as one call: the same kernels, in the same order, as the lean loop calls them one by one
// from Python (rms_norm, the int4 or 8-bit product, rope, the cache write, attend, the residual add, ...), so the
// same bits; what goes is the interpreter and the dispatch between them (~70 us a layer, a third of a one-token
// forward of SmolLM2 on a 2-core Xeon).

#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>

using simd::bf16;

// `out` plus `a` into `out`, as torch adds two bfloat16 tensors (each sum in float, rounded to the nearest): `a` of
// out's shape, or one row added to each of out's (a bias). Elsewhere (another dtype, a strided tensor) torch's add.
// `out` is a product's fresh output: no tensor is made, no operator dispatched (a one-row layer has five such adds)
inline torch::Tensor add_into(torch::Tensor out, const torch::Tensor& a) {
  const int64_t width = out.size(-1), n = out.numel(), an = a.numel();
  if (out.scalar_type() != at::kBFloat16 || a.scalar_type() != at::kBFloat16 || !out.is_contiguous() ||
      !a.is_contiguous() || (an != n && an != width) || a.size(-1) != width)
    return out + a;
  bf16* o = out.data_ptr<bf16>();
  const bf16* p = a.data_ptr<bf16>();
  at::parallel_for(0, n / width, std::max<int64_t>(1, (1 << 16) / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* row = o + r * width;
      const bf16* other = an == n ? p + r * width : p;
      for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 k = simd::lanes(width - j);
        simd::put16(row + j, _mm512_add_ps(simd::load16(row + j, k), simd::load16(other + j, k)), k);
      }
    }
  });
  return out;
}

// one product: bits 4, 6 or 8 (spec's kernels), `values` and `scales` as `quant.Quantized` holds them, then the
// bias (empty: none) added in bfloat16 as torch adds it
inline torch::Tensor project(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& scales,
                             const torch::Tensor& bias, int64_t bits) {
  auto y = bits == 16 ? mm16(x, values)  // (bfloat16 weights: `packing.linear` where oneDNN has no bfloat16)
            : bits == 8 ? mm8(x, values, scales) : bits == 6 ? mm6(x, values, scales)
            : bits == 5 ? mmfp4(x, values, scales) : mm(x, values, scales);
  return bias.numel() ? add_into(y, bias) : y;
}

// the same, with `w` pointing at values, scales and bias side by side (a Llama layer's weights)
inline torch::Tensor project(const torch::Tensor& x, const torch::Tensor* w, int64_t bits) {
  return project(x, w[0], w[1], w[2], bits);
}

// A layer's new keys and values k, v [1, kv heads, rows, d] written to the cache's slots first.. (or to `slots`,
// where they are not consecutive), as the runner's _store writes them; returns the first `span` of each
inline std::pair<torch::Tensor, torch::Tensor> store(torch::Tensor& keys, torch::Tensor& values, const torch::Tensor& k,
                                                     const torch::Tensor& v, int64_t first,
                                                     const c10::optional<torch::Tensor>& slots, int64_t span) {
  if (slots.has_value() && slots->defined()) {
    keys.index_copy_(2, *slots, k);
    values.index_copy_(2, *slots, v);
  } else if (k.is_contiguous() && v.is_contiguous() && k.scalar_type() == keys.scalar_type() &&
             v.scalar_type() == values.scalar_type() && keys.stride(3) == 1 && values.stride(3) == 1 &&
             k.sizes() == v.sizes() && first + k.size(2) <= keys.size(2)) {  // (rope's k and v: row by row)
    write_rows(keys, values, k, v, 0, k.size(2), [&](int64_t r) { return first + r; });
  } else {
    keys.narrow(2, first, k.size(2)).copy_(k);
    values.narrow(2, first, v.size(2)).copy_(v);
  }
  return {keys.narrow(2, 0, span), values.narrow(2, 0, span)};
}

// x [1, rows, width] -> the layer's output. `w`: norm_1's weight, q/k/v's values, scales and bias, o's, norm_2's
// weight, gate/up's values, scales and bias, down's, then q's and k's head norm weights (empty: none, else Qwen3's
// q_norm and k_norm, at the layer's eps), then, where q, k and v are two products (a file's q and k in Q4_K, its v
// in Q6_K), the second's values, scales and bias, its outputs after the first's; `bits`: the products' kernels.
// The new keys and values go to slots
// first.. of `keys` and `values` [1, kv heads, slots, d] (or to `slots`, where they are not consecutive), and the
// attention reads the first `span`. `attention`, `mlp`: whether each sublayer runs (a self-draft skips some).
// The layer around its attention: `attend_to(q, k, v)` [1, heads or kv heads, rows, d] -> [1, rows, heads * d]
// writes the new keys and values and attends (one sequence's cache, or several sequences' rows each to its own)
template <typename Attend>
torch::Tensor layer_around(torch::Tensor x, const std::vector<torch::Tensor>& w, const std::vector<int64_t>& bits,
                           const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                           double eps, bool attention, bool mlp, Attend&& attend_to) {
  const bool two = w.size() == 19 && bits.size() == 5;  // (q, k and v as two products)
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && ((w.size() == 16 && bits.size() == 4) || two),
              "layer: x [1, rows, width], 16 weights and 4 kernels (19 and 5: q, k and v two products)");
  const int64_t rows = x.size(1), width = x.size(2);
  if (attention) {
    const auto normed = rms_norm(x, w[0], eps).view({rows, width});
    auto qkv = project(normed, &w[1], bits[0]);
    if (two) qkv = torch::cat({qkv, project(normed, &w[16], bits[4])}, 1);
    if (w[14].numel()) qkv = head_norms(qkv, w[14], w[15], heads, kv_heads, eps);
    auto qkv_rotated = rope(qkv, cos, sin, heads, kv_heads);
    auto a = attend_to(qkv_rotated[0], qkv_rotated[1], qkv_rotated[2]);
    x = add_into(project(a.view({rows, a.size(2)}), &w[4], bits[1]).view({1, rows, width}), x);
  }
  if (mlp) {
    auto gate_up = project(rms_norm(x, w[7], eps).view({rows, width}), &w[8], bits[2]);
    x = add_into(project(silu_mul(gate_up), &w[11], bits[3]).view({1, rows, width}), x);
  }
  return x;
}

// x [1, rows, width] -> the layer's output. `w`: norm_1's weight, q/k/v's values, scales and bias, o's, norm_2's
// weight, gate/up's values, scales and bias, down's, then q's and k's head norm weights (empty: none, else Qwen3's
// q_norm and k_norm, at the layer's eps), then, where q, k and v are two products (a file's q and k in Q4_K, its v
// in Q6_K), the second's values, scales and bias, its outputs after the first's; `bits`: the products' kernels.
// The new keys and values go to slots
// first.. of `keys` and `values` [1, kv heads, slots, d] (or to `slots`, where they are not consecutive), and the
// attention reads the first `span`. `attention`, `mlp`: whether each sublayer runs (a self-draft skips some).
torch::Tensor layer(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> bits, torch::Tensor cos,
                    torch::Tensor sin, int64_t heads, int64_t kv_heads, torch::Tensor keys, torch::Tensor values,
                    int64_t first, c10::optional<torch::Tensor> slots, int64_t span,
                    c10::optional<torch::Tensor> mask, double scale, double eps, bool attention, bool mlp) {
  return layer_around(x, w, bits, cos, sin, heads, kv_heads, eps, attention, mlp,
                      [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
                        const auto attended = store(keys, values, k, v, first, slots, span);
                        return attend(q, attended.first, attended.second, mask, scale);
                      });
}

// The same layer over several sequences' rows (`exec.lockstep`), each part's attention to its own cache as
// `attend_parts` takes them: the same operations on the same rows, so each row's bits are what `layer` gives it
torch::Tensor layer_parts(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> bits, torch::Tensor cos,
                          torch::Tensor sin, int64_t heads, int64_t kv_heads, std::vector<torch::Tensor> keys,
                          std::vector<torch::Tensor> values, std::vector<int64_t> rows_of, std::vector<int64_t> first,
                          std::vector<c10::optional<torch::Tensor>> slots, std::vector<int64_t> span,
                          std::vector<c10::optional<torch::Tensor>> masks, double scale, double eps, bool attention,
                          bool mlp) {
  return layer_around(x, w, bits, cos, sin, heads, kv_heads, eps, attention, mlp,
                      [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
                        return attend_parts(q, k, v, keys, values, rows_of, first, slots, span, masks, scale);
                      });
}

Layers::Layers(std::vector<std::vector<torch::Tensor>> weights, std::vector<std::vector<int64_t>> bits,
               std::vector<double> eps, std::vector<double> scales, int64_t heads, int64_t kv_heads)
    : weights(std::move(weights)), bits(std::move(bits)), eps(std::move(eps)), scales(std::move(scales)),
      heads(heads), kv_heads(kv_heads) {
  TORCH_CHECK(this->weights.size() == this->bits.size() && this->bits.size() == this->eps.size() &&
              this->eps.size() == this->scales.size(), "one entry a layer");
}

torch::Tensor Layers::run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                          torch::Tensor values, int64_t first, c10::optional<torch::Tensor> slots, int64_t span,
                          std::vector<c10::optional<torch::Tensor>> masks, std::vector<int64_t> skip_attention,
                          std::vector<int64_t> skip_mlp) {
  const int64_t n = static_cast<int64_t>(weights.size());
  TORCH_CHECK(keys.size(0) == n && values.size(0) == n, "caches: [layers, 1, kv heads, slots, d]");
  TORCH_CHECK(static_cast<int64_t>(masks.size()) == n, "a mask a layer (sliding windows have their own)");
  std::vector<char> attention(n, 1), mlp(n, 1);
  for (int64_t i : skip_attention) attention.at(i) = 0;
  for (int64_t i : skip_mlp) mlp.at(i) = 0;
  for (int64_t i = 0; i < n; ++i)
    x = layer(x, weights[i], bits[i], cos, sin, heads, kv_heads, keys.select(0, i), values.select(0, i), first,
              slots, span, masks[i], scales[i], eps[i], attention[i], mlp[i]);
  return x;
}

MixtureExperts::MixtureExperts(std::vector<torch::Tensor> weights, std::vector<int64_t> bits, double alpha,
                               double limit)
    : weights(std::move(weights)), bits(std::move(bits)), alpha(alpha), limit(limit) {
  TORCH_CHECK(this->weights.size() == 3 * this->bits.size() && this->bits.size() % 2 == 0, "6 tensors, 2 bits an expert");
}

// x [rows, width] bfloat16, index [rows, k] (each row's experts; past the count: none), routing [rows, k]
// (bfloat16 or float32). What `quant.Experts`' loop does, operation for operation: each expert hit, in the experts'
// order, its rows' silu(gate) * up (or gpt-oss's activation, the biases in its products) through down, times each row's weight (in float, rounded to bfloat16, as torch
// multiplies a bfloat16 output by either), added into the row's output (in float, rounded), as index_add_ adds it
torch::Tensor MixtureExperts::run(torch::Tensor x, torch::Tensor index, torch::Tensor routing) const {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x: [rows, width] bfloat16");
  x = x.contiguous();
  const int64_t rows = x.size(0), width = x.size(1), k = index.size(1), count = bits.size() / 2;
  const auto ix = index.to(at::kLong).contiguous();
  const auto wt = routing.to(at::kFloat).contiguous();  // (bfloat16 weights exactly)
  const int64_t* chosen = ix.data_ptr<int64_t>();
  const float* weight = wt.data_ptr<float>();
  std::vector<std::vector<int64_t>> taken(count);  // an expert's (row, slot) pairs, row by row
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = chosen[r * k + s];
      if (e >= 0 && e < count) taken[e].push_back(r * k + s);
    }
  auto out = torch::zeros_like(x);
  bf16* o = out.data_ptr<bf16>();
  const bf16* xp = x.data_ptr<bf16>();
  for (int64_t e = 0; e < count; ++e) {
    const auto& pairs = taken[e];
    const int64_t n = static_cast<int64_t>(pairs.size());
    if (n == 0) continue;
    torch::Tensor xs = x;
    if (n != rows) {
      xs = torch::empty({n, width}, x.options());
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(xs.data_ptr<bf16>() + i * width, xp + pairs[i] / k * width, width * sizeof(bf16));
    }
    const torch::Tensor* w = weights.data() + 6 * e;
    auto gate_up = project(xs, w, bits[2 * e]);
    torch::Tensor act;
    if (alpha == 0) {
      act = silu_mul(gate_up);
    } else {  // (gpt-oss's, torch's operations as `quant.ClampedSwiGLU` runs them: the same bits)
      const auto halves = gate_up.chunk(2, 1);
      const auto gate = halves[0].clamp_max(limit), up = halves[1].clamp(-limit, limit);
      act = (up + 1) * (gate * at::sigmoid(gate * alpha));
    }
    auto y = project(act, w + 3, bits[2 * e + 1]).contiguous();
    const bf16* yp = y.data_ptr<bf16>();
    for (int64_t i = 0; i < n; ++i) {
      bf16* row = o + pairs[i] / k * width;
      const __m512 scale = _mm512_set1_ps(weight[pairs[i]]);
      for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 m = simd::lanes(width - j);
        const __m512 weighted = simd::round16(_mm512_mul_ps(simd::load16(yp + i * width + j, m), scale));
        simd::put16(row + j, _mm512_add_ps(simd::load16(row + j, m), weighted), m);
      }
    }
  }
  return out;
}

// A packed product as `packing.linear` runs it: oneDNN's _linear_pointwise over the packed weight, bfloat16 inputs
// in pieces of 32 rows (its bits for a row do not depend on the others up to 32), a piece of one row as two
inline torch::Tensor packed_product(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  auto run = [&](const torch::Tensor& part) {
    torch::jit::Stack stack{part, packed, bias.numel() ? c10::IValue(bias) : c10::IValue(),
                            c10::IValue(std::string("none")),
                            c10::IValue(c10::List<c10::optional<c10::Scalar>>()), c10::IValue(std::string(""))};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  };
  const bool pieces = x.scalar_type() != at::kFloat;
  auto piece = [&](const torch::Tensor& part) {
    if (pieces && part.size(-2) == 1)  // (one row as two: oneDNN's one-row kernel sums otherwise)
      return run(torch::cat({part, part}, -2)).narrow(-2, 0, 1);
    return run(part);
  };
  constexpr int64_t ROWS = 32;
  if (pieces && x.size(-2) > ROWS) {  // (the last piece may be one row: 33 rows are 32 and one)
    std::vector<torch::Tensor> parts;
    for (const auto& part : x.split(ROWS, -2)) parts.push_back(piece(part));
    return torch::cat(parts, -2);
  }
  return piece(x);
}

// GPT-2's activation as transformers writes it (NewGELUActivation), operation by operation: the same bits (in
// bfloat16 on AVX2 glue.cpp's one pass, `gelu_new`)
inline torch::Tensor gpt2_gelu(const torch::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16 && use_fused_gelu) return gelu_new(x);
  auto inner = at::mul(at::add(x, at::mul(at::pow(x, 3.0), 0.044715)), std::sqrt(2.0 / M_PI));
  return at::mul(at::mul(x, 0.5), at::add(at::tanh(inner), 1.0));
}

// One of GPT-2's products: kind 0 packed (`packing.linear`), 1 its own Conv1D (addmm over [in, out] weights),
// 2, 3 and 4 spec's int4, 8-bit and 6-bit ones (`w` values, `scales` theirs; the bias, empty for none, added in bfloat16
// as `quant.product` adds it), 5 bfloat16 weights [out, in] on `mm16` (the bias alike)
inline torch::Tensor gpt2_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, int64_t kind,
                                  const torch::Tensor& scales) {
  if (kind == 0) return packed_product(x, w, b);
  const auto rows = x.view({-1, x.size(-1)});
  auto y = kind >= 2 ? project(rows, w, scales, b, kind == 3 ? 8 : kind == 4 ? 6 : kind == 5 ? 16 : 4) : at::addmm(b, rows, w);
  auto sizes = x.sizes().vec();
  sizes.back() = y.size(1);
  return y.view(sizes);
}

// A GPT-2 block around its attention (`attend_to(q, k, v)` [1, heads, rows, d] -> [1, rows, width]), the same
// operations in the same order as the lean loop runs them (layer norms, products and the activation torch's). `w`:
// ln_1's weight and bias, c_attn's weight and bias, the attention's c_proj's, ln_2's, c_fc's, the MLP's c_proj's,
// then the four products' scales (empty but for kinds 2 and 3); `kinds`: each product's (see gpt2_product).
template <typename Attend>
torch::Tensor gpt2_around(torch::Tensor x, const std::vector<torch::Tensor>& w, const std::vector<int64_t>& kinds,
                          double eps_1, double eps_2, int64_t heads, bool attention, bool mlp, Attend&& attend_to) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && w.size() == 16 && kinds.size() == 4,
              "gpt2_layer: x [1, rows, width], 16 weights, 4 kinds");
  const int64_t rows = x.size(1), width = x.size(2), d = width / heads;
  if (attention) {
    auto h = at::layer_norm(x, {width}, w[0], w[1], eps_1);
    auto qkv = gpt2_product(h, w[2], w[3], kinds[0], w[12]).split(width, 2);
    auto q = qkv[0].view({1, rows, heads, d}).transpose(1, 2);
    auto k = qkv[1].view({1, rows, heads, d}).transpose(1, 2);
    auto v = qkv[2].view({1, rows, heads, d}).transpose(1, 2);
    x = add_into(gpt2_product(attend_to(q, k, v), w[4], w[5], kinds[1], w[13]), x);
  }
  if (mlp) {
    auto up = gpt2_product(at::layer_norm(x, {width}, w[6], w[7], eps_2), w[8], w[9], kinds[2], w[14]);
    x = add_into(gpt2_product(gpt2_gelu(up), w[10], w[11], kinds[3], w[15]), x);
  }
  return x;
}

// A GPT-2 block as one call (attention spec's in bfloat16, torch's flash kernel in float32, as the lean loop's)
torch::Tensor gpt2_layer(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> kinds, double eps_1,
                         double eps_2, int64_t heads, torch::Tensor keys, torch::Tensor values, int64_t first,
                         c10::optional<torch::Tensor> slots, int64_t span, c10::optional<torch::Tensor> mask,
                         double scale, bool attention, bool mlp) {
  const int64_t rows = x.size(1), width = x.size(2), d = width / heads;
  return gpt2_around(x, w, kinds, eps_1, eps_2, heads, attention, mlp,
                     [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
                       const auto attended = store(keys, values, k, v, first, slots, span);
                       if (x.scalar_type() == at::kBFloat16) return attend(q, attended.first, attended.second, mask, scale);
                       // as backends.attend calls the kernel, then lean_forward lays the heads side by side
                       auto out = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
                           q, attended.first, attended.second, 0.0, false, mask, scale));
                       return out.narrow(2, 0, rows).reshape({1, heads, rows, d}).transpose(1, 2).reshape({1, rows, width});
                     });
}

// The same block over several sequences' rows (`exec.lockstep`), spec's attention of each part to its own cache
// (`attend_parts`), as the grouped lean loop runs it where that attention is the model's: the same bits
torch::Tensor gpt2_layer_parts(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> kinds, double eps_1,
                               double eps_2, int64_t heads, std::vector<torch::Tensor> keys,
                               std::vector<torch::Tensor> values, std::vector<int64_t> rows_of,
                               std::vector<int64_t> first, std::vector<c10::optional<torch::Tensor>> slots,
                               std::vector<int64_t> span, std::vector<c10::optional<torch::Tensor>> masks,
                               double scale, bool attention, bool mlp) {
  return gpt2_around(x, w, kinds, eps_1, eps_2, heads, attention, mlp,
                     [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
                       return attend_parts(q, k, v, keys, values, rows_of, first, slots, span, masks, scale);
                     });
}
