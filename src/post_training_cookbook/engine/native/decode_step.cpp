// A decode step on CPU for Llama-family models: one token per row over the engine's KV buffers.
//
// A decode step of a small model is hundreds of tiny ops; from Python each costs several
// microseconds of dispatch, and torch's batched matmul pays a fixed cost per (row, KV head)
// matrix ([group, dim] x [dim, keys]). Here the matmuls stay torch's (at::linear) and the rest
// runs as plain loops: RMSNorm, rotary embedding, the KV write, attention (each key and value
// read once for all the query heads that share it, float32 softmax) and SiLU-and-multiply.
// Elementwise steps round to the model's dtype where Hugging Face's modules do, so bfloat16
// results match theirs op for op; attention keeps its scores in float32 (torch's bf16 matmul
// rounds them to bf16 first). Hybrid models (Qwen3.5) get one kernel here too: their Gated
// DeltaNet layers' decode step between its two matmuls (gated_delta_step, called by
// engine/gated_delta.py); it lives in this file, past 400 lines, because the loader builds
// one source into one library. Built on first use by post_training_cookbook.engine.native.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Round to T and back: what storing an intermediate in the model's dtype does.
template <typename T>
inline float round_to(float x) {
  return to_float(static_cast<T>(x));
}

// kDim > 0 fixes the head size at compile time (the compiler then unrolls and vectorises the
// inner loops fully); kDim == 0 reads it at run time.
template <typename T, int64_t kDim>
void attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
            const at::Tensor& valid, int64_t lo, int64_t hi, float scale, at::Tensor& out) {
  const int64_t rows = query.size(0), kv_heads = query.size(1), group = query.size(2);
  const int64_t dim = kDim > 0 ? kDim : query.size(3);
  const int64_t width = hi - lo;
  const T* q = query.data_ptr<T>();
  const T* k = keys.data_ptr<T>();
  const T* v = values.data_ptr<T>();
  const bool* visible = valid.data_ptr<bool>();
  T* o = out.data_ptr<T>();
  const int64_t k_row = keys.stride(0), k_head = keys.stride(1), k_col = keys.stride(2);
  const int64_t v_row = values.stride(0), v_head = values.stride(1), v_col = values.stride(2);
  const int64_t visible_row = valid.stride(0);
  // Not at::parallel_for: its header-inline first-call setup keeps a thread_local flag of
  // this library's own, so on the engine's worker thread it would run torch's
  // init_num_threads() again and reset the worker's count to the process default (measured:
  // a 1-thread engine then computed with 2 and slowed the trainer beside it by ~30%).
  // omp_get_max_threads() is the calling thread's own count.
  const int64_t units = rows * kv_heads;
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), units)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> queries(group * dim), scores(group * width), acc(group * dim), row(dim),
        mask(width);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < units; ++unit) {
      const int64_t r = unit / kv_heads, h = unit % kv_heads;
      const T* unit_query = q + unit * group * dim;
      for (int64_t i = 0; i < group * dim; ++i) queries[i] = to_float(unit_query[i]) * scale;
      // The row's own columns: a short prompt's row starts right of the window's left edge.
      int64_t first = 0;
      while (first < width && !visible[r * visible_row + lo + first]) ++first;
      const int64_t span = width - first;
      const bool* seen = visible + r * visible_row + lo + first;
      const T* unit_keys = k + r * k_row + h * k_head + (lo + first) * k_col;
      const T* unit_values = v + r * v_row + h * v_head + (lo + first) * v_col;
      for (int64_t c = 0; c < span; ++c) mask[c] = seen[c] ? 1.f : 0.f;
      for (int64_t c = 0; c < span; ++c) {
        const T* key = unit_keys + c * k_col;
        for (int64_t d = 0; d < dim; ++d) row[d] = to_float(key[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = queries.data() + g * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qg[d] * row[d];
          scores[g * width + c] = dot;
        }
      }
      // Built with -ffast-math, which assumes no infinities: masking multiplies by 0 instead.
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * width;
        float best = -FLT_MAX;
        for (int64_t c = 0; c < span; ++c) best = seen[c] ? std::max(best, sg[c]) : best;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t c = 0; c < span; ++c) {
          const float p = std::exp(std::min(sg[c] - best, 0.f)) * mask[c];
          sg[c] = p;
          total += p;
        }
        const float inverse = total > 0.f ? 1.f / total : 0.f;  // nothing visible: output 0
        for (int64_t c = 0; c < span; ++c) sg[c] *= inverse;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < span; ++c) {
        const T* value = unit_values + c * v_col;
        for (int64_t d = 0; d < dim; ++d) row[d] = to_float(value[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * width + c];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * row[d];
        }
      }
      T* unit_out = o + unit * group * dim;
      for (int64_t i = 0; i < group * dim; ++i) unit_out[i] = static_cast<T>(acc[i]);
    }
  }
}

