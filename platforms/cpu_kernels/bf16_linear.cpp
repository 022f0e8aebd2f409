// bfloat16 linear layers with AVX512-BF16 dot products (`chassis_cpu::linear`).
//
// Why: oneDNN's packed bf16 linear reaches 20 GFLOP/s at 1 row and ~310 at 32 rows on the
// 2-core development machine, while this kernel reaches ~30 and ~350 (and matches oneDNN,
// ~425, from 512 rows; `chassis bench kernels`), so decode steps, which multiply a few rows by
// every weight, get faster.
//
// Layout: `pack_linear` turns a [N, K] weight into panels of 64 output columns,
// [N / 64][K / 2][64][2]: for each pair of input features, the 64 columns' two weights sit
// side by side, which is what `vdpbf16ps` multiplies with a broadcast pair of inputs. The
// micro-kernel keeps a 6 x 64 block of float32 sums in 24 registers while it walks K; each
// thread takes a contiguous range of (panel, row tile) items, so each weight is read from
// memory about once per call (a panel split between two threads is read by both).
// Results: float32 sums (+ bias) rounded once to bfloat16, like oneDNN's; the order in which
// products are summed differs, so rare outputs differ from F.linear's by one rounding step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 64;  // output columns per panel (4 x 16 float32 lanes)
constexpr int kRows = 6;        // rows per micro-kernel call

bool available() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(available(), "chassis_cpu::pack_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be a 2-D bfloat16 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPanel == 0 && k % 2 == 0, "out_features must be a multiple of 64 and ",
              "in_features even; got ", n, " x ", k);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n / kPanel, k / 2, kPanel, 2}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t k2 = 0; k2 < k / 2; ++k2)
        for (int64_t c = 0; c < kPanel; ++c) {
          const uint16_t* row = src + (p * kPanel + c) * k + 2 * k2;
          uint16_t* out = dst + ((p * (k / 2) + k2) * kPanel + c) * 2;
          out[0] = row[0];
          out[1] = row[1];
        }
  });
  return packed;
}

#ifdef __AVX512BF16__
// float32 -> bfloat16, round to nearest even (NaN stays NaN), as c10's conversion does.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// out[r, 0:64] = x[r, :] . panel, for R rows starting at x (row stride k).
template <int R>
inline void micro_kernel(const uint16_t* x, int64_t k, const uint16_t* panel, const float* bias,
                         uint16_t* out, int64_t out_stride) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      acc[r][j] = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + 16 * j);
  for (int64_t k2 = 0; k2 < k / 2; ++k2) {
    const uint16_t* w = panel + k2 * 2 * kPanel;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * k2, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + 16 * j),
                          to_bf16(acc[r][j]));
}

void rows_tail(int64_t rows, const uint16_t* x, int64_t k, const uint16_t* panel,
               const float* bias, uint16_t* out, int64_t n) {
  switch (rows) {
    case 5: micro_kernel<5>(x, k, panel, bias, out, n); break;
    case 4: micro_kernel<4>(x, k, panel, bias, out, n); break;
    case 3: micro_kernel<3>(x, k, panel, bias, out, n); break;
    case 2: micro_kernel<2>(x, k, panel, bias, out, n); break;
    case 1: micro_kernel<1>(x, k, panel, bias, out, n); break;
    default: break;
  }
}
#endif

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "chassis_cpu::linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "packed must come from chassis_cpu::pack_linear");
  const int64_t k = packed.size(1) * 2, n = packed.size(0) * kPanel;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == k,
              "x must be bfloat16 [..., ", k, "]");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias must have ", n, " values");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options());
#ifdef __AVX512BF16__
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* bp = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  // Work items are (panel, row tile) pairs in panel-major order, split into one contiguous
  // range per thread: a thread reads each of its panels from memory once and reuses it from
  // cache for that panel's row tiles, and with several row tiles threads get near-equal
  // shares even when the panels do not divide evenly among them (a 576-wide layer has 9;
  // with one row tile, up to 6 rows, they still split 5:4).
  const int64_t tiles = (m + kRows - 1) / kRows;
  at::parallel_for(0, (n / kPanel) * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / tiles, r = (item % tiles) * kRows;
      const uint16_t* panel = wp + p * (k / 2) * 2 * kPanel;
      const float* pb = bp == nullptr ? nullptr : bp + p * kPanel;
      if (r + kRows <= m)
        micro_kernel<kRows>(xp + r * k, k, panel, pb, op + r * n + p * kPanel, n);
      else
        rows_tail(m - r, xp + r * k, k, panel, pb, op + r * n + p * kPanel, n);
    }
  });
#endif
  return out.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chassis_cpu, m) {
  m.def("bf16_linear_available() -> bool", &available);
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(chassis_cpu, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}
