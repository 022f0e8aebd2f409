// Fused CPU kernels for the decoder layer, registered as torch ops under `chassis_cpu::`.
//
// Each layer op computes what its torch reference in chassis computes, in the same rounding
// order (HF transformers' order): intermediate values are rounded to the tensor dtype exactly
// where the reference rounds them, and accumulated in float32 (sums in another order than
// torch's, so rare 16-bit results differ by one rounding step; see core/layers/kernels.py).
// The attention ops match their reference within the dtype's tolerance: for bfloat16 they
// round the softmax weights to bfloat16 before p.v, as GPU flash attention does. They exist because, on a CPU, a
// decoder layer written as torch ops spends much of its time in small memory-bound ops and
// in per-op dispatch; one pass per fused op is cheaper. Compiled at first use by
// chassis/platforms/cpu_kernels/build.py.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// float32, bfloat16 and float16 (the dtypes chassis runs models in)
#define CHASSIS_DISPATCH(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                           \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Dot product with 16 independent accumulators (vectorizable without -ffast-math).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float total = 0;
  for (; i < n; ++i) total += a[i] * b[i];
  for (int j = 0; j < 16; ++j) total += acc[j];
  return total;
}

// ---- 16-lane float helpers: AVX-512 when the compiler targets it, else plain loops -------
#ifdef __AVX512F__
#include <immintrin.h>
constexpr bool kSimd = true;
using vf = __m512;
inline vf load16(const float* p) { return _mm512_loadu_ps(p); }
inline vf load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vf load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// exp(x) for x <= 0 (softmax weights): 2^n * poly(r), ~2 ulp; exp(-inf) = 0.
inline vf exp_nonpositive(vf x) {
  const vf lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  vf y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return _mm512_mask_blend_ps(tiny, y, _mm512_setzero_ps());
}
// cap * tanh(s / cap) for 16 lanes: tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in
// (0, 1], so it saturates to 1 without overflow; the sign of x is put back afterwards.
inline vf soft_cap16(vf s, float cap) {
  const vf x = _mm512_div_ps(s, _mm512_set1_ps(cap));
  const vf one = _mm512_set1_ps(1.0f);
  const vf e = exp_nonpositive(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.0f)));
  const vf t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)),
                       _mm512_set1_ps(cap));
}
// Round 16 floats to T (nearest-even, as c10's conversions do) and store them / return them
// as floats. bfloat16 rounding is done on the integer bits so denormals match c10 exactly.
inline __m512i bf16_round_bits(vf v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
inline void store16(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16)));
}
inline void store16(c10::Half* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline vf round16(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(bf16_round_bits(v));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// silu(x) = x / (1 + exp(-x)) in float32 for 16 lanes (exp by exp_nonpositive on -|x|).
inline vf silu16(vf x) {
  const vf one = _mm512_set1_ps(1.0f);
  const vf neg_abs = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x));
  const vf e = exp_nonpositive(neg_abs);  // exp(-|x|) in (0, 1]
  // x >= 0: x / (1 + e); x < 0: x / (1 + 1/e) = x * e / (1 + e). One division either way.
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const vf numerator = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(numerator, _mm512_add_ps(one, e));
}

// Lane i of the result = sum of the 16 lanes of v[i] (a transpose-and-add tree: 4 stages of
// shuffles instead of 16 separate horizontal reductions).
inline vf hsum16(const vf* v) {
  vf c[4];
  for (int k = 0; k < 4; ++k) {
    const vf s = _mm512_add_ps(_mm512_unpacklo_ps(v[4 * k], v[4 * k + 1]),
                               _mm512_unpackhi_ps(v[4 * k], v[4 * k + 1]));
    const vf t = _mm512_add_ps(_mm512_unpacklo_ps(v[4 * k + 2], v[4 * k + 3]),
                               _mm512_unpackhi_ps(v[4 * k + 2], v[4 * k + 3]));
    c[k] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s), _mm512_castps_pd(t))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s), _mm512_castps_pd(t))));
  }
  const vf e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44),
                               _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const vf e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44),
                               _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88),
                       _mm512_shuffle_f32x4(e01, e23, 0xDD));
}
#else
constexpr bool kSimd = false;
#endif

// Rows per parallel task for elementwise row ops touching `row_elements` values per row: a
// task of less than ~64K values costs less than waking another thread for it (decode steps'
// few rows run on the calling thread).
inline int64_t rows_per_task(int64_t row_elements) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2, name, " must be 2-D [rows, hidden]");
  TORCH_CHECK(x.stride(1) == 1, name, " must have contiguous rows");
}

// A paged cache [num_blocks, 2, block_size, kv_heads, head_dim] whose positions are dense
// rows of [kv_heads, head_dim]. Blocks and the V plane are reached by stride(0) and stride(1)
// only, never an assumed offset: a contiguous cache, or one whose V plane aliases its K plane
// (stride(1) == 0, a model whose values are its keys), or any other such view.
void check_kv_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4),
              "kv_cache must be [num_blocks, 2, block_size, kv_heads, head_dim] with each "
              "position's [kv_heads, head_dim] dense");
}

// RMSNorm of each row of `x` (after adding `residual` when given; the rounded sum is written
// to `sum_out`): out = round(w * round(s * rsqrt(mean(s^2) + eps))), statistics in float32.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, at::Tensor& out, at::Tensor* sum_out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* w = weight.data_ptr<T>();
  const T* xs = x.data_ptr<T>();
  const T* rs = residual == nullptr ? nullptr : residual->data_ptr<T>();
  T* sums = sum_out == nullptr ? nullptr : sum_out->data_ptr<T>();
  T* outs = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), r_stride = rs == nullptr ? 0 : residual->stride(0),
                s_stride = sums == nullptr ? 0 : sum_out->stride(0), o_stride = out.stride(0);
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xs + r * x_stride;
      const T* rr = rs == nullptr ? nullptr : rs + r * r_stride;
      T* so = sums == nullptr ? nullptr : sums + r * s_stride;
      T* o = outs + r * o_stride;
      // pass 1: the (rounded) sum, stored, and its squares summed; pass 2 reads the row back
      // (from `so` when there is a residual), normalizes and scales it
      const T* src = rr == nullptr ? xr : so;
      float squares = 0;
      int64_t i = 0;