template <typename T>
void dispatch_dim(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& valid, int64_t lo, int64_t hi, float scale, at::Tensor& out) {
  switch (query.size(3)) {
    case 64:
      return attend<T, 64>(query, keys, values, valid, lo, hi, scale, out);
    case 128:
      return attend<T, 128>(query, keys, values, valid, lo, hi, scale, out);
    default:
      return attend<T, 0>(query, keys, values, valid, lo, hi, scale, out);
  }
}


// Hugging Face's RMSNorm: float32 statistics, the normalised value rounded to T, then times
// the weight in T. ``x`` and ``out`` are [rows, size] with the given row strides.
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* weight, T* out, int64_t out_stride,
                   int64_t rows, int64_t size, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* yr = out + r * out_stride;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < size; ++i) squares += to_float(xr[i]) * to_float(xr[i]);
    const float inverse = 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
    for (int64_t i = 0; i < size; ++i)
      yr[i] = static_cast<T>(to_float(weight[i]) * round_to<T>(to_float(xr[i]) * inverse));
  }
}

// Hugging Face's rotate-half rotary embedding on one head, in place: x * cos + rotate(x) * sin,
// each product and the sum rounded to T.
template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int64_t dim) {
  const int64_t half = dim / 2;
  float rotated[1024];  // dim <= 1024, checked by the caller
  for (int64_t d = 0; d < dim; ++d) rotated[d] = to_float(x[d]);
  for (int64_t d = 0; d < dim; ++d) {
    const float turned = d < half ? -rotated[d + half] : rotated[d - half];
    const float a = round_to<T>(rotated[d] * to_float(cos[d]));
    const float b = round_to<T>(turned * to_float(sin[d]));
    x[d] = static_cast<T>(a + b);
  }
}

template <typename T>
at::Tensor silu_and_multiply(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  std::vector<float> silu(size);
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = in + r * 2 * size;
    const T* up = gate + size;
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) {  // a separate loop, so that exp vectorises
      const float g = to_float(gate[i]);
      silu[i] = g / (1.f + std::exp(-g));
    }
    for (int64_t i = 0; i < size; ++i)
      o[r * size + i] = static_cast<T>(round_to<T>(silu[i]) * to_float(up[i]));
  }
  return out;
}

// A weight in oneDNN's packed layout (torch.ops.mkldnn._reorder_linear_weight) goes to
// oneDNN's linear, which then skips re-laying the weight out on every call; others to at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (weight.is_mkldnn()) {
    static const c10::OperatorHandle packed =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack{x, weight, has_bias ? c10::IValue(bias) : c10::IValue(),
                                   c10::IValue("none"),
                                   c10::IValue(c10::List<std::optional<at::Scalar>>()),
                                   c10::IValue("")};
    packed.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return has_bias ? at::linear(x, weight, bias) : at::linear(x, weight);
}

// Per layer, in this order (empty tensors where the model has none).
enum Slot {
  kInputNorm, kQkvWeight, kQkvBias, kQueryNorm, kKeyNorm, kOutWeight, kOutBias, kPostNorm,
  kGateUpWeight, kGateUpBias, kDownWeight, kDownBias, kSlots
};

