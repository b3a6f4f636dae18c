// Sparse matrix-vector products for batch-1 decoding (TEAL's idea on the CPU): with the weight
// stored input-major, W (in, out), y = sum_i x_i * W[i, :] over the inputs whose magnitude
// passes the threshold, and only those rows are read. A negative threshold keeps every row,
// which is a dense product with the same kernel. Weights are float32, bfloat16 or int8 with one
// scale per row; activations and accumulation are float32, except that bfloat16 weights
// multiply the input rounded to bfloat16 and round the sums to bfloat16, as the bfloat16
// matrix product of a batch of rows does. Threads split the output columns,
// so each reads its own slice of every kept row and no reduction is needed. A column range
// [begin, end) multiplies one part of a fused matrix (q of a fused q/k/v, say).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {


#if defined(__AVX512F__)
// 16 weights as float32: plain, widened bfloat16 (its bits are a float32's top half), int8.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

constexpr int64_t kAhead = 8;  // rows ahead whose weights are prefetched
constexpr int64_t kPrefetchBelow = 16384;  // bytes per row segment
constexpr int kRows = 8;       // rows summed per pass over y

// y[j:j+16] += sum over the pass's rows of c[u] * r[u][j:j+16], two independent chains.
template <typename T>
inline void fma_block(const T* const* r, const __m512* c, int live, int64_t j, __mmask16 m,
                      float* y) {
  __m512 a = _mm512_maskz_loadu_ps(m, y + j), b = _mm512_setzero_ps();
  if (live == kRows) {
#pragma GCC unroll 8
    for (int u = 0; u < kRows; u += 2) {
      a = _mm512_fmadd_ps(c[u], load16(r[u] + j, m), a);
      b = _mm512_fmadd_ps(c[u + 1], load16(r[u + 1] + j, m), b);
    }
  } else {
    for (int u = 0; u < live; ++u) a = _mm512_fmadd_ps(c[u], load16(r[u] + j, m), a);
  }
  _mm512_mask_storeu_ps(y + j, m, _mm512_add_ps(a, b));
}

// y[begin:end] = sum_k coef[k] * w[rows[k], begin:end], kRows rows per pass over y.
template <typename T>
void accumulate(const T* w, int64_t out, const int64_t* rows, const float* coef, int64_t n,
                int64_t begin, int64_t end, float* y) {
  for (int64_t j = begin; j < end; ++j) y[j] = 0.0f;
  constexpr int64_t line = 64 / sizeof(T);  // weights per cache line
  const int64_t full_end = begin + (end - begin) / 16 * 16;
  // Short rows end before the hardware prefetcher has picked up their stream, so the rows
  // ahead are fetched by hand; long rows (the output head) stream better without.
  const bool prefetch = (end - begin) * static_cast<int64_t>(sizeof(T)) <= kPrefetchBelow;
  for (int64_t k = 0; k < n; k += kRows) {
    const int live = static_cast<int>(std::min<int64_t>(kRows, n - k));
    const T* r[kRows];
    __m512 c[kRows];
    const T* ahead[kRows];
    for (int u = 0; u < kRows; ++u) {
      r[u] = w + rows[std::min<int64_t>(k + u, n - 1)] * out;
      c[u] = _mm512_set1_ps(u < live ? coef[k + u] : 0.0f);
      ahead[u] = w + rows[std::min(k + kAhead + u, n - 1)] * out;
    }
    for (int64_t j = begin; j < full_end; j += 16) {
      if (prefetch && (j - begin) % line == 0) {
        for (int u = 0; u < kRows; ++u) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead[u] + j), _MM_HINT_T0);
        }
      }
      fma_block(r, c, live, j, 0xFFFF, y);
    }
    if (full_end < end) {
      fma_block(r, c, live, full_end, (__mmask16)((1u << (end - full_end)) - 1), y);
    }
  }
}
#else
inline float load(const float* p, int64_t j) { return p[j]; }
inline float load(const int8_t* p, int64_t j) { return static_cast<float>(p[j]); }
inline float load(const uint16_t* p, int64_t j) {
  uint32_t bits = static_cast<uint32_t>(p[j]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// y[begin:end] = sum_k coef[k] * w[rows[k], begin:end], one row at a time.
template <typename T>
void accumulate(const T* w, int64_t out, const int64_t* rows, const float* coef, int64_t n,
                int64_t begin, int64_t end, float* y) {
  for (int64_t j = begin; j < end; ++j) y[j] = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    const T* r = w + rows[k] * out;
    const float c = coef[k];
    for (int64_t j = begin; j < end; ++j) y[j] += c * load(r, j);
  }
}
#endif

// y[0:end-begin] = columns [begin, end) of the product. Threads take contiguous runs of the
// kept rows, so each streams its part of the matrix front to back, into its own partial sum;
// the partial sums are added at the end (a few kilobytes against megabytes of weights).
template <typename T>
void run(const T* w, int64_t out, int64_t begin, int64_t end, const std::vector<int64_t>& rows,
         const std::vector<float>& coef, float* y) {
  const int64_t n = static_cast<int64_t>(rows.size()), cols = end - begin;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 16));
  std::vector<float> partial(parts * cols);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t k0 = n * p / parts, k1 = n * (p + 1) / parts;
      accumulate(w + begin, out, rows.data() + k0, coef.data() + k0, k1 - k0, 0, cols,
                 partial.data() + p * cols);
    }
  });
  std::copy(partial.begin(), partial.begin() + cols, y);
  for (int64_t p = 1; p < parts; ++p) {
    const float* q = partial.data() + p * cols;
    for (int64_t j = 0; j < cols; ++j) y[j] += q[j];
  }
}