#ifdef __AVX512F__
      vf acc = _mm512_setzero_ps();
      for (; i + 16 <= n; i += 16) {
        vf v = load16(xr + i);
        if (rr != nullptr) {
          v = round16<T>(_mm512_add_ps(v, load16(rr + i)));
          store16(so + i, v);
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      squares = _mm512_reduce_add_ps(acc);
#endif
      for (int64_t j = i; j < n; ++j) {
        float v = static_cast<float>(xr[j]);
        if (rr != nullptr) {
          so[j] = static_cast<T>(v + static_cast<float>(rr[j]));
          v = static_cast<float>(so[j]);
        }
        squares += v * v;
      }
      const float inv =
          1.0f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
      i = 0;
#ifdef __AVX512F__
      const vf vinv = _mm512_set1_ps(inv);
      for (; i + 16 <= n; i += 16) {
        const vf normed = round16<T>(_mm512_mul_ps(load16(src + i), vinv));
        store16(o + i, _mm512_mul_ps(load16(w + i), normed));
      }
#endif
      for (; i < n; ++i)
        o[i] = static_cast<T>(static_cast<float>(w[i]) *
                              round_to<T>(static_cast<float>(src[i]) * inv));
    }
  });
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [hidden] in x's dtype");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor sum;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    sum = at::empty_like(x, at::MemoryFormat::Contiguous);
  }
  CHASSIS_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, residual.has_value() ? &*residual : nullptr, weight, eps, out,
                            residual.has_value() ? &sum : nullptr);
  });
  if (residual.has_value()) return {out, sum};
  return {out};
}

// [T, 2d] -> [T, d]: round(round(silu(gate)) * up), silu computed in float32.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "last dim must be even");
  at::Tensor out = at::empty({rows, d}, x.options());
  CHASSIS_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    at::parallel_for(0, rows, rows_per_task(3 * d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = x.data_ptr<T>() + r * x.stride(0);
        const T* u = g + d;
        T* o = out.data_ptr<T>() + r * d;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= d; i += 16)
          store16(o + i, _mm512_mul_ps(round16<T>(silu16(load16(g + i))), load16(u + i)));
#endif
        for (; i < d; ++i) {
          const float gv = static_cast<float>(g[i]);
          const float a = round_to<T>(gv / (1.0f + std::exp(-gv)));
          o[i] = static_cast<T>(a * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

// Rotate-half RoPE in place on `x` [T, H, D] (rows may be strided; each head contiguous), in
// the tensor dtype as HF does: c = round(cos), s = round(sin),
// x1' = round(round(x1 * c) - round(x2 * s)), x2' = round(round(x2 * c) + round(x1 * s)).
template <typename T>
void rotate_half(at::Tensor& x, const int64_t* pos, const float* cos_cache,
                 const float* sin_cache, int64_t half) {
  const int64_t tokens = x.size(0), heads = x.size(1);
  at::parallel_for(0, tokens, rows_per_task(2 * heads * half), [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half);
    for (int64_t t = begin; t < end; ++t) {
      const float* cr = cos_cache + pos[t] * half;
      const float* sr = sin_cache + pos[t] * half;
      for (int64_t i = 0; i < half; ++i) {
        c[i] = round_to<T>(cr[i]);
        s[i] = round_to<T>(sr[i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x.data_ptr<T>() + t * x.stride(0) + h * x.stride(1);
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= half; i += 16) {
          const vf x1 = load16(v + i), x2 = load16(v + i + half);
          const vf cv = _mm512_loadu_ps(c.data() + i), sv = _mm512_loadu_ps(s.data() + i);
          const vf r1 = round16<T>(_mm512_sub_ps(round16<T>(_mm512_mul_ps(x1, cv)),
                                                 round16<T>(_mm512_mul_ps(x2, sv))));
          const vf r2 = round16<T>(_mm512_add_ps(round16<T>(_mm512_mul_ps(x2, cv)),
                                                 round16<T>(_mm512_mul_ps(x1, sv))));
          store16(v + i, r1);
          store16(v + i + half, r2);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
          v[i] = static_cast<T>(round_to<T>(x1 * c[i]) - round_to<T>(x2 * s[i]));
          v[i + half] = static_cast<T>(round_to<T>(x2 * c[i]) + round_to<T>(x1 * s[i]));
        }
      }
    }
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key,
                      const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be contiguous int64");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && cos_cache.is_contiguous() &&
                  sin_cache.is_contiguous() && sin_cache.sizes() == cos_cache.sizes(),
              "cos/sin caches must be contiguous float32 [max_position, head_dim / 2]");
  const int64_t half = cos_cache.size(1);
  for (const at::Tensor* x : {&query, &key}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->size(2) == 2 * half &&
                    x->size(0) == positions.size(0),
                "query/key must be [tokens, heads, head_dim] with contiguous heads");
  }
  const int64_t max_pos = cos_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range of the rotary cache");
  CHASSIS_DISPATCH(query.scalar_type(), "rotary", [&] {
    rotate_half<scalar_t>(query, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(),
                          half);
    rotate_half<scalar_t>(key, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(),
                          half);
  });
}

// Single-token (decode) attention over a paged cache [num_blocks, 2, block_size, KV, D].
// query [B, H, D] (H = KV * group); request b attends to its first seq_lens[b] positions
// (with a sliding window, only the last `window` of them: the loop starts there), found
// through block_table[b]. Float32 scores (soft-capped when `cap` is set), softmax and
// accumulator (online softmax, 16 positions at a time); the output is rounded to the query
// dtype once. A bfloat16 cache on a CPU with AVX512-BF16 multiplies in bfloat16 with float32
// sums (`decode_item_bf16`).

// f(std::integral_constant<int, dim / Lanes>{}) for a head dim of 32, 64, 128 or 256: the
// vectorized attention kernels are specialised on how many Lanes-wide registers a head spans.
template <int Lanes, typename F>
void dispatch_head_dim(int64_t dim, F&& f) {
  switch (dim) {
    case 32: f(std::integral_constant<int, 32 / Lanes>{}); break;
    case 64: f(std::integral_constant<int, 64 / Lanes>{}); break;
    case 128: f(std::integral_constant<int, 128 / Lanes>{}); break;
    default: f(std::integral_constant<int, 256 / Lanes>{}); break;  // 256
  }
}

// Geometry of one decode_attention call, shared by the SIMD and the scalar paths.
// `window` > 0: a query at position p sees only positions p - window + 1 .. p (a sliding
// window); `cap` > 0: scaled scores s become cap * tanh(s / cap) (logit soft-capping). Both 0
// (the defaults): plain causal attention, the same instructions as without the options.
// `sinks` (float32 [query heads], or null: off): attention sinks (gpt-oss), one logit per
// query head that joins its softmax denominator and has no value. Each row's online softmax
// starts from it, as if it were a position already seen: running max = the sink logit,
// denominator = 1, accumulator = 0.
struct DecodeShape {
  int64_t batch, kv_heads, group, dim, block_size;
  int64_t blk_stride, kv_stride, pos_stride, table_stride, q_b, q_h, o_b, o_h;
  float scale;
  int64_t window = 0;
  float cap = 0.0f;
  const float* sinks = nullptr;
};

// The online softmax's starting running max and denominator of query head `head`.
inline float start_max(const DecodeShape& sh, int64_t head) {
  return sh.sinks != nullptr ? sh.sinks[head] : -std::numeric_limits<float>::infinity();
}
inline float start_sum(const DecodeShape& sh) { return sh.sinks != nullptr ? 1.0f : 0.0f; }

// First position a row with context length `len` (its own position len - 1) attends to.
inline int64_t window_start(const DecodeShape& sh, int64_t len) {
  return sh.window > 0 ? std::max<int64_t>(0, len - sh.window) : 0;
}

// What a work item costs, roughly: the positions it reads.
inline int64_t attended(const DecodeShape& sh, int64_t len) {
  return sh.window > 0 ? std::min(len, sh.window) : len;
}

inline float soft_cap1(float s, float cap) { return cap * std::tanh(s / cap); }

#ifdef __AVX512F__
// rows[p] = the cache row (K of kv head 0) of position start + p, p < n: one division per
// chunk rather than one per position (an integer division costs tens of cycles, as much as
// a position's arithmetic).
template <typename T>
inline void chunk_rows(const DecodeShape& sh, const T* cache, const int32_t* table,
                       int64_t start, int64_t n, const T** rows) {
  int64_t block = start / sh.block_size, offset = start % sh.block_size;
  for (int64_t p = 0; p < n; ++p) {
    rows[p] = cache + static_cast<int64_t>(table[block]) * sh.blk_stride + offset * sh.pos_stride;
    if (++offset == sh.block_size) {
      offset = 0;
      ++block;
    }
  }
}

// Request K and V of one kv head (`row` points at its K) into L2. The cache is read once per
// step, from memory: each position of a chunk requests the same head of the next chunk's
// position, so loads run a chunk ahead of the arithmetic. Spread out like this rather than
// in one burst per chunk (which overflows the core's outstanding-miss slots), and into L2
// rather than L1, it took the attention of an engine step at batch 32 (SmolLM2, ~210
// positions) from 436 to 223 us per layer (docs/performance.md).
template <typename T>
inline void prefetch_head(const T* row, int64_t kv_stride, int64_t dim) {
  const char* k = reinterpret_cast<const char*>(row);
  const char* v = reinterpret_cast<const char*>(row + kv_stride);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) {
    _mm_prefetch(k + off, _MM_HINT_T1);
    _mm_prefetch(v + off, _MM_HINT_T1);
  }
}

// The rows of the chunk after the one at `start` (see prefetch_head); returns their count.
template <typename T>
inline int64_t next_chunk_rows(const DecodeShape& sh, const T* cache, const int32_t* table,
                               int64_t start, int64_t len, const T** next) {
  const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, len - start - 16));
  if (n > 0) chunk_rows(sh, cache, table, start + 16, n, next);
  return n;
}