template <typename T>
at::Tensor step(const at::Tensor& input_ids, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& embed, const std::vector<at::Tensor>& weights,
                const at::Tensor& final_norm, const at::Tensor& lm_head,
                const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                const at::Tensor& valid, int64_t col, int64_t lo, int64_t heads, double eps,
                double scale) {
  const int64_t rows = input_ids.size(0), hidden_size = embed.size(1);
  const int64_t kv_heads = keys[0].size(1), dim = keys[0].size(3), group = heads / kv_heads;
  const float feps = static_cast<float>(eps);
  at::Tensor hidden = at::embedding(embed, input_ids);  // [rows, hidden], a fresh tensor
  at::Tensor normed = at::empty_like(hidden);
  const T* cos_data = cos.data_ptr<T>();
  const T* sin_data = sin.data_ptr<T>();
  for (size_t layer = 0; layer < keys.size(); ++layer) {
    const at::Tensor* w = weights.data() + layer * kSlots;
    rms_norm_rows<T>(hidden.data_ptr<T>(), hidden_size, w[kInputNorm].data_ptr<T>(),
                     normed.data_ptr<T>(), hidden_size, rows, hidden_size, feps);
    at::Tensor qkv = linear(normed, w[kQkvWeight], w[kQkvBias]).contiguous();
    at::Tensor query = at::empty({rows, kv_heads, group, dim}, hidden.options());
    T* qkv_data = qkv.data_ptr<T>();
    T* query_data = query.data_ptr<T>();
    T* key_buffer = keys[layer].data_ptr<T>();
    T* value_buffer = values[layer].data_ptr<T>();
    const int64_t row_width = (heads + 2 * kv_heads) * dim;
    const auto ks = keys[layer].strides();
    const auto vs = values[layer].strides();
    const bool head_norms = w[kQueryNorm].numel() > 0;
    for (int64_t r = 0; r < rows; ++r) {
      T* q_row = qkv_data + r * row_width;  // heads * dim queries, then keys, then values
      if (head_norms) {  // Qwen3: RMSNorm over each query and key head before the rotation
        rms_norm_rows<T>(q_row, dim, w[kQueryNorm].data_ptr<T>(), q_row, dim, heads, dim, feps);
        rms_norm_rows<T>(q_row + heads * dim, dim, w[kKeyNorm].data_ptr<T>(),
                         q_row + heads * dim, dim, kv_heads, dim, feps);
      }
      for (int64_t h = 0; h < heads + kv_heads; ++h)
        rotate_head<T>(q_row + h * dim, cos_data + r * dim, sin_data + r * dim, dim);
      std::memcpy(query_data + r * heads * dim, q_row, heads * dim * sizeof(T));
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(key_buffer + r * ks[0] + h * ks[1] + col * ks[2],
                    q_row + (heads + h) * dim, dim * sizeof(T));
        std::memcpy(value_buffer + r * vs[0] + h * vs[1] + col * vs[2],
                    q_row + (heads + kv_heads + h) * dim, dim * sizeof(T));
      }
    }
    at::Tensor attended = at::empty_like(query);
    dispatch_dim<T>(query, keys[layer], values[layer], valid, lo, col + 1,
                    static_cast<float>(scale), attended);
    hidden.add_(linear(attended.view({rows, heads * dim}), w[kOutWeight], w[kOutBias]));
    rms_norm_rows<T>(hidden.data_ptr<T>(), hidden_size, w[kPostNorm].data_ptr<T>(),
                     normed.data_ptr<T>(), hidden_size, rows, hidden_size, feps);
    at::Tensor gate_up = linear(normed, w[kGateUpWeight], w[kGateUpBias]).contiguous();
    hidden.add_(linear(silu_and_multiply<T>(gate_up), w[kDownWeight], w[kDownBias]));
  }
  rms_norm_rows<T>(hidden.data_ptr<T>(), hidden_size, final_norm.data_ptr<T>(),
                   normed.data_ptr<T>(), hidden_size, rows, hidden_size, feps);
  return linear(normed, lm_head, at::Tensor()).to(at::kFloat);
}

}  // namespace

// query [rows, kv_heads, group, dim]; keys and values [>= rows, kv_heads, >= hi, dim] (row r
// of the query attends over row r); valid [>= rows, >= hi] bool. Attends over columns
// [lo, hi) where valid; returns [rows, kv_heads, group, dim] in the query's dtype.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& valid, int64_t lo,
                            int64_t hi, double scale) {
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "decode_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 4 && query.is_contiguous(),
              "query must be a contiguous [rows, kv_heads, group, dim] tensor");
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.sizes() == values.sizes(),
              "keys and values must be [rows, kv_heads, cols, dim] of one shape");
  TORCH_CHECK(keys.scalar_type() == query.scalar_type() &&
                  values.scalar_type() == query.scalar_type(),
              "query, keys and values must share a dtype");
  TORCH_CHECK(keys.size(0) >= query.size(0) && keys.size(1) == query.size(1) &&
                  keys.size(3) == query.size(3),
              "keys do not match the query's rows, KV heads or head size");
  // A unit stride where the size is over 1 (torch gives a size-1 dim any stride).
  TORCH_CHECK(keys.size(3) <= 1 || (keys.stride(3) == 1 && values.stride(3) == 1),
              "keys and values need a unit stride in dim");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 2 &&
                  (valid.size(1) <= 1 || valid.stride(1) == 1) && valid.size(0) >= query.size(0),
              "valid must be a bool [rows, cols] tensor with unit column stride");
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= keys.size(2) && hi <= valid.size(1),
              "columns [lo, hi) out of range");
  at::Tensor out = at::empty_like(query);
  const float fscale = static_cast<float>(scale);
  if (query.scalar_type() == at::kFloat) {
    dispatch_dim<float>(query, keys, values, valid, lo, hi, fscale, out);
  } else if (query.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(query, keys, values, valid, lo, hi, fscale, out);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16, got ", query.scalar_type());
  }
  return out;
}