struct Stats {
  int64_t kept;
  double kept_abs, total_abs;
};

// A projection stored input-major (in, out), with one scale per row for int8 weights and an
// optional float32 bias per output column (Qwen2's q/k/v).
struct Matrix {
  torch::Tensor w;
  c10::optional<torch::Tensor> scale;
  c10::optional<torch::Tensor> bias;

  Matrix(torch::Tensor weights, c10::optional<torch::Tensor> scales,
         c10::optional<torch::Tensor> biases = c10::nullopt)
      : w(std::move(weights)), scale(std::move(scales)), bias(std::move(biases)) {
    TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat32 &&
                                      bias->is_contiguous() && bias->numel() == w.size(1)),
                "a bias is a contiguous float32 vector with one value per output column");
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weights must be a contiguous (in, out) matrix");
    const auto type = w.scalar_type();
    TORCH_CHECK(type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kInt8,
                "weights must be float32, bfloat16 or int8, not ", type);
    if (type == torch::kInt8) {
      TORCH_CHECK(scale.has_value() && scale->scalar_type() == torch::kFloat32 &&
                      scale->is_contiguous() && scale->numel() == w.size(0),
                  "int8 weights need a contiguous float32 scale per row");
    }
  }

  // y[0:end-begin] = columns [begin, end) of sum_i x_i * w[i] over |x_i| > threshold (every
  // row when threshold < 0).
  Stats product(const float* x, double threshold, int64_t begin, int64_t end, float* y) const {
    const int64_t in = w.size(0), out = w.size(1);
    const float* s = w.scalar_type() == torch::kInt8 ? scale->data_ptr<float>() : nullptr;
    const bool round = w.scalar_type() == torch::kBFloat16;
    std::vector<int64_t> rows;
    std::vector<float> coef;
    rows.reserve(in);
    coef.reserve(in);
    const float limit = static_cast<float>(threshold);
    Stats stats{0, 0.0, 0.0};
    for (int64_t i = 0; i < in; ++i) {
      const float magnitude = std::abs(x[i]);
      stats.total_abs += magnitude;
      if (threshold < 0 || magnitude > limit) {
        rows.push_back(i);
        coef.push_back(s ? x[i] * s[i] : round ? static_cast<float>(c10::BFloat16(x[i])) : x[i]);
        stats.kept_abs += magnitude;
      }
    }
    stats.kept = static_cast<int64_t>(rows.size());
    switch (w.scalar_type()) {
      case torch::kFloat32:
        run(w.data_ptr<float>(), out, begin, end, rows, coef, y);
        break;
      case torch::kBFloat16:
        run(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), out, begin, end, rows,
            coef, y);
        break;
      default:
        run(w.data_ptr<int8_t>(), out, begin, end, rows, coef, y);
    }
    if (round) {
      for (int64_t j = 0; j < end - begin; ++j) y[j] = static_cast<float>(c10::BFloat16(y[j]));
    }
    if (bias.has_value()) {
      const float* b = bias->data_ptr<float>() + begin;
      for (int64_t j = 0; j < end - begin; ++j) y[j] += b[j];
    }
    return stats;
  }
};