// One request, kv heads [h0, h1): 16 positions at a time; each K/V row read serves all
// `group` query rows of its kv head. Covering all kv heads of a request in one item reads its
// cache blocks front to back (whole cache lines, a stream the hardware prefetcher follows).
// Requires dim % 16 == 0, dim <= 256 and group <= 16. `q_in`/`out` point at the request's
// first query row, `cache` at the layer's cache.
template <typename T, int C>
void decode_item_simd(const DecodeShape& sh, const T* q_in, const T* cache, const int32_t* table,
                      int64_t len, T* out, int64_t h0, int64_t h1, float* q, float* acc,
                      float* m, float* l) {
  // C = dim / 16 is a compile-time constant so the per-row vectors live in registers.
  const int64_t G = sh.group, D = 16 * C;
  for (int64_t row = h0 * G; row < h1 * G; ++row) {
    const T* qr = q_in + row * sh.q_h;
    for (int64_t d = 0; d < D; ++d) q[row * D + d] = static_cast<float>(qr[d]) * sh.scale;
    m[row] = start_max(sh, row);
    l[row] = start_sum(sh);
  }
  std::fill(acc + h0 * G * D, acc + h1 * G * D, 0.0f);
  vf part[16][16];  // [group][position]
  float weights[16][16], corrections[16];
  for (int64_t start = window_start(sh, len); start < len; start += 16) {
    const int64_t n = std::min<int64_t>(16, len - start);
    const __mmask16 lanes = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const T* rows[16];
    chunk_rows(sh, cache, table, start, n, rows);
    const T* next[16];
    const int64_t next_n = next_chunk_rows(sh, cache, table, start, len, next);
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = q + h * G * D;
      float* ah = acc + h * G * D;
      // scores: part[g][p] = q_g * k_p summed over dim chunks (16 lanes, unreduced), then
      // one transpose-and-add tree per group row
      for (int64_t p = 0; p < n; ++p) {
        if (p < next_n) prefetch_head(next[p] + h * D, sh.kv_stride, D);
        vf k[C];
        for (int c = 0; c < C; ++c) k[c] = load16(rows[p] + h * D + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          vf sum = _mm512_mul_ps(_mm512_loadu_ps(qh + g * D), k[0]);
          for (int c = 1; c < C; ++c)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(qh + g * D + c * 16), k[c], sum);
          part[g][p] = sum;
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t p = n; p < 16; ++p) part[g][p] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = h * G + g;
        vf sc = hsum16(part[g]);
        if (sh.cap > 0) sc = soft_cap16(sc, sh.cap);
        const float new_max = std::max(m[r], _mm512_mask_reduce_max_ps(lanes, sc));
        const vf e = _mm512_maskz_mov_ps(
            lanes, exp_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(new_max))));
        const float correction = std::exp(m[r] - new_max);  // 0 on the first chunk
        l[r] = l[r] * correction + _mm512_reduce_add_ps(e);
        m[r] = new_max;
        _mm512_storeu_ps(weights[g], e);
        corrections[g] = correction;
      }
      // acc_g = acc_g * correction_g + sum_p w_gp * v_p, the C chunks of acc_g in registers
      for (int64_t g = 0; g < G; ++g) {
        float* ag = ah + g * D;
        const vf cv = _mm512_set1_ps(corrections[g]);
        vf a[C];
        for (int c = 0; c < C; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(ag + c * 16), cv);
        for (int64_t p = 0; p < n; ++p) {
          const T* v = rows[p] + sh.kv_stride + h * D;
          const vf w = _mm512_set1_ps(weights[g][p]);
          for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(w, load16(v + c * 16), a[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(ag + c * 16, a[c]);
      }
    }
  }
  for (int64_t row = h0 * G; row < h1 * G; ++row) {
    const float inv = l[row] > 0 ? 1.0f / l[row] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[row * sh.o_h + d] = static_cast<T>(acc[row * D + d] * inv);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// V rows of positions 2j and 2j+1 (kv head at element `head_offset` of each row) side by side
// for j < npairs: 16-bit lane 2i of pairs[j][..] holds row 2j, lane 2i+1 row 2j+1, which is
// the operand order of a bf16 dot product with a (w_2j, w_2j+1) pair of softmax weights.
// Register 2c of a pair covers the low half of 32-element chunk c, 2c+1 the high half.
template <int C2>
inline void interleave_v_pairs(const c10::BFloat16* const* rows, int64_t npairs,
                               int64_t kv_stride, int64_t head_offset, __m512i (*pairs)[2 * C2]) {
  for (int64_t j = 0; j < npairs; ++j) {
    const c10::BFloat16* v0 = rows[2 * j] + kv_stride + head_offset;
    const c10::BFloat16* v1 = rows[2 * j + 1] + kv_stride + head_offset;
    for (int c = 0; c < C2; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + c * 32);
      const __m512i b = _mm512_loadu_si512(v1 + c * 32);
      pairs[j][2 * c] = _mm512_unpacklo_epi16(a, b);
      pairs[j][2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
}

// out[d] = round(acc * inv) in dimension order, from sums kept in the lane order that
// products with `interleave_v_pairs` registers produce: lane i of the low (high) register of
// 32-element chunk c holds element 8 * (i / 4) + i % 4 (+ 4) of that chunk.
template <int C2>
inline void store_interleaved_row(const float* acc, float inv, c10::BFloat16* out) {
  for (int c = 0; c < C2; ++c)
    for (int half = 0; half < 2; ++half)
      for (int i = 0; i < 16; ++i)
        out[c * 32 + 8 * (i / 4) + 4 * half + i % 4] =
            static_cast<c10::BFloat16>(acc[(2 * c + half) * 16 + i] * inv);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bfloat16 cache on CPUs with AVX512-BF16: both products as bf16 dot products
// (`vdpbf16ps`, float32 sums), which takes less than half the instructions of converting
// every K and V element to float32 first. q.k multiplies the query as stored (the scale is
// applied to the float32 score); p.v multiplies softmax weights rounded to bfloat16 (as GPU
// flash attention does), whose rounded values also form the denominator, so every output
// is a convex combination of V rows. Same work split and prefetch as `decode_item_simd`.
// `acc` holds each query row's sums in the lane order the interleaving below produces;
// the end of the item puts them back in dimension order.
template <int C2>  // C2 = dim / 32: 32 bf16 per 512-bit register
void decode_item_bf16(const DecodeShape& sh, const c10::BFloat16* q_in,
                      const c10::BFloat16* cache, const int32_t* table, int64_t len,
                      c10::BFloat16* out, int64_t h0, int64_t h1, float* acc, float* m,
                      float* l) {
  constexpr int D = 32 * C2;
  const int64_t G = sh.group;
  for (int64_t row = h0 * G; row < h1 * G; ++row) {
    m[row] = start_max(sh, row);
    l[row] = start_sum(sh);
  }
  std::fill(acc + h0 * G * D, acc + h1 * G * D, 0.0f);
  const vf scale = _mm512_set1_ps(sh.scale);
  vf part[16][16];                          // [group][position]
  alignas(64) uint32_t weights[16][8];      // [group][position pair]: two bf16 weights each
  alignas(64) __m512i pairs[8][2 * C2];     // V rows 2j and 2j+1 interleaved per element
  float corrections[16];
  for (int64_t start = window_start(sh, len); start < len; start += 16) {
    const int64_t n = std::min<int64_t>(16, len - start);
    const __mmask16 lanes = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const c10::BFloat16* rows[16];
    chunk_rows(sh, cache, table, start, n, rows);
    // past the end: any valid row; its weight is zero
    for (int64_t p = n; p < 16; ++p) rows[p] = rows[0];
    const int64_t npairs = (n + 1) / 2;
    const c10::BFloat16* next[16];
    const int64_t next_n = next_chunk_rows(sh, cache, table, start, len, next);
    for (int64_t h = h0; h < h1; ++h) {
      const c10::BFloat16* qh = q_in + h * G * sh.q_h;
      for (int64_t p = 0; p < n; ++p) {
        if (p < next_n) prefetch_head(next[p] + h * D, sh.kv_stride, D);
        __m512bh k[C2];
        for (int c = 0; c < C2; ++c)
          k[c] = (__m512bh)_mm512_loadu_si512(rows[p] + h * D + c * 32);
        for (int64_t g = 0; g < G; ++g) {
          vf sum = _mm512_setzero_ps();
          for (int c = 0; c < C2; ++c)
            sum = _mm512_dpbf16_ps(
                sum, (__m512bh)_mm512_loadu_si512(qh + g * sh.q_h + c * 32), k[c]);
          part[g][p] = sum;
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t p = n; p < 16; ++p) part[g][p] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = h * G + g;
        vf sc = _mm512_mul_ps(hsum16(part[g]), scale);
        if (sh.cap > 0) sc = soft_cap16(sc, sh.cap);
        const float new_max = std::max(m[r], _mm512_mask_reduce_max_ps(lanes, sc));
        const vf e = _mm512_maskz_mov_ps(
            lanes, exp_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(new_max))));
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(weights[g]), rounded);
        const vf used =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
        const float correction = std::exp(m[r] - new_max);  // 0 on the first chunk
        l[r] = l[r] * correction + _mm512_reduce_add_ps(used);
        m[r] = new_max;
        corrections[g] = correction;
      }
      interleave_v_pairs<C2>(rows, npairs, sh.kv_stride, h * D, pairs);
      for (int64_t g = 0; g < G; ++g) {
        float* ag = acc + (h * G + g) * D;
        const vf cv = _mm512_set1_ps(corrections[g]);
        vf a[2 * C2];
        for (int c = 0; c < 2 * C2; ++c)
          a[c] = _mm512_mul_ps(_mm512_loadu_ps(ag + c * 16), cv);
        for (int64_t j = 0; j < npairs; ++j) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[g][j]));
          for (int c = 0; c < 2 * C2; ++c)
            a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)pairs[j][c], w);
        }
        for (int c = 0; c < 2 * C2; ++c) _mm512_storeu_ps(ag + c * 16, a[c]);
      }
    }
  }
  for (int64_t row = h0 * G; row < h1 * G; ++row)
    store_interleaved_row<C2>(acc + row * D, l[row] > 0 ? 1.0f / l[row] : 0.0f,
                              out + row * sh.o_h);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kPrefillTiles = true;