// One decode step: logits (float32) [rows, vocab] for input_ids [rows] whose cos/sin [rows,
// dim] are given; writes each layer's key and value to column ``col`` of rows 0..rows-1 and
// attends over columns [lo, col]. ``weights`` holds kSlots tensors per layer (see Slot).
at::Tensor decode_step(const at::Tensor& input_ids, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& embed, const std::vector<at::Tensor>& weights,
                       const at::Tensor& final_norm, const at::Tensor& lm_head,
                       const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                       const at::Tensor& valid, int64_t col, int64_t lo, int64_t heads,
                       double eps, double scale) {
  TORCH_CHECK(!keys.empty() && keys.size() == values.size() &&
                  weights.size() == keys.size() * kSlots,
              "decode_step needs ", static_cast<int64_t>(kSlots), " weights per layer");
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong,
              "input_ids: [rows] int64");
  const int64_t rows = input_ids.size(0), dim = keys[0].size(3);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == rows &&
                  cos.size(1) == dim && cos.sizes() == sin.sizes(),
              "cos and sin: contiguous [rows, head_dim]");
  TORCH_CHECK(dim <= 1024 && dim % 2 == 0, "head_dim must be even and at most 1024");
  TORCH_CHECK(heads % keys[0].size(1) == 0, "heads must be a multiple of the KV heads");
  TORCH_CHECK(0 <= lo && lo <= col && col < keys[0].size(2) && col < valid.size(1),
              "column out of range");
  for (size_t i = 0; i < keys.size(); ++i) {
    TORCH_CHECK(keys[i].is_contiguous() && values[i].is_contiguous() &&
                    keys[i].sizes() == keys[0].sizes() && values[i].sizes() == keys[0].sizes() &&
                    keys[i].size(0) >= rows,
                "KV buffers: contiguous, one shape, at least as many rows as input_ids");
  }
  for (const at::Tensor& w : weights)
    TORCH_CHECK(w.is_mkldnn() || w.numel() == 0 ||
                    (w.is_contiguous() && w.scalar_type() == embed.scalar_type()),
                "weights must be contiguous (or oneDNN-packed) and of the embedding's dtype");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous() && valid.size(0) >= rows,
              "valid: contiguous bool [rows, cols]");
  if (embed.scalar_type() == at::kFloat)
    return step<float>(input_ids, cos, sin, embed, weights, final_norm, lm_head, keys, values,
                       valid, col, lo, heads, eps, scale);
  TORCH_CHECK(embed.scalar_type() == at::kBFloat16, "decode_step supports float32 and bfloat16");
  return step<c10::BFloat16>(input_ids, cos, sin, embed, weights, final_norm, lm_head, keys,
                             values, valid, col, lo, heads, eps, scale);
}