// Returns (y, rows read, sum of |x| over the rows read, sum of |x|): the last three are what the
// per-request signals need. `scale` (in,) is required for int8 weights, ignored otherwise.
std::tuple<torch::Tensor, int64_t, double, double> rows_matvec(
    const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scale,
    double threshold, int64_t begin, int64_t end) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous 1-D float32 tensor");
  const Matrix m(w, w.scalar_type() == torch::kInt8 ? scale : c10::nullopt);
  TORCH_CHECK(w.size(0) == x.size(0), "w must have one row per element of x");
  if (end < 0) end = w.size(1);
  TORCH_CHECK(0 <= begin && begin < end && end <= w.size(1), "column range outside the matrix");
  auto y = torch::empty({end - begin}, x.options());
  const Stats st = m.product(x.data_ptr<float>(), threshold, begin, end, y.data_ptr<float>());
  return {y, st.kept, st.kept_abs, st.total_abs};
}

void rms_norm(const float* x, const float* weight, int64_t n, double eps, float* out) {
  double squares = 0.0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(squares / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * r);
}

// Rotary embedding in Hugging Face's rotate-half form, in place on one head.
void rope(float* v, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = v[j], b = v[j + half];
    v[j] = a * cos[j] - b * sin[j];
    v[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

// GELU with the tanh approximation, as PyTorch's gelu(approximate="tanh").
inline float gelu_tanh(float x) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  return 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * x * x * x)));
}

// Roles, in the order of a layer's thresholds and statistics.
enum Role { kQ, kK, kV, kO, kGate, kUp, kDown, kRoles };
// Norms, in the order `add` takes them; the last four are empty where the family has none.
enum Norm { kAttnNorm, kMlpNorm, kPostAttnNorm, kPostMlpNorm, kQNorm, kKNorm, kNorms };