// Causal attention of up to 16 consecutive query rows of one prefill chunk over one kv head
// (bfloat16 cache, AVX512-BF16): the rows share every K/V load. Scores are computed
// transposed, a position at a time with the 16 rows in the vector lanes (the query is
// repacked once per tile as pairs of dims), so the online softmax runs lane-wise: no
// horizontal sums or maxima, and one exp per (position, row) as before. Numerics as in
// `decode_item_bf16` (bf16 products with float32 sums, softmax weights rounded to bf16 for
// p.v and in the denominator). `rows_in_tile` rows start at query token `tok0`, at positions
// first_pos, first_pos + 1, ...; `work` and `qt_buf` are the calling thread's scratch.
template <int C2>
void prefill_tile_bf16(const DecodeShape& sh, const c10::BFloat16* query, int64_t tok0,
                       int64_t rows_in_tile, int64_t first_pos, const c10::BFloat16* cache,
                       const int32_t* table, int64_t h, c10::BFloat16* out,
                       std::vector<float>& work, std::vector<uint32_t>& qt_buf) {
  constexpr int D = 32 * C2;
  const int64_t G = sh.group, R = rows_in_tile;
  const int64_t last = first_pos + R - 1;  // the last row's position: the context's end
  // qt[g][d2] lane r = dims (2 d2, 2 d2 + 1) of row r, group g (zero past the tile)
  qt_buf.assign(static_cast<size_t>(G) * (D / 2) * 16, 0u);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      uint32_t words[D / 2];  // memcpy: the row may start at any element
      std::memcpy(words, query + (tok0 + r) * sh.q_b + (h * G + g) * sh.q_h, sizeof(words));
      for (int64_t d2 = 0; d2 < D / 2; ++d2) qt_buf[(g * (D / 2) + d2) * 16 + r] = words[d2];
    }
  const __m512i* qt = reinterpret_cast<const __m512i*>(qt_buf.data());
  work.assign(static_cast<size_t>(G) * (3 * 16 + R * D), 0.0f);
  float* m = work.data();          // [G][16] running maxima
  float* l = m + G * 16;           // [G][16] running denominators
  float* corr = l + G * 16;        // [G][16] this chunk's rescale factors
  float* acc = corr + G * 16;      // [G][R][D] in the interleaved lane order
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < 16; ++r) {
      m[g * 16 + r] = start_max(sh, h * G + g);
      l[g * 16 + r] = start_sum(sh);
    }
  const vf scale = _mm512_set1_ps(sh.scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  vf scores[16][16];                      // [group][position], lanes = rows
  __m256i rounded[16];                    // [position]: bf16 weights, lanes = rows
  // [position pair j][slot]: the bf16 weights of positions 2j, 2j+1 for one row, side by
  // side (a dot-product operand); row r sits in slot `slot_of[r]` (the unpack order)
  alignas(64) uint32_t weight_pairs[8][16];
  static constexpr int slot_of[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  alignas(64) __m512i pairs[8][2 * C2];   // V rows 2j, 2j+1 interleaved per element
  // with a window, the tile's first row sees nothing before first_pos - window + 1
  const int64_t lo = sh.window > 0 ? std::max<int64_t>(0, first_pos - sh.window + 1) : 0;
  for (int64_t start = lo; start <= last; start += 16) {
    const int64_t n = std::min<int64_t>(16, last + 1 - start);
    const c10::BFloat16* rows[16];
    chunk_rows(sh, cache, table, start, n, rows);
    for (int64_t p = n; p < 16; ++p) rows[p] = rows[0];
    // q.k, four positions at a time with the dims split in two halves: eight independent
    // dot-product chains (vdpbf16ps has a latency of several cycles; fewer chains stall)
    for (int64_t g = 0; g < G; ++g) {
      const __m512i* qg = qt + g * (D / 2);
      for (int64_t p = 0; p < n; p += 4) {
        const uint32_t* k[4];
        for (int i = 0; i < 4; ++i) k[i] = reinterpret_cast<const uint32_t*>(rows[p + i] + h * D);
        vf even[4], odd[4];
        for (int i = 0; i < 4; ++i) even[i] = odd[i] = _mm512_setzero_ps();
        for (int d2 = 0; d2 < D / 2; d2 += 2) {
          const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qg + d2);
          const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qg + d2 + 1);
          for (int i = 0; i < 4; ++i) {
            even[i] = _mm512_dpbf16_ps(
                even[i], q0, (__m512bh)_mm512_set1_epi32(static_cast<int>(k[i][d2])));
            odd[i] = _mm512_dpbf16_ps(
                odd[i], q1, (__m512bh)_mm512_set1_epi32(static_cast<int>(k[i][d2 + 1])));
          }
        }
        for (int i = 0; i < 4; ++i)
          scores[g][p + i] = _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), scale);
        if (sh.cap > 0)
          for (int i = 0; i < 4; ++i) scores[g][p + i] = soft_cap16(scores[g][p + i], sh.cap);
      }
      for (int64_t p = (n + 3) / 4 * 4; p < 16; ++p) scores[g][p] = _mm512_setzero_ps();
    }
    // row r sees position start + p iff start + p <= first_pos + r (and, with a window,
    // start + p > first_pos + r - window)
    __mmask16 visible[16];
    for (int64_t p = 0; p < 16; ++p)
      visible[p] = p < n ? _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(
                                                             static_cast<int>(start + p - first_pos)))
                         : static_cast<__mmask16>(0);
    if (sh.window > 0)
      for (int64_t p = 0; p < n; ++p)
        visible[p] &= _mm512_cmplt_epi32_mask(
            lane, _mm512_set1_epi32(static_cast<int>(start + p - first_pos + sh.window)));
    // V rows side by side in pairs, shared by every row and group of the tile
    const int64_t npairs = (n + 1) / 2;
    interleave_v_pairs<C2>(rows, npairs, sh.kv_stride, h * D, pairs);
    const vf minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t g = 0; g < G; ++g) {
      vf top = minus_inf;
      for (int64_t p = 0; p < n; ++p)
        top = _mm512_max_ps(top, _mm512_mask_mov_ps(minus_inf, visible[p], scores[g][p]));
      const vf old_max = _mm512_loadu_ps(m + g * 16);
      const vf new_max = _mm512_max_ps(old_max, top);
      // With a window, a row may see nothing in this chunk nor before it (its window starts
      // later than the tile's first row's): its max stays -inf, and 0 stands in for it here
      // so that its correction is exp(-inf) = 0 rather than exp(NaN).
      const vf base = sh.window > 0 ? _mm512_mask_blend_ps(
                                          _mm512_cmp_ps_mask(new_max, minus_inf, _CMP_EQ_OQ),
                                          new_max, _mm512_setzero_ps())
                                    : new_max;
      const vf c = exp_nonpositive(_mm512_sub_ps(old_max, base));  // 0 on the first chunk
      vf sum = _mm512_setzero_ps();
      for (int64_t p = 0; p < 16; ++p) {
        const vf e = _mm512_maskz_mov_ps(
            visible[p], exp_nonpositive(_mm512_sub_ps(scores[g][p], base)));
        rounded[p] = (__m256i)_mm512_cvtneps_pbh(e);
        sum = _mm512_add_ps(
            sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded[p]), 16)));
      }
      for (int64_t j = 0; j < npairs; ++j) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(weight_pairs[j]),
                           _mm256_unpacklo_epi16(rounded[2 * j], rounded[2 * j + 1]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(weight_pairs[j] + 8),
                           _mm256_unpackhi_epi16(rounded[2 * j], rounded[2 * j + 1]));
      }
      _mm512_storeu_ps(l + g * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + g * 16), c, sum));
      _mm512_storeu_ps(m + g * 16, new_max);
      _mm512_storeu_ps(corr + g * 16, c);
      // p.v, two rows at a time (2 x 2 C2 independent chains)
      for (int64_t r = 0; r < R; r += 2) {
        const int64_t r1 = std::min<int64_t>(r + 1, R - 1);  // an odd last row: itself twice
        float* a0p = acc + (g * R + r) * D;
        float* a1p = acc + (g * R + r1) * D;
        const vf c0 = _mm512_set1_ps(corr[g * 16 + r]), c1 = _mm512_set1_ps(corr[g * 16 + r1]);
        vf a0[2 * C2], a1[2 * C2];
        for (int c2 = 0; c2 < 2 * C2; ++c2) {
          a0[c2] = _mm512_mul_ps(_mm512_loadu_ps(a0p + c2 * 16), c0);
          a1[c2] = _mm512_mul_ps(_mm512_loadu_ps(a1p + c2 * 16), c1);
        }
        for (int64_t j = 0; j < npairs; ++j) {
          const __m512bh w0 =
              (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[j][slot_of[r]]));
          const __m512bh w1 =
              (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[j][slot_of[r1]]));
          for (int c2 = 0; c2 < 2 * C2; ++c2) {
            a0[c2] = _mm512_dpbf16_ps(a0[c2], (__m512bh)pairs[j][c2], w0);
            a1[c2] = _mm512_dpbf16_ps(a1[c2], (__m512bh)pairs[j][c2], w1);
          }
        }
        // r1 == r: both hold the same sums; storing a1 last keeps one copy
        for (int c2 = 0; c2 < 2 * C2; ++c2) {
          _mm512_storeu_ps(a0p + c2 * 16, a0[c2]);
          _mm512_storeu_ps(a1p + c2 * 16, a1[c2]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < R; ++r) {
      const float denom = l[g * 16 + r];
      store_interleaved_row<C2>(acc + (g * R + r) * D, denom > 0 ? 1.0f / denom : 0.0f,
                                out + (tok0 + r) * sh.o_b + (h * G + g) * sh.o_h);
    }
}
#else
constexpr bool kPrefillTiles = false;
#endif