// Gated DeltaNet's single-token decode step after its input projection, for rows [first, last):
// engine/gated_delta.py's decode_token, rounding to T where it (Hugging Face's modules) does.
// Per row: shift the new column into the causal conv state and convolve (then SiLU);
// L2-normalise each key head's query and key; the gates; the delta rule over each value head's
// float32 state; the gated RMSNorm. The delta rule reads each head's state once, for q S and
// k S, and rewrites it while it is still in cache (S <- decay S + k delta^T, delta = beta (v -
// decay k S), out = decay q S + (q . k) delta): from torch that took three passes over the
// state, which is most of what a hybrid's decode step moves, and some forty small ops.
template <typename T>
void gated_delta_rows(const T* projected, int64_t projected_stride, T* conv_state,
                      const T* conv_weight, const T* conv_bias, const float* a_log,
                      const float* dt_bias, const T* norm_weight, float eps, float* state, T* out,
                      int64_t first, int64_t last, int64_t kernel, int64_t key_heads,
                      int64_t heads, int64_t head_k, int64_t head_v) {
  const int64_t key_dim = key_heads * head_k, value_dim = heads * head_v;
  const int64_t conv_dim = 2 * key_dim + value_dim, group = heads / key_heads;
  std::vector<float> mixed(conv_dim), read_q(head_v), read_k(head_v), delta(head_v), row(head_v);
  for (int64_t r = first; r < last; ++r) {
    const T* x = projected + r * projected_stride;  // mixed, then gate [value_dim], b, a [heads]
    const T* gate = x + conv_dim;
    const T* b = gate + value_dim;
    const T* a = b + heads;
    T* columns = conv_state + r * kernel * conv_dim;  // [kernel, conv_dim], oldest first
    std::copy(columns + conv_dim, columns + kernel * conv_dim, columns);
    std::copy(x, x + conv_dim, columns + (kernel - 1) * conv_dim);
    std::fill(mixed.begin(), mixed.end(), 0.f);
    for (int64_t j = 0; j < kernel; ++j) {
      const T* w = conv_weight + j * conv_dim;
      const T* in = columns + j * conv_dim;
#pragma omp simd
      for (int64_t c = 0; c < conv_dim; ++c) mixed[c] += to_float(w[c]) * to_float(in[c]);
    }
    for (int64_t c = 0; c < conv_dim; ++c) {
      const float v = round_to<T>(conv_bias ? mixed[c] + to_float(conv_bias[c]) : mixed[c]);
      mixed[c] = round_to<T>(v / (1.f + std::exp(-v)));  // SiLU
    }
    // Queries then keys, [key_heads, head_k] each: L2-normalised; queries divided by sqrt(head_k).
    const float query_scale = std::sqrt(static_cast<float>(head_k));
    for (int64_t h = 0; h < 2 * key_heads; ++h) {
      float* v = mixed.data() + h * head_k;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < head_k; ++i) squares += v[i] * v[i];
      const float inverse = 1.f / std::sqrt(squares + 1e-6f);
      for (int64_t i = 0; i < head_k; ++i)
        v[i] = h < key_heads ? v[i] * inverse / query_scale : v[i] * inverse;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = mixed.data() + (h / group) * head_k;
      const float* k = q + key_dim;
      const float* v = mixed.data() + 2 * key_dim + h * head_v;
      const float gain = round_to<T>(1.f / (1.f + std::exp(-to_float(b[h]))));
      const float lifted = to_float(a[h]) + dt_bias[h];
      const float softplus = lifted > 20.f ? lifted : std::log1p(std::exp(lifted));
      const float decay = std::exp(-std::exp(a_log[h]) * softplus);
      float* s = state + (r * heads + h) * head_k * head_v;
      std::fill(read_q.begin(), read_q.end(), 0.f);
      std::fill(read_k.begin(), read_k.end(), 0.f);
      float q_dot_k = 0.f;
      for (int64_t i = 0; i < head_k; ++i) {
        const float qi = q[i], ki = k[i];
        const float* si = s + i * head_v;
        q_dot_k += qi * ki;
#pragma omp simd
        for (int64_t j = 0; j < head_v; ++j) {
          read_q[j] += qi * si[j];
          read_k[j] += ki * si[j];
        }
      }
      float squares = 0.f;
      for (int64_t j = 0; j < head_v; ++j) {
        delta[j] = (v[j] - read_k[j] * decay) * gain;
        row[j] = round_to<T>(read_q[j] * decay + q_dot_k * delta[j]);
        squares += row[j] * row[j];
      }
      for (int64_t i = 0; i < head_k; ++i) {
        const float ki = k[i];
        float* si = s + i * head_v;
#pragma omp simd
        for (int64_t j = 0; j < head_v; ++j) si[j] = si[j] * decay + ki * delta[j];
      }
      // Qwen3_5RMSNormGated: normalise in float32, round, times the weight in T, times SiLU(gate).
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(head_v) + eps);
      const T* g = gate + h * head_v;
      T* o = out + r * value_dim + h * head_v;
      for (int64_t j = 0; j < head_v; ++j) {
        const float scaled = round_to<T>(row[j] * inverse);
        const float normed = round_to<T>(to_float(norm_weight[j]) * scaled);
        const float z = to_float(g[j]);
        o[j] = static_cast<T>(normed * (z / (1.f + std::exp(-z))));
      }
    }
  }
}