// The decoder layers at batch 1: one call runs every layer for one token. Llama's shape
// (pre-norms, SwiGLU) and Gemma 3's (norms after each block too, q/k norms, GELU-tanh,
// sliding-window layers, a rotary table per layer type) are one code path.
class Layers {
 public:
  Layers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double attn_scale,
         bool gelu)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps),
        attn_scale_(static_cast<float>(attn_scale)), gelu_(gelu) {}

  // norms: attention and MLP input norms, then the optional post-attention, post-MLP, q and k
  // norms (empty when absent). window: positions a query sees (0 = all). rope: its row of the
  // rotary tables passed to `step`.
  void add(std::vector<torch::Tensor> norms, std::vector<Matrix> mats, int64_t window,
           int64_t rope) {
    TORCH_CHECK(mats.size() == 4, "a layer has four matrices: qkv, o, gate_up, down");
    TORCH_CHECK(norms.size() == kNorms, "a layer has six norms (empty where absent)");
    for (auto& n : norms) {
      TORCH_CHECK(n.scalar_type() == torch::kFloat32, "norm weights are float32");
      n = n.contiguous();
    }
    TORCH_CHECK(norms[kQNorm].numel() == 0 || norms[kQNorm].numel() == head_dim_,
                "q and k norms have one weight per head dimension");
    norms_.push_back(std::move(norms));
    mats_.push_back(std::move(mats));
    windows_.push_back(window);
    ropes_.push_back(rope);
  }

  // x (hidden,): the token's embedding, replaced by the last layer's output. keys, values
  // (layers, kv_heads, max_len, head_dim): the cache, written at `pos`; each layer's block is
  // contiguous, the layers may lie apart (one slot of the scheduler's (layers, slots, ...)). cos, sin (tables,
  // head_dim): the rotary tables at `pos`. thresholds (layers, 7) float64, negative = dense. channels
  // (layers, intermediate): |down input| out. counts (layers, 5) float64 out, per layer: over
  // the sparsified roles' inputs, as the hooks count them, zeroed and total activations, the
  // kept share of |x| summed over them, and their number; then the weights read. The trust
  // readout, where the tensors are not empty: hidden_out (layers, hidden) each layer's output,
  // attn_out (layers, heads, 2) float64 each head's attention share on positions before
  // `prompt_len` and its entropy.
  void step(torch::Tensor x, torch::Tensor keys, torch::Tensor values, const torch::Tensor& cos,
            const torch::Tensor& sin, int64_t pos, const torch::Tensor& thresholds,
            torch::Tensor channels, torch::Tensor counts, torch::Tensor hidden_out,
            torch::Tensor attn_out, int64_t prompt_len) {
    const int64_t layers = static_cast<int64_t>(mats_.size());
    const int64_t hidden = x.numel(), inter = channels.size(1), max_len = keys.size(2);
    const int64_t q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
    TORCH_CHECK(pos < max_len, "the cache is full");
    TORCH_CHECK(keys.stride(1) == max_len * head_dim_ && keys.stride(2) == head_dim_ &&
                    keys.stride(3) == 1 && values.strides() == keys.strides(),
                "each layer's keys and values are contiguous (kv_heads, max_len, head_dim)");
    const int64_t layer_stride = keys.stride(0);
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim_ && cos.is_contiguous() &&
                    sin.sizes() == cos.sizes() && sin.is_contiguous(),
                "cos and sin are contiguous (tables, head_dim)");
    TORCH_CHECK(thresholds.scalar_type() == torch::kFloat64 &&
                    counts.scalar_type() == torch::kFloat64 && counts.size(1) == 5,
                "thresholds and counts (layers, 5) are float64");
    const bool read_hidden = hidden_out.numel() > 0, read_attention = attn_out.numel() > 0;
    TORCH_CHECK(!read_hidden || (hidden_out.scalar_type() == torch::kFloat32 &&
                                 hidden_out.numel() == layers * hidden),
                "hidden_out is float32 (layers, hidden)");
    TORCH_CHECK(!read_attention || (attn_out.scalar_type() == torch::kFloat64 &&
                                    attn_out.numel() == layers * heads_ * 2),
                "attn_out is float64 (layers, heads, 2)");
    std::vector<float> h(hidden), qkv(q_width + 2 * kv_width), att(q_width), y(hidden);
    std::vector<float> gate_up(2 * inter), a(inter);
    float* xs = x.data_ptr<float>();
    const double* limits = thresholds.data_ptr<double>();
    double* all_counts = counts.data_ptr<double>();
    // Per role: the width of its input and the columns of one weight row.
    const int64_t in[kRoles] = {hidden, hidden, hidden, q_width, hidden, hidden, inter};
    const int64_t cols[kRoles] = {q_width, kv_width, kv_width, hidden, inter, inter, hidden};
    for (int64_t l = 0; l < layers; ++l) {
      const auto& m = mats_[l];
      const double* t = limits + l * kRoles;
      double* c = all_counts + l * 5;
      std::fill(c, c + 5, 0.0);
      auto record = [&](int role, const Stats& got) {
        c[4] += static_cast<double>(got.kept * cols[role]);
        if (t[role] < 0) return;
        c[0] += static_cast<double>(in[role] - got.kept);
        c[1] += static_cast<double>(in[role]);
        c[2] += got.total_abs > 0 ? got.kept_abs / got.total_abs : 1.0;
        c[3] += 1.0;
      };
      const auto& norm = norms_[l];
      rms_norm(xs, norm[kAttnNorm].data_ptr<float>(), hidden, eps_, h.data());
      if (t[kQ] == t[kK] && t[kK] == t[kV]) {
        const Stats got = m[0].product(h.data(), t[kQ], 0, q_width + 2 * kv_width, qkv.data());
        record(kQ, got), record(kK, got), record(kV, got);
      } else {
        record(kQ, m[0].product(h.data(), t[kQ], 0, q_width, qkv.data()));
        record(kK, m[0].product(h.data(), t[kK], q_width, q_width + kv_width, qkv.data() + q_width));
        record(kV, m[0].product(h.data(), t[kV], q_width + kv_width, q_width + 2 * kv_width,
                                qkv.data() + q_width + kv_width));
      }
      const int64_t table = ropes_[l] * head_dim_;
      attend(l, qkv.data(), cos.data_ptr<float>() + table, sin.data_ptr<float>() + table,
             keys.data_ptr<float>() + l * layer_stride, values.data_ptr<float>() + l * layer_stride,
             max_len, pos, att.data(),
             read_attention ? attn_out.data_ptr<double>() + l * heads_ * 2 : nullptr, prompt_len);
      record(kO, m[1].product(att.data(), t[kO], 0, hidden, y.data()));
      residual(norm[kPostAttnNorm], y.data(), xs, hidden);
      rms_norm(xs, norm[kMlpNorm].data_ptr<float>(), hidden, eps_, h.data());
      if (t[kGate] == t[kUp]) {
        const Stats got = m[2].product(h.data(), t[kGate], 0, 2 * inter, gate_up.data());
        record(kGate, got), record(kUp, got);
      } else {
        record(kGate, m[2].product(h.data(), t[kGate], 0, inter, gate_up.data()));
        record(kUp, m[2].product(h.data(), t[kUp], inter, 2 * inter, gate_up.data() + inter));
      }
      float* ch = channels.data_ptr<float>() + l * inter;
      for (int64_t j = 0; j < inter; ++j) {
        const float g = gate_up[j];
        a[j] = (gelu_ ? gelu_tanh(g) : g / (1.0f + std::exp(-g))) * gate_up[inter + j];
        ch[j] = std::abs(a[j]);
      }
      record(kDown, m[3].product(a.data(), t[kDown], 0, hidden, y.data()));
      residual(norm[kPostMlpNorm], y.data(), xs, hidden);
      if (read_hidden) std::copy(xs, xs + hidden, hidden_out.data_ptr<float>() + l * hidden);
    }
  }

  // Layer l's attention for a batch of rows, each against its own slot of the scheduler's
  // cache, exactly as `step` attends for one row, so no row reads another's padding. qkv (B,
  // q + 2 kv) float32: each row's projections (q and k are normalised and rotated in place);
  // keys, values (slots, kv_heads, max_len, head_dim): this layer's block of the slot cache,
  // row b in slot b, written at its position; cos, sin (B, tables, head_dim) at each row's
  // position; pos, prompt_len (B) int64; out (B, heads * head_dim); stats (B, heads, 2)
  // float64, or empty for none.
  void attend_rows(int64_t l, torch::Tensor qkv, torch::Tensor keys, torch::Tensor values,
                   const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& pos,
                   const torch::Tensor& prompt_len, torch::Tensor out, torch::Tensor stats) {
    const int64_t rows = qkv.size(0), d = head_dim_, max_len = keys.size(2);
    TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32 &&
                    qkv.size(1) == (heads_ + 2 * kv_heads_) * d,
                "qkv is contiguous float32 (rows, (heads + 2 kv heads) x head_dim)");
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.size(0) >= rows &&
                    keys.size(1) == kv_heads_ && keys.size(3) == d &&
                    values.sizes() == keys.sizes(),
                "keys and values are one layer's contiguous (slots, kv_heads, max_len, head_dim)");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 3 &&
                    cos.size(0) == rows && cos.size(2) == d && sin.sizes() == cos.sizes(),
                "cos and sin are contiguous (rows, tables, head_dim)");
    TORCH_CHECK(pos.scalar_type() == torch::kInt64 && prompt_len.scalar_type() == torch::kInt64 &&
                    pos.numel() == rows && prompt_len.numel() == rows,
                "pos and prompt_len are int64 (rows,)");
    TORCH_CHECK(out.is_contiguous() && out.numel() == rows * heads_ * d,
                "out is contiguous (rows, heads x head_dim)");
    const bool read = stats.numel() > 0;
    TORCH_CHECK(!read || (stats.is_contiguous() && stats.scalar_type() == torch::kFloat64 &&
                          stats.numel() == rows * heads_ * 2),
                "stats is contiguous float64 (rows, heads, 2)");
    const int64_t* at = pos.data_ptr<int64_t>();
    const int64_t* prompt = prompt_len.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) TORCH_CHECK(0 <= at[b] && at[b] < max_len, "the cache is full");
    const int64_t slot = keys.stride(0), rope_at = ropes_[l] * d, row_tables = cos.size(1) * d;
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t b = r0; b < r1; ++b) {
        attend(l, qkv.data_ptr<float>() + b * qkv.size(1),
               cos.data_ptr<float>() + b * row_tables + rope_at,
               sin.data_ptr<float>() + b * row_tables + rope_at,
               keys.data_ptr<float>() + b * slot, values.data_ptr<float>() + b * slot, max_len,
               at[b], out.data_ptr<float>() + b * heads_ * d,
               read ? stats.data_ptr<double>() + b * heads_ * 2 : nullptr, prompt[b]);
      }
    });
  }

 private:
  // x += y, normalised first where the family normalises a block's output.
  void residual(const torch::Tensor& post_norm, float* y, float* x, int64_t n) const {
    if (post_norm.numel() > 0) rms_norm(y, post_norm.data_ptr<float>(), n, eps_, y);
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  }

  // A head normalised in place, where the family has per-head norms.
  void head_norm(const torch::Tensor& weight, float* v) const {
    if (weight.numel() > 0) rms_norm(v, weight.data_ptr<float>(), head_dim_, eps_, v);
  }

  // One query against the cache: normalise (where the family does) and rotate q and k, store
  // k and v at `pos`, softmax-weighted sum of the values of the positions the layer sees
  // (0..pos, or the window ending at pos), for each head (grouped-query heads share a kv head).
  // stats (heads, 2), unless null: each head's probability on positions before prompt_len and
  // the probabilities' entropy.
  void attend(int64_t l, float* qkv, const float* cos, const float* sin, float* keys,
              float* values, int64_t max_len, int64_t pos, float* out, double* stats,
              int64_t prompt_len) const {
    const int64_t d = head_dim_, group = heads_ / kv_heads_;
    const auto& norm = norms_[l];
    const int64_t first = windows_[l] > 0 ? std::max<int64_t>(0, pos - windows_[l] + 1) : 0;
    float* q = qkv;
    const float* k = qkv + heads_ * d;
    const float* v = k + kv_heads_ * d;
    for (int64_t g = 0; g < kv_heads_; ++g) {
      float* key = keys + (g * max_len + pos) * d;
      std::copy(k + g * d, k + (g + 1) * d, key);
      head_norm(norm[kKNorm], key);
      rope(key, cos, sin, d);
      std::copy(v + g * d, v + (g + 1) * d, values + (g * max_len + pos) * d);
    }
    const float scale = attn_scale_;
    at::parallel_for(0, heads_, pos - first < 256 ? heads_ : 1, [&](int64_t h0, int64_t h1) {
      std::vector<float> scores(pos + 1);
      for (int64_t head = h0; head < h1; ++head) {
        float* qh = q + head * d;
        head_norm(norm[kQNorm], qh);
        rope(qh, cos, sin, d);
        const float* kh = keys + (head / group) * max_len * d;
        const float* vh = values + (head / group) * max_len * d;
        float top = -INFINITY;
        for (int64_t t = first; t <= pos; ++t) {
          float dot = 0.0f;
          for (int64_t j = 0; j < d; ++j) dot += qh[j] * kh[t * d + j];
          scores[t] = dot * scale;
          top = std::max(top, scores[t]);
        }
        // The entropy comes without a log per position: -sum p log p = log Z - sum p z, with
        // z the shifted logits and Z the softmax's normaliser.
        double total = 0.0, weighted = 0.0, on_prompt = 0.0;
        for (int64_t t = first; t <= pos; ++t) {
          const float z = scores[t] - top, e = std::exp(z);
          scores[t] = e;
          total += e;
          weighted += static_cast<double>(e) * z;
          if (t < prompt_len) on_prompt += e;
        }
        float* oh = out + head * d;
        std::fill(oh, oh + d, 0.0f);
        for (int64_t t = first; t <= pos; ++t) {
          const float p = static_cast<float>(scores[t] / total);
          for (int64_t j = 0; j < d; ++j) oh[j] += p * vh[t * d + j];
        }
        if (stats != nullptr) {
          stats[head * 2] = on_prompt / total;
          stats[head * 2 + 1] = std::log(total) - weighted / total;
        }
      }
    });
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  float attn_scale_;
  bool gelu_;
  std::vector<std::vector<torch::Tensor>> norms_;
  std::vector<std::vector<Matrix>> mats_;
  std::vector<int64_t> windows_, ropes_;
};

}  // namespace

// The products run without the interpreter lock (they touch no Python object), so the
// gateway's event loop keeps serving while the engine thread decodes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using unlocked = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<Matrix>(m, "Matrix")
      .def(pybind11::init<torch::Tensor, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>>(),
           pybind11::arg("weights"), pybind11::arg("scale"),
           pybind11::arg("bias") = pybind11::none());
  pybind11::class_<Layers>(m, "Layers")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, bool>())
      .def("add", &Layers::add)
      .def("step", &Layers::step, unlocked())
      .def("attend_rows", &Layers::attend_rows, unlocked());
  m.def("rows_matvec", &rows_matvec, "y = sum of x_i * w[i] over |x_i| > threshold", unlocked(),
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale"),
        pybind11::arg("threshold"), pybind11::arg("begin") = 0, pybind11::arg("end") = -1);
}