// Portable path: one position at a time.
template <typename T>
void decode_item_scalar(const DecodeShape& sh, const T* q_in, const T* cache,
                        const int32_t* table, int64_t len, T* out, int64_t head0) {
  const int64_t G = sh.group, D = sh.dim;
  std::vector<float> q(G * D), acc(G * D, 0.0f), row(D), m(G), l(G, start_sum(sh));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<float>(q_in[g * sh.q_h + d]) * sh.scale;
    m[g] = start_max(sh, head0 + g);
  }
  for (int64_t pos = window_start(sh, len); pos < len; ++pos) {
    const T* k = cache + static_cast<int64_t>(table[pos / sh.block_size]) * sh.blk_stride +
                 (pos % sh.block_size) * sh.pos_stride;
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[d]);
    std::vector<float> w(G);
    for (int64_t g = 0; g < G; ++g) {
      const float dot_s = dot(q.data() + g * D, row.data(), D);
      const float s = sh.cap > 0 ? soft_cap1(dot_s, sh.cap) : dot_s;
      const float new_max = std::max(m[g], s);
      const float correction = std::exp(m[g] - new_max);
      w[g] = std::exp(s - new_max);
      l[g] = l[g] * correction + w[g];
      m[g] = new_max;
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= correction;
    }
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[sh.kv_stride + d]);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += w[g] * row[d];
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0 ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[g * sh.o_h + d] = static_cast<T>(acc[g * D + d] * inv);
  }
}