// projected [rows, conv_dim + 2 heads + value_dim] (the fused input projection's output),
// conv_state [rows, kernel, conv_dim] and conv_weight [kernel, conv_dim] (kernel-major),
// conv_bias [conv_dim] or empty, a_log and dt_bias [heads] float32, norm_weight [head_v], state
// [rows, heads, head_k, head_v] float32: conv_state and state are updated in place; returns the
// gated norm's output [rows, heads * head_v] (the output projection's input).
at::Tensor gated_delta_step(const at::Tensor& projected, at::Tensor conv_state,
                            const at::Tensor& conv_weight, const at::Tensor& conv_bias,
                            const at::Tensor& a_log, const at::Tensor& dt_bias,
                            const at::Tensor& norm_weight, double eps, at::Tensor state,
                            int64_t key_heads) {
  TORCH_CHECK(state.dim() == 4 && conv_state.dim() == 3 && projected.dim() == 2,
              "state: [rows, heads, head_k, head_v], conv_state: [rows, kernel, conv_dim], "
              "projected: [rows, width]");
  const int64_t rows = state.size(0), heads = state.size(1), head_k = state.size(2),
                head_v = state.size(3), kernel = conv_state.size(1);
  TORCH_CHECK(key_heads > 0 && heads % key_heads == 0, "heads must be a multiple of key_heads");
  const int64_t conv_dim = 2 * key_heads * head_k + heads * head_v;
  const at::ScalarType dtype = projected.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "gated_delta_step supports float32 and bfloat16");
  TORCH_CHECK(projected.size(0) == rows &&
                  projected.size(1) == conv_dim + heads * head_v + 2 * heads &&
                  projected.stride(1) == 1,
              "projected: [rows, conv_dim + value_dim + 2 heads] with unit column stride");
  TORCH_CHECK(conv_state.size(0) == rows && conv_state.size(2) == conv_dim &&
                  conv_weight.sizes() == at::IntArrayRef({kernel, conv_dim}) &&
                  (!conv_bias.defined() || conv_bias.numel() == 0 ||
                   conv_bias.numel() == conv_dim),
              "conv_state [rows, kernel, conv_dim], conv_weight [kernel, conv_dim]");
  TORCH_CHECK(a_log.numel() == heads && dt_bias.numel() == heads && norm_weight.numel() == head_v,
              "a_log, dt_bias [heads]; norm_weight [head_v]");
  for (const at::Tensor& t : {conv_state, conv_weight, norm_weight})
    TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous(),
                "conv and norm tensors: contiguous, of projected's dtype");
  for (const at::Tensor& t : {a_log, dt_bias, state})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(),
                "a_log, dt_bias and state: contiguous float32");
  const bool has_bias = conv_bias.defined() && conv_bias.numel() > 0;
  TORCH_CHECK(!has_bias || (conv_bias.scalar_type() == dtype && conv_bias.is_contiguous()),
              "conv_bias: contiguous, of projected's dtype");
  at::Tensor out = at::empty({rows, heads * head_v}, projected.options());
  const float* a = a_log.data_ptr<float>();
  const float* dt = dt_bias.data_ptr<float>();
  float* s = state.data_ptr<float>();
  const int64_t stride = projected.stride(0);
  // omp_get_max_threads(), not at::parallel_for: see attend. Each thread takes a block of rows.
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), rows)));
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* p = projected.data_ptr<T>();
    T* cs = conv_state.data_ptr<T>();
    const T* w = conv_weight.data_ptr<T>();
    const T* bias = has_bias ? conv_bias.data_ptr<T>() : nullptr;
    const T* norm = norm_weight.data_ptr<T>();
    T* o = out.data_ptr<T>();
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const int64_t count = omp_get_num_threads(), id = omp_get_thread_num();
      const int64_t block = (rows + count - 1) / count;
      const int64_t first = std::min(rows, id * block), last = std::min(rows, first + block);
      gated_delta_rows<T>(p, stride, cs, w, bias, a, dt, norm, static_cast<float>(eps), s, o,
                          first, last, kernel, key_heads, heads, head_k, head_v);
    }
  };
  if (dtype == at::kFloat)
    run(0.f);
  else
    run(c10::BFloat16(0.f));
  return out;
}

// Both release the GIL: a step takes milliseconds, and the engine's worker thread calls it
// while the event loop's env and tool coroutines want to run.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Decode attention over KV buffers (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_step", &decode_step, "A Llama-family decode step over KV buffers (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gated_delta_step", &gated_delta_step,
        "A Gated DeltaNet layer's decode step after its input projection (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