template <typename T>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                           double scale, int64_t window, double cap, const float* sinks,
                           at::Tensor& out) {
  const DecodeShape sh{query.size(0),       kv_cache.size(3),    query.size(1) / kv_cache.size(3),
                       query.size(2),       kv_cache.size(2),    kv_cache.stride(0),
                       kv_cache.stride(1),  kv_cache.stride(2),  block_table.stride(0),
                       query.stride(0),     query.stride(1),     out.stride(0),
                       out.stride(1),       static_cast<float>(scale),
                       window,              static_cast<float>(cap),
                       sinks};
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const T* cache = kv_cache.data_ptr<T>();
  const T* qbase = query.data_ptr<T>();
  T* obase = out.data_ptr<T>();
  const bool simd = kSimd && (sh.dim == 32 || sh.dim == 64 || sh.dim == 128 || sh.dim == 256) &&
                    sh.group <= 16;
  // Whole requests per work item when there are enough of them to keep every thread busy
  // (sequential reads of each block), else (request, kv head) pairs.
  const int64_t per_item = sh.batch >= 2 * at::get_num_threads() ? sh.kv_heads : 1;
  const int64_t items = sh.batch * (sh.kv_heads / per_item);
  const int64_t heads = sh.kv_heads * sh.group;
  // Rows cost in proportion to their context length, which varies (decodes of different
  // lengths, the rows of a prefill chunk): threads take items from a shared counter, longest
  // first, so they finish together.
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return attended(sh, lens[x * per_item / sh.kv_heads]) >
           attended(sh, lens[y * per_item / sh.kv_heads]);
  });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> q(heads * sh.dim), acc(heads * sh.dim), m(heads), l(heads);
    for (int64_t taken = next.fetch_add(1); taken < items; taken = next.fetch_add(1)) {
      const int64_t item = order[taken];
      const int64_t b = item * per_item / sh.kv_heads;
      const int64_t h0 = item * per_item % sh.kv_heads, h1 = h0 + per_item;
      const T* qb = qbase + b * sh.q_b;
      T* ob = obase + b * sh.o_b;
      const int32_t* t = table + b * sh.table_stride;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (simd && sh.dim >= 32) {
          dispatch_head_dim<32>(sh.dim, [&](auto chunks) {
            decode_item_bf16<decltype(chunks)::value>(sh, qb, cache, t, lens[b], ob, h0, h1,
                                                      acc.data(), m.data(), l.data());
          });
          continue;
        }
      }
#endif
#ifdef __AVX512F__
      if (simd) {
        dispatch_head_dim<16>(sh.dim, [&](auto chunks) {
          decode_item_simd<T, decltype(chunks)::value>(sh, qb, cache, t, lens[b], ob, h0, h1,
                                                        q.data(), acc.data(), m.data(),
                                                        l.data());
        });
        continue;
      }
#endif
      for (int64_t h = h0; h < h1; ++h)
        decode_item_scalar<T>(sh, qb + h * sh.group * sh.q_h, cache + h * sh.dim, t, lens[b],
                              ob + h * sh.group * sh.o_h, h * sh.group);
    }
  });
}

// `sinks` (optional [H], any float dtype): each query head's attention-sink logit (see
// DecodeShape), as float32 for the kernels; an undefined tensor when absent.
at::Tensor float_sinks(const c10::optional<at::Tensor>& sinks, int64_t num_heads) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads &&
                  at::isFloatingType(sinks->scalar_type()) && sinks->device().is_cpu(),
              "sinks must be a float CPU tensor [num_heads] = [", num_heads, "]");
  return sinks->to(at::kFloat).contiguous();
}

// Options, 0 = off: each row sees only its last `sliding_window` positions; scaled scores s
// become soft_cap * tanh(s / soft_cap); `sinks` [H] join each head's softmax denominator.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window, double soft_cap,
                            const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0,
              "sliding_window and soft_cap must be >= 0 (0: off)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [B, H, D], D contiguous");
  check_kv_cache(kv_cache);
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "kv_cache must have query's dtype");
  TORCH_CHECK(kv_cache.size(2) > 0 && kv_cache.size(3) > 0,
              "kv_cache needs a positive block size and kv head count");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "head_dim must match and heads must be a multiple of kv_heads");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1 && block_table.size(0) >= query.size(0),
              "block_table must be int32 [>= B, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.size(0) >= query.size(0),
              "seq_lens must be contiguous int32 [>= B]");
  const int64_t block_size = kv_cache.size(2);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t num_blocks = kv_cache.size(0);
  for (int64_t b = 0; b < query.size(0); ++b) {
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(lens[b] >= 0 && used <= block_table.size(1), "seq_lens[", b,
                "] needs more blocks than block_table has");
    // the kernel reads through these ids unchecked: a bad one must fail here, not fault
    for (int64_t j = 0; j < used; ++j) {
      const int32_t id = table[b * block_table.stride(0) + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_table[", b, ", ", j, "] = ", id,
                  " is not a block of this cache (", num_blocks, " blocks)");
    }
  }
  const at::Tensor sink_values = float_sinks(sinks, query.size(1));
  const float* sink_ptr = sink_values.defined() ? sink_values.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty(query.sizes(), query.options());
  CHASSIS_DISPATCH(query.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(query, kv_cache, block_table, seq_lens, scale,
                                    sliding_window, soft_cap, sink_ptr, out);
  });
  return out;
}

// Whether `prefill_attention` runs for this dtype and shape (bfloat16 on AVX512-BF16, head
// dim 32/64/128/256, at most 16 query heads per kv head).
bool prefill_attention_supported(at::ScalarType dtype, int64_t head_dim, int64_t group) {
  return kPrefillTiles && dtype == at::kBFloat16 &&
         (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256) &&
         group >= 1 && group <= 16;
}

// Causal attention of prefill chunks over a paged cache that already holds their K/V.
// Chunk i is the query_lens[i] tokens of `query` [T, H, D] from token_starts[i]; its token j
// is at position seq_lens[i] - query_lens[i] + j and attends positions 0 .. that, read
// through block_table[i]. Writes those tokens' rows of `out` [T, H, D] (others untouched).
// Options as in decode_attention (0 / absent = off): a sliding window, a logit soft cap,
// attention sinks.
void prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens,
                       const at::Tensor& token_starts, const at::Tensor& query_lens,
                       double scale, at::Tensor out, int64_t sliding_window, double soft_cap,
                       const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0,
              "sliding_window and soft_cap must be >= 0 (0: off)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [T, H, D] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2) && out.scalar_type() == query.scalar_type(),
              "out must be like query");
  check_kv_cache(kv_cache);
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "kv_cache must have query's dtype");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "head_dim must match and heads must be a multiple of kv_heads");
  TORCH_CHECK(kv_cache.size(2) > 0 && kv_cache.size(3) > 0,
              "kv_cache needs a positive block size and kv head count");
  const int64_t group = query.size(1) / kv_cache.size(3);
  TORCH_CHECK(prefill_attention_supported(query.scalar_type(), query.size(2), group),
              "prefill_attention does not run this dtype/shape here (see "
              "prefill_attention_supported)");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "block_table must be int32 [N, max_blocks] with contiguous rows");
  const int64_t chunks = block_table.size(0);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.size(0) == chunks,
              "seq_lens must be contiguous int32 [N]");
  for (const at::Tensor* t : {&token_starts, &query_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->size(0) == chunks,
                "token_starts and query_lens must be contiguous int32 [N]");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = token_starts.data_ptr<int32_t>();
  const int32_t* ql = query_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t block_size = kv_cache.size(2), num_blocks = kv_cache.size(0);
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t q_len = ql[i];
    TORCH_CHECK(qs[i] >= 0 && q_len >= 0 && qs[i] + q_len <= query.size(0) && lens[i] >= q_len,
                "chunk ", i, ": query tokens [", qs[i], ", ", qs[i] + q_len,
                ") must lie in the query and number at most seq_lens[i] = ", lens[i]);
    const int64_t used = (lens[i] + block_size - 1) / block_size;
    TORCH_CHECK(used <= block_table.size(1), "seq_lens[", i,
                "] needs more blocks than block_table has");
    for (int64_t j = 0; j < used; ++j) {
      const int32_t id = table[i * block_table.stride(0) + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_table[", i, ", ", j, "] = ", id,
                  " is not a block of this cache (", num_blocks, " blocks)");
    }
  }
  {  // chunks write disjoint rows of `out` (threads write them concurrently)
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (int64_t i = 0; i < chunks; ++i)
      if (ql[i] > 0) spans.emplace_back(qs[i], qs[i] + ql[i]);
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      TORCH_CHECK(spans[i].first >= spans[i - 1].second, "chunks overlap: query tokens [",
                  spans[i].first, ", ", spans[i].second, ") and [", spans[i - 1].first, ", ",
                  spans[i - 1].second, ")");
  }
  const at::Tensor sink_values = float_sinks(sinks, query.size(1));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const DecodeShape sh{0,
                       kv_cache.size(3),
                       group,
                       query.size(2),
                       block_size,
                       kv_cache.stride(0),
                       kv_cache.stride(1),
                       kv_cache.stride(2),
                       block_table.stride(0),
                       query.stride(0),
                       query.stride(1),
                       out.stride(0),
                       out.stride(1),
                       static_cast<float>(scale),
                       sliding_window,
                       static_cast<float>(soft_cap),
                       sink_values.defined() ? sink_values.data_ptr<float>() : nullptr};
  // items: (chunk, tile of 16 rows, kv head); a tile's cost grows with the positions it
  // reads (up to its last row's; with a window at most the window and the tile), so threads
  // take them from a shared counter, costliest first
  struct Item {
    int64_t chunk, tile, head, cost;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t q_len = ql[i], prefix = lens[i] - q_len;
    for (int64_t t = 0; t * 16 < q_len; ++t)
      for (int64_t h = 0; h < sh.kv_heads; ++h) {
        const int64_t first = prefix + 16 * t;
        const int64_t last = prefix + std::min<int64_t>(q_len, 16 * (t + 1)) - 1;
        const int64_t lo = sh.window > 0 ? std::max<int64_t>(0, first - sh.window + 1) : 0;
        items.push_back({i, t, h, last - lo + 1});
      }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const auto* q = reinterpret_cast<const c10::BFloat16*>(query.data_ptr());
  auto* o = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  const auto* cache = reinterpret_cast<const c10::BFloat16*>(kv_cache.data_ptr());
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, total));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> work;
    std::vector<uint32_t> qt;
    for (int64_t taken = next.fetch_add(1); taken < total; taken = next.fetch_add(1)) {
      const Item& it = items[taken];
      const int64_t q_len = ql[it.chunk];
      const int64_t rows = std::min<int64_t>(16, q_len - 16 * it.tile);
      const int64_t tok0 = qs[it.chunk] + 16 * it.tile;
      const int64_t first_pos = lens[it.chunk] - q_len + 16 * it.tile;
      const int32_t* t = table + it.chunk * block_table.stride(0);
      dispatch_head_dim<32>(sh.dim, [&](auto chunks) {
        prefill_tile_bf16<decltype(chunks)::value>(sh, q, tok0, rows, first_pos, cache, t,
                                                   it.head, o, work, qt);
      });
    }
  });
#endif
}

// Store token i's K and V rows (i < slots.size(0)) into the paged cache at slot slots[i]
// (block slots[i] / block_size, offset slots[i] % block_size); a negative slot (a padding
// token) is skipped. One call per layer instead of the half-dozen tensor ops an
// `index_copy_` of K and V takes from Python.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
              const at::Tensor& slots) {
  check_kv_cache(kv_cache);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == kv_cache.size(3) &&
                  key.size(2) == kv_cache.size(4),
              "key and value must be [tokens, kv_heads, head_dim] of the cache's shape");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key and value must have the cache's dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) <= key.size(0),
              "slots must be int64 [n] with n <= tokens");
  TORCH_CHECK(kv_cache.size(2) > 0, "kv_cache needs a positive block size");
  const at::Tensor k = key.stride(2) == 1 && key.stride(1) == key.size(2) ? key : key.contiguous();
  const at::Tensor v =
      value.stride(2) == 1 && value.stride(1) == value.size(2) ? value : value.contiguous();
  const at::Tensor sl = slots.contiguous();
  const int64_t* slot = sl.data_ptr<int64_t>();
  const int64_t block_size = kv_cache.size(2), capacity = kv_cache.size(0) * block_size;
  for (int64_t i = 0; i < sl.size(0); ++i)
    TORCH_CHECK(slot[i] < capacity, "slot ", slot[i], " of token ", i, " is outside the cache (",
                capacity, " slots)");
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t esz = key.element_size();
  const int64_t blk = kv_cache.stride(0) * esz, half = kv_cache.stride(1) * esz,
                pos = kv_cache.stride(2) * esz;
  const int64_t ks = k.stride(0) * esz, vs = v.stride(0) * esz;
  at::parallel_for(0, sl.size(0), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (slot[i] < 0) continue;
      char* dst = cache + (slot[i] / block_size) * blk + (slot[i] % block_size) * pos;
      std::memcpy(dst, kp + i * ks, row_bytes);
      std::memcpy(dst + half, vp + i * vs, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(chassis_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor[]");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_cache, "
      "Tensor sin_cache) -> ()");
  m.def(
      "decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "float scale, int sliding_window=0, float soft_cap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slots) -> ()");
  m.def(
      "prefill_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor token_starts, Tensor query_lens, float scale, Tensor(a!) out, "
      "int sliding_window=0, float soft_cap=0.0, Tensor? sinks=None) -> ()");
  m.def("prefill_attention_supported(ScalarType dtype, int head_dim, int group) -> bool",
        &prefill_attention_supported);
}

TORCH_LIBRARY_IMPL(chassis_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("decode_attention", &decode_attention);
  m.impl("write_kv", &write_kv);
  m.impl("prefill_attention", &prefill_attention);
}
