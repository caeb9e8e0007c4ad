// Fused CPU kernels for the VRGD optimizer family (multi-tensor, segment-aware).
//
// Each kernel walks a list of flat tensors cut into *segments* (tensor index, start,
// length). In one process a segment is a whole parameter tensor; under ZeRO a segment is
// the piece of a parameter tensor that lies in this rank's flat partition. Per-segment
// reductions come back as float64 so the Python side can combine pieces across ranks.
//
// The element-wise maths mirrors the reference in vrgd_ds/optim/_impl.py op for op (no FMA
// contraction, see the build flags) so both paths round alike; only the order of summation
// in reductions differs. Work is split into fixed-size chunks, independent of the thread
// count, and partial sums are combined in chunk order: results do not depend on threads.
//
// Hot loops live in non-inlined worker functions that take plain values: inside capturing
// lambdas GCC keeps `omp simd` reduction lanes in memory (gathers, spills); in a function
// of its own they stay in vector registers, which keeps every pass at memory speed.
// Only the headers the kernels use: the tensor core, the dispatch macros, the four ops called
// here and torch's pybind11 casters. <torch/extension.h> (the whole C++ frontend) alone took 36 s
// to compile on 2 cores, this file with it 50 s; with these, 36 s.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kChunk = 1 << 15;

// Columns of the per-segment tables, by the names of vrgd_ds/optim/columns.py (a test reads
// these lines and compares them with the Python schemas).
namespace col {
constexpr int kInvMean = 0;
constexpr int kLo = 1;
constexpr int kBc3 = 2;
constexpr int kSgdLrMult = 3;
constexpr int kSgdFirst = 4;
constexpr int kAdamBc1 = 3;
constexpr int kAdamBc2s = 4;
constexpr int kAdamGradMult = 5;
constexpr int kLambBc1 = 3;
constexpr int kLambBc2s = 4;
constexpr int kLambTrust = 5;
constexpr int kNormsWidth = 3;
constexpr int kSgdWidth = 5;
constexpr int kAdamWidth = 6;
constexpr int kLambWidth = 6;
}  // namespace col

struct Chunk {
  int64_t seg, tensor, begin, end;
};

std::vector<Chunk> make_chunks(const at::Tensor& seg) {
  TORCH_CHECK(seg.dtype() == at::kLong && seg.dim() == 2 && seg.size(1) == 3 && seg.is_contiguous(),
              "segment table must be contiguous int64 [S, 3] (tensor, start, length)");
  auto s = seg.accessor<int64_t, 2>();
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < seg.size(0); ++i) {
    const int64_t t = s[i][0], b = s[i][1], n = s[i][2];
    for (int64_t o = 0; o < n; o += kChunk) chunks.push_back({i, t, b + o, b + std::min(n, o + kChunk)});
  }
  return chunks;
}

// Per-segment float64 parameters, [S, K] contiguous.
struct SegF {
  const double* p;
  int64_t k;
  double at(int64_t s, int64_t j) const { return p[s * k + j]; }
};

SegF seg_f(const at::Tensor& t, int64_t segs, int64_t cols) {
  TORCH_CHECK(t.dtype() == at::kDouble && t.dim() == 2 && t.is_contiguous() && t.size(0) == segs &&
                  t.size(1) == cols,
              "per-segment table must be contiguous float64 [", segs, ", ", cols, "]");
  return {t.data_ptr<double>(), t.size(1)};
}

void check_list(const std::vector<at::Tensor>& ts, size_t n, const char* what, bool fp32) {
  TORCH_CHECK(ts.size() == n, what, ": expected ", n, " tensors, got ", ts.size());
  for (const auto& t : ts) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, ": tensors must be contiguous CPU tensors");
    if (fp32) TORCH_CHECK(t.scalar_type() == at::kFloat, what, ": tensors must be float32");
  }
}

void check_same_dtype(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    TORCH_CHECK(a[i].scalar_type() == a[0].scalar_type() && b[i].scalar_type() == a[0].scalar_type(),
                "params and grads must all share one dtype per call");
}

template <typename F>
void for_chunks(const std::vector<Chunk>& chunks, F&& f) {
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) f(c, chunks[c]);
  });
}

at::Tensor combine(const std::vector<Chunk>& chunks, const std::vector<double>& part, int64_t segs, int k) {
  auto out = at::zeros({segs, k}, at::kDouble);
  auto a = out.accessor<double, 2>();
  for (size_t ci = 0; ci < chunks.size(); ++ci)
    for (int j = 0; j < k; ++j) a[chunks[ci].seg][j] += part[ci * k + j];
  return out;
}

// The GSNR of one element, the one place C++ computes it: gbar = sum_g / n, s = sum_sq / n,
// r = min(gbar^2 / (max(s - gbar^2, 0) + eps), 2^64) (docs/design.md §1; the biased variance,
// whose constant factor the per-tensor normalisation cancels; the bound: vrgd_ds/gsnr.py
// R_MAX). Pass 1 also sums s and gbar^2.
constexpr float kRMax = 18446744073709551616.f;  // 2^64
struct Gsnr {
  float s, g2, r;
};
inline Gsnr gsnr_of(float sg, float sq, float inv_n, float eps) {
  const float gbar = sg * inv_n;
  const float s = sq * inv_n;
  const float g2 = gbar * gbar;
  float var = s - g2;
  var = var > 0.f ? var : 0.f;
  const float r = g2 / (var + eps);
  return {s, g2, kRMax < r ? kRMax : r};  // NaN stays NaN (std::min's order)
}
inline float gsnr_raw(float sg, float sq, float inv_n, float eps) { return gsnr_of(sg, sq, inv_n, eps).r; }

// The clamp of every GSNR scale to [lo, 1].
inline float clamp_unit(float x, float lo) { return std::min(std::max(x, lo), 1.f); }

// The statistics one kernel call reads: empty sum_g means GSNR off, empty avg means no EMA.
struct GsnrArgs {
  const std::vector<at::Tensor>& sum_g;
  const std::vector<at::Tensor>& sum_sq;
  const std::vector<at::Tensor>& avg;
  double inv_n, eps, beta3;
};

void check_gsnr(const GsnrArgs& a, size_t n) {
  if (a.sum_g.empty()) return;
  check_list(a.sum_g, n, "sum_g", true);
  check_list(a.sum_sq, n, "sum_sq", true);
  if (!a.avg.empty()) check_list(a.avg, n, "gsnr_avg", true);
}

// Per-element GSNR scale p_hat of one chunk. Per-segment columns 0..2: inv_mean, lo (gamma,
// or 1 for a segment without information), bias correction of the GSNR EMA. ON/EMA are
// compile-time so the loops vectorise.
template <bool ON, bool EMA>
struct GsnrChunk {
  static constexpr bool kOn = ON;
  const float* sg = nullptr;
  const float* sq = nullptr;
  float* avg = nullptr;
  float inv_n = 0, eps = 0, b3 = 0, omb3 = 0, inv_mean = 0, lo = 0, bc3 = 1;

  GsnrChunk(const GsnrArgs& a, const SegF& sf, const Chunk& c) {
    if constexpr (ON) {
      sg = a.sum_g[c.tensor].data_ptr<float>() + c.begin;
      sq = a.sum_sq[c.tensor].data_ptr<float>() + c.begin;
      inv_n = float(a.inv_n);
      eps = float(a.eps);
      inv_mean = float(sf.at(c.seg, col::kInvMean));
      lo = float(sf.at(c.seg, col::kLo));
      bc3 = float(sf.at(c.seg, col::kBc3));
      if constexpr (EMA) {
        avg = a.avg[c.tensor].data_ptr<float>() + c.begin;
        b3 = float(a.beta3);
        omb3 = float(1.0 - a.beta3);
      }
    }
  }

  // p_hat, and flags (1 or 0) where the normalised r_t was raised to lo / cut to 1. Returned
  // by value: flags written through references become memory and stop vectorisation.
  struct Scaled {
    float r, low, high;
  };

  template <bool WRITE>
  inline Scaled operator()(int64_t i) const {
    if constexpr (!ON) {
      return {1.f, 0.f, 0.f};
    } else {
      const float x = gsnr_raw(sg[i], sq[i], inv_n, eps) * inv_mean;
      const float low = x < lo ? 1.f : 0.f;
      const float high = x > 1.f ? 1.f : 0.f;
      const float r = clamp_unit(x, lo);
      if constexpr (!EMA) {
        return {r, low, high};
      } else {
        const float a = avg[i] * b3 + r * omb3;
        if constexpr (WRITE) avg[i] = a;
        // The bias-corrected EMA of values in [lo, 1] lies in [lo, 1]; the clamp removes
        // rounding excursions, so gamma == 1 gives exactly 1 and the base optimizer exactly.
        return {clamp_unit(a / bc3, lo), low, high};
      }
    }
  }

  // p_hat of element i once operator()<true> has run this step (a second pass over the same
  // elements): the EMA already holds p_t, so it is read back, not advanced again. Bit for bit
  // the value operator() returned.
  inline float written(int64_t i) const {
    if constexpr (!ON) {
      return 1.f;
    } else if constexpr (!EMA) {
      return clamp_unit(gsnr_raw(sg[i], sq[i], inv_n, eps) * inv_mean, lo);
    } else {
      return clamp_unit(avg[i] / bc3, lo);
    }
  }
};

// Where p_hat enters the Adam family (VRAdam, VRLamb), in the order of GSNR_PLACEMENTS in
// vrgd_ds/optim/adam.py:
//   kFirstMoment  m from p_hat * g, v from g^2          (default: p_hat reaches the step)
//   kBothMoments  m from p_hat * g, v from (p_hat * g)^2 (p_hat cancels in m / sqrt(v))
//   kUpdate       m, v from g; the update m_hat / (sqrt(v_hat) + eps) is multiplied by p_hat
enum Placement : int64_t { kFirstMoment = 0, kBothMoments = 1, kUpdate = 2 };

// Calls f(std::integral_constant<int, M>) with M = 0 (GSNR off), 1 (no EMA), 2 (EMA).
template <typename F>
void with_gsnr_mode(const GsnrArgs& a, F&& f) {
  if (a.sum_g.empty()) f(std::integral_constant<int, 0>{});
  else if (a.avg.empty()) f(std::integral_constant<int, 1>{});
  else f(std::integral_constant<int, 2>{});
}
template <int M>
using GsnrOf = GsnrChunk<(M > 0), (M > 1)>;

// ---- workers (one chunk each) ------------------------------------------------------------

__attribute__((noinline)) void moments_chunk(const float* __restrict sg, const float* __restrict sq, int64_t n,
                                             float inv_n, float eps, double* o) {
  float sr = 0.f, ss = 0.f, sgb = 0.f, mn = INFINITY, mx = -INFINITY;
  _Pragma("omp simd reduction(+ : sr, ss, sgb) reduction(min : mn) reduction(max : mx)")
  for (int64_t i = 0; i < n; ++i) {
    const Gsnr x = gsnr_of(sg[i], sq[i], inv_n, eps);
    sr += x.r;
    ss += x.s;
    sgb += x.g2;
    mn = std::min(mn, x.r);
    mx = std::max(mx, x.r);
  }
  o[0] = sr; o[1] = ss; o[2] = sgb; o[3] = mn; o[4] = mx;
}

// Sum of squares of one chunk. One instantiation per element type whatever the GSNR mode,
// so a norm sums in the same order with GSNR on or off: gamma = 1 then reproduces the base
// optimizer's trust ratios bit for bit.
template <typename T>
__attribute__((noinline)) double sum_squares(const T* __restrict x, int64_t n) {
  float acc = 0.f;
  _Pragma("omp simd reduction(+ : acc)")
  for (int64_t i = 0; i < n; ++i) {
    const float v = float(x[i]);
    acc += v * v;
  }
  return acc;
}

// Per-thread scratch of one chunk (L2-resident), for values reduced after an element-wise loop.
float* scratch() {
  thread_local std::vector<float> buf(kChunk);
  return buf.data();
}

template <typename scalar_t, typename G>
__attribute__((noinline)) void grad_norms_chunk(const G scale, const scalar_t* __restrict p,
                                                const scalar_t* __restrict gr, int64_t n, double* o) {
  float* __restrict u = scratch();
  _Pragma("omp simd")
  for (int64_t i = 0; i < n; ++i) {
    u[i] = scale.template operator()<false>(i).r * float(gr[i]);
  }
  o[0] = sum_squares(p, n);
  o[1] = sum_squares(u, n);
}

template <typename scalar_t, typename G, bool BUF, bool FIRST, bool NESTEROV>
__attribute__((noinline)) void sgd_chunk(const G scale, scalar_t* __restrict p, const scalar_t* __restrict gr,
                                         float* __restrict b, int64_t n, float lr, float wd, float mult, float mu,
                                         float omd, double* o) {
  float nlo = 0.f, nhi = 0.f, nsc = 0.f;
  _Pragma("omp simd reduction(+ : nlo, nhi, nsc)")
  for (int64_t i = 0; i < n; ++i) {
    const auto sc = scale.template operator()<true>(i);
    const float pv = float(p[i]);
    float d = sc.r * float(gr[i]);
    d = d + wd * pv;
    d = d * mult;
    if constexpr (BUF) {
      const float bv = FIRST ? d : b[i] * mu + d * omd;
      b[i] = bv;
      d = NESTEROV ? d + bv * mu : bv;
    }
    p[i] = scalar_t(pv - lr * d);
    nlo += sc.low;
    nhi += sc.high;
    nsc += sc.r;
  }
  o[0] = nlo; o[1] = nhi; o[2] = nsc;
}

struct AdamConsts {
  float b1, omb1, b2, omb2, eps, wd, decay, bc1, bc2s, step_size, grad_mult;
};

// APPLY: the AdamW update, o = clip counts and the sum of p_hat. Else LAMB's first pass:
// moments only, o = |theta|^2, |u|^2 (u kept in scratch), clip counts, sum of p_hat.
// PLACE: where p_hat enters (Placement); with p_hat == 1 every placement is the base step.
template <typename scalar_t, typename G, bool APPLY, int64_t PLACE>
__attribute__((noinline)) void adam_chunk(const G scale, scalar_t* __restrict p, const scalar_t* __restrict gr,
                                          float* __restrict m, float* __restrict v, int64_t n, const AdamConsts k,
                                          double* o) {
  float* __restrict u = APPLY ? nullptr : scratch();
  float nlo = 0.f, nhi = 0.f, nsc = 0.f;
  _Pragma("omp simd reduction(+ : nlo, nhi, nsc)")
  for (int64_t i = 0; i < n; ++i) {
    const auto sc = scale.template operator()<true>(i);
    const float graw = float(gr[i]);
    const float gm = (PLACE == kUpdate ? graw : sc.r * graw) * k.grad_mult;
    const float gv = PLACE == kBothMoments ? gm : graw * k.grad_mult;
    const float mv = m[i] * k.b1 + gm * k.omb1;
    const float vv = v[i] * k.b2 + (gv * gv) * k.omb2;
    m[i] = mv;
    v[i] = vv;
    const float denom = std::sqrt(vv) / k.bc2s + k.eps;
    if constexpr (APPLY) {
      const float pv = float(p[i]) * k.decay;
      const float step = mv / denom;
      p[i] = scalar_t(pv - k.step_size * (PLACE == kUpdate ? sc.r * step : step));
    } else {
      const float step = mv / (k.bc1 * denom);
      u[i] = (PLACE == kUpdate ? sc.r * step : step) + k.wd * float(p[i]);
    }
    nlo += sc.low;
    nhi += sc.high;
    nsc += sc.r;
  }
  if constexpr (APPLY) {
    o[0] = nlo; o[1] = nhi; o[2] = nsc;
  } else {
    o[0] = sum_squares(p, n); o[1] = sum_squares(u, n); o[2] = nlo; o[3] = nhi; o[4] = nsc;
  }
}

// LAMB's second pass; `scale` reads back p_hat for the kUpdate placement (GSNR off otherwise).
template <typename scalar_t, typename G>
__attribute__((noinline)) void lamb_apply_chunk(const G scale, scalar_t* __restrict p, const float* __restrict m,
                                                const float* __restrict v, int64_t n, float bc1, float bc2s,
                                                float eps, float wd, float step) {
  _Pragma("omp simd")
  for (int64_t i = 0; i < n; ++i) {
    const float pv = float(p[i]);
    const float denom = std::sqrt(v[i]) / bc2s + eps;
    const float adam = m[i] / (bc1 * denom);
    const float u = (G::kOn ? scale.written(i) * adam : adam) + wd * pv;
    p[i] = scalar_t(pv - step * u);
  }
}

// 0 if every element is finite, else NaN: x * 0 is NaN exactly for inf and NaN, and a NaN
// survives the sum (no fast-math: see the build flags).
template <typename scalar_t>
__attribute__((noinline)) float nonfinite_chunk(const scalar_t* __restrict x, int64_t n) {
  float acc = 0.f;
  _Pragma("omp simd reduction(+ : acc)")
  for (int64_t i = 0; i < n; ++i) acc += float(x[i]) * 0.f;
  return acc;
}

template <typename scalar_t>
__attribute__((noinline)) void accumulate_chunk(const scalar_t* __restrict g, float* __restrict a,
                                                float* __restrict q, int64_t n, bool fresh) {
  if (fresh) {
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) {
      const float x = float(g[i]);
      a[i] = x;
      q[i] = x * x;
    }
  } else {
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) {
      const float x = float(g[i]);
      a[i] = a[i] + x;
      q[i] = q[i] + x * x;
    }
  }
}

}  // namespace

// Pass 1: per-segment moments of the raw GSNR, before normalisation.
// Columns: sum r, min r, max r, sum s (mean of squares), sum gbar^2, non-finite flag.
at::Tensor gsnr_moments(const std::vector<at::Tensor>& sum_g, const std::vector<at::Tensor>& sum_sq,
                        const at::Tensor& seg, double inv_n, double eps) {
  check_list(sum_g, sum_g.size(), "sum_g", true);
  check_list(sum_sq, sum_g.size(), "sum_sq", true);
  const auto chunks = make_chunks(seg);
  std::vector<double> part(chunks.size() * 5, 0.0);
  for_chunks(chunks, [&](int64_t ci, const Chunk& c) {
    moments_chunk(sum_g[c.tensor].data_ptr<float>() + c.begin, sum_sq[c.tensor].data_ptr<float>() + c.begin,
                  c.end - c.begin, float(inv_n), float(eps), part.data() + ci * 5);
  });
  auto out = at::zeros({seg.size(0), 6}, at::kDouble);
  auto a = out.accessor<double, 2>();
  for (int64_t s = 0; s < seg.size(0); ++s) {
    a[s][1] = INFINITY;
    a[s][2] = -INFINITY;
  }
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const double* o = part.data() + ci * 5;
    const int64_t s = chunks[ci].seg;
    a[s][0] += o[0];
    a[s][3] += o[1];
    a[s][4] += o[2];
    a[s][1] = std::min(a[s][1], o[3]);
    a[s][2] = std::max(a[s][2], o[4]);
  }
  // A non-finite input makes the sum of s (from sum_sq) or of gbar^2 (from sum_g) non-finite.
  for (int64_t s = 0; s < seg.size(0); ++s)
    a[s][5] = std::isfinite(a[s][3]) && std::isfinite(a[s][4]) ? 0.0 : 1.0;
  return out;
}

// Per-segment |theta|^2 and |p_hat * g|^2 (the GSNR EMA is read, not written) and a
// non-finite flag of the latter. LARS trust ratios; global gradient norms (GSNR off).
at::Tensor scaled_grad_norms(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                             const std::vector<at::Tensor>& sum_g, const std::vector<at::Tensor>& sum_sq,
                             const std::vector<at::Tensor>& avg, const at::Tensor& seg, const at::Tensor& segf,
                             double inv_n, double eps, double beta3) {
  const size_t T = params.size();
  check_list(params, T, "params", false);
  check_list(grads, T, "grads", false);
  check_same_dtype(params, grads);
  const GsnrArgs ga{sum_g, sum_sq, avg, inv_n, eps, beta3};
  check_gsnr(ga, T);
  const SegF sf = seg_f(segf, seg.size(0), col::kNormsWidth);
  const auto chunks = make_chunks(seg);
  std::vector<double> part(chunks.size() * 2, 0.0);
  if (T > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "scaled_grad_norms", [&] {
      with_gsnr_mode(ga, [&](auto mode) {
        for_chunks(chunks, [&](int64_t ci, const Chunk& c) {
          const GsnrOf<decltype(mode)::value> scale(ga, sf, c);
          grad_norms_chunk(scale, params[c.tensor].data_ptr<scalar_t>() + c.begin,
                           grads[c.tensor].data_ptr<scalar_t>() + c.begin, c.end - c.begin, part.data() + ci * 2);
        });
      });
    });
  }
  auto sums = combine(chunks, part, seg.size(0), 2);
  auto flag = at::logical_not(at::isfinite(sums.select(1, 1))).to(at::kDouble).unsqueeze(1);
  return at::cat({sums, flag}, 1);
}

// SGD with (Nesterov) momentum on the GSNR-scaled gradient; also the LARS update.
// Per-segment columns: inv_mean, lo, bc3, lr multiplier (LARS local lr, else 1),
// first step of the momentum buffer (1 or 0).
//   d = lr_mult * (p_hat * g + wd * theta)
//   buf = first ? d : momentum * buf + (1 - dampening) * d            (momentum != 0)
//   d = nesterov ? d + momentum * buf : buf
//   theta -= lr * d
// Returns per segment the counts of r_t raised to lo and cut to 1, and the sum of p_hat.
at::Tensor sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& bufs, const std::vector<at::Tensor>& sum_g,
                    const std::vector<at::Tensor>& sum_sq, const std::vector<at::Tensor>& avg, const at::Tensor& seg,
                    const at::Tensor& segf, double inv_n, double eps, double beta3, double lr, double weight_decay,
                    double momentum, double dampening, bool nesterov) {
  const size_t T = params.size();
  check_list(params, T, "params", false);
  check_list(grads, T, "grads", false);
  check_same_dtype(params, grads);
  const bool use_buf = momentum != 0.0;
  if (use_buf) check_list(bufs, T, "momentum_buffer", true);
  const GsnrArgs ga{sum_g, sum_sq, avg, inv_n, eps, beta3};
  check_gsnr(ga, T);
  const SegF sf = seg_f(segf, seg.size(0), col::kSgdWidth);
  const auto chunks = make_chunks(seg);
  std::vector<double> part(chunks.size() * 3, 0.0);
  const float flr = float(lr), fwd = float(weight_decay), mu = float(momentum), omd = float(1.0 - dampening);
  if (T > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "sgd_step", [&] {
      with_gsnr_mode(ga, [&](auto mode) {
        for_chunks(chunks, [&](int64_t ci, const Chunk& c) {
          const GsnrOf<decltype(mode)::value> scale(ga, sf, c);
          using G = GsnrOf<decltype(mode)::value>;
          scalar_t* p = params[c.tensor].data_ptr<scalar_t>() + c.begin;
          const scalar_t* gr = grads[c.tensor].data_ptr<scalar_t>() + c.begin;
          float* b = use_buf ? bufs[c.tensor].data_ptr<float>() + c.begin : nullptr;
          const int64_t n = c.end - c.begin;
          const float mult = float(sf.at(c.seg, col::kSgdLrMult));
          double* o = part.data() + ci * 3;
          auto run = [&](auto buf, auto first, auto nest) {
            sgd_chunk<scalar_t, G, decltype(buf)::value, decltype(first)::value, decltype(nest)::value>(
                scale, p, gr, b, n, flr, fwd, mult, mu, omd, o);
          };
          using T = std::true_type;
          using F = std::false_type;
          const bool first = sf.at(c.seg, col::kSgdFirst) != 0.0;
          if (!use_buf) run(F{}, F{}, F{});
          else if (first && nesterov) run(T{}, T{}, T{});
          else if (first) run(T{}, T{}, F{});
          else if (nesterov) run(T{}, F{}, T{});
          else run(T{}, F{}, F{});
        });
      });
    });
  }
  return combine(chunks, part, seg.size(0), 3);
}

// Adam(W) with GSNR. Per-segment columns: inv_mean, lo, bc3, bc1, sqrt(bc2), gradient multiplier
// (LAMB's global-norm pre-normalisation, else 1). With g_m = p_hat * g (placement kUpdate: g)
// and g_v = g (kBothMoments: p_hat * g), both times mult:
//   m = beta1 m + (1 - beta1) g_m;  v = beta2 v + (1 - beta2) g_v^2;  denom = sqrt(v) / sqrt(bc2) + eps
//   a = m / denom, times p_hat for kUpdate
// apply=true (Adam):  theta = theta (1 - lr wd) - (lr / bc1) a;
//   returns per segment the counts of r_t raised to lo and cut to 1, and the sum of p_hat.
// apply=false (LAMB, first pass): theta untouched; returns per segment |theta|^2, |u|^2 with
//   u = a / bc1 + wd theta (the trust-ratio norms), then the two clip counts and the sum of p_hat.
at::Tensor adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq,
                     const std::vector<at::Tensor>& sum_g, const std::vector<at::Tensor>& sum_sq,
                     const std::vector<at::Tensor>& avg, const at::Tensor& seg, const at::Tensor& segf,
                     double inv_n, double eps_gsnr, double beta3, double lr, double beta1, double beta2,
                     double eps, double weight_decay, bool apply, int64_t placement) {
  const size_t T = params.size();
  check_list(params, T, "params", false);
  check_list(grads, T, "grads", false);
  check_same_dtype(params, grads);
  check_list(exp_avg, T, "exp_avg", true);
  check_list(exp_avg_sq, T, "exp_avg_sq", true);
  TORCH_CHECK(placement == kFirstMoment || placement == kBothMoments || placement == kUpdate,
              "adam_step: unknown GSNR placement ", placement);
  const GsnrArgs ga{sum_g, sum_sq, avg, inv_n, eps_gsnr, beta3};
  check_gsnr(ga, T);
  const SegF sf = seg_f(segf, seg.size(0), col::kAdamWidth);
  const auto chunks = make_chunks(seg);
  const int cols = apply ? 3 : 5;
  std::vector<double> part(chunks.size() * cols, 0.0);
  if (T > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "adam_step", [&] {
      with_gsnr_mode(ga, [&](auto mode) {
        using G = GsnrOf<decltype(mode)::value>;
        auto run = [&](auto place) {
          constexpr int64_t P = decltype(place)::value;
          for_chunks(chunks, [&](int64_t ci, const Chunk& c) {
            const G scale(ga, sf, c);
            const AdamConsts k{float(beta1), float(1.0 - beta1), float(beta2), float(1.0 - beta2), float(eps),
                               float(weight_decay), float(1.0 - lr * weight_decay),
                               float(sf.at(c.seg, col::kAdamBc1)), float(sf.at(c.seg, col::kAdamBc2s)),
                               float(lr / sf.at(c.seg, col::kAdamBc1)), float(sf.at(c.seg, col::kAdamGradMult))};
            scalar_t* p = params[c.tensor].data_ptr<scalar_t>() + c.begin;
            const scalar_t* gr = grads[c.tensor].data_ptr<scalar_t>() + c.begin;
            float* m = exp_avg[c.tensor].data_ptr<float>() + c.begin;
            float* v = exp_avg_sq[c.tensor].data_ptr<float>() + c.begin;
            double* o = part.data() + ci * cols;
            if (apply)
              adam_chunk<scalar_t, G, true, P>(scale, p, gr, m, v, c.end - c.begin, k, o);
            else
              adam_chunk<scalar_t, G, false, P>(scale, p, gr, m, v, c.end - c.begin, k, o);
          });
        };
        // p_hat == 1 without GSNR: one instantiation serves every placement.
        if (decltype(mode)::value == 0 || placement == kBothMoments)
          run(std::integral_constant<int64_t, kBothMoments>{});
        else if (placement == kFirstMoment)
          run(std::integral_constant<int64_t, kFirstMoment>{});
        else
          run(std::integral_constant<int64_t, kUpdate>{});
      });
    });
  }
  return combine(chunks, part, seg.size(0), cols);
}

// LAMB second pass: theta -= lr * trust * u, u recomputed from the updated moments (and, for
// the kUpdate placement, p_hat read back from the statistics and the EMA adam_step wrote: pass
// the statistics only then, empty lists otherwise). Per-segment columns: inv_mean, lo, bc3
// (as adam_step), bc1, sqrt(bc2), trust ratio.
void lamb_apply(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avg,
                const std::vector<at::Tensor>& exp_avg_sq, const std::vector<at::Tensor>& sum_g,
                const std::vector<at::Tensor>& sum_sq, const std::vector<at::Tensor>& avg, const at::Tensor& seg,
                const at::Tensor& segf, double inv_n, double eps_gsnr, double beta3, double lr, double eps,
                double weight_decay) {
  const size_t T = params.size();
  check_list(params, T, "params", false);
  check_list(exp_avg, T, "exp_avg", true);
  check_list(exp_avg_sq, T, "exp_avg_sq", true);
  const GsnrArgs ga{sum_g, sum_sq, avg, inv_n, eps_gsnr, beta3};
  check_gsnr(ga, T);
  const SegF sf = seg_f(segf, seg.size(0), col::kLambWidth);
  const auto chunks = make_chunks(seg);
  if (T == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "lamb_apply", [&] {
    with_gsnr_mode(ga, [&](auto mode) {
      for_chunks(chunks, [&](int64_t, const Chunk& c) {
        const GsnrOf<decltype(mode)::value> scale(ga, sf, c);
        lamb_apply_chunk(scale, params[c.tensor].data_ptr<scalar_t>() + c.begin,
                         exp_avg[c.tensor].data_ptr<float>() + c.begin,
                         exp_avg_sq[c.tensor].data_ptr<float>() + c.begin, c.end - c.begin,
                         float(sf.at(c.seg, col::kLambBc1)), float(sf.at(c.seg, col::kLambBc2s)), float(eps),
                         float(weight_decay), float(lr * sf.at(c.seg, col::kLambTrust)));
      });
    });
  });
}

// Per segment 1.0 where the tensors hold an inf or NaN, else 0.0: the step's check of the
// gradients it is about to apply (they may differ from the statistics: a hook that clips or
// rewrites .grad after backward, low-precision accumulation that overflowed).
at::Tensor nonfinite(const std::vector<at::Tensor>& tensors, const at::Tensor& seg) {
  check_list(tensors, tensors.size(), "tensors", false);
  const auto chunks = make_chunks(seg);
  std::vector<double> part(chunks.size(), 0.0);
  if (!tensors.empty()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tensors[0].scalar_type(), "nonfinite", [&] {
      for_chunks(chunks, [&](int64_t ci, const Chunk& c) {
        part[ci] = std::isnan(nonfinite_chunk(tensors[c.tensor].data_ptr<scalar_t>() + c.begin, c.end - c.begin))
                       ? 1.0 : 0.0;
      });
    });
  }
  auto out = at::zeros({seg.size(0)}, at::kDouble);
  auto a = out.accessor<double, 1>();
  for (size_t ci = 0; ci < chunks.size(); ++ci) a[chunks[ci].seg] = std::max(a[chunks[ci].seg], part[ci]);
  return out;
}

// One pass over a local gradient x for the statistics: g_out = float(x) (when defined) and
// sq_out = (c * float(x))^2, squares taken in fp32 after removing the loss scale (c); with
// accumulate, both are added instead (a rank's micro-steps summed locally). The fused
// reduction buffer's two halves, or a rank's local sums, in place of a copy, a multiply and a
// square.
void pack_squares(const at::Tensor& src, const c10::optional<at::Tensor>& g_out, const at::Tensor& sq_out, double c,
                  bool accumulate) {
  check_list({src}, 1, "src", false);
  check_list({sq_out}, 1, "sq_out", true);
  const bool with_g = g_out.has_value() && g_out->defined();
  if (with_g) check_list({*g_out}, 1, "g_out", true);
  const int64_t numel = src.numel();
  TORCH_CHECK(sq_out.numel() == numel && (!with_g || g_out->numel() == numel), "pack_squares: size mismatch");
  const float fc = float(c);
  float* q = sq_out.data_ptr<float>();
  float* g = with_g ? g_out->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "pack_squares", [&] {
    const scalar_t* x = src.data_ptr<scalar_t>();
    at::parallel_for(0, numel, kChunk, [&](int64_t lo, int64_t hi) {
      if (g != nullptr && accumulate) {
        _Pragma("omp simd")
        for (int64_t i = lo; i < hi; ++i) {
          const float v = float(x[i]);
          g[i] = g[i] + v;
          const float w = v * fc;
          q[i] = q[i] + w * w;
        }
      } else if (g != nullptr) {
        _Pragma("omp simd")
        for (int64_t i = lo; i < hi; ++i) {
          const float v = float(x[i]);
          g[i] = v;
          const float w = v * fc;
          q[i] = w * w;
        }
      } else if (accumulate) {
        _Pragma("omp simd")
        for (int64_t i = lo; i < hi; ++i) {
          const float w = float(x[i]) * fc;
          q[i] = q[i] + w * w;
        }
      } else {
        _Pragma("omp simd")
        for (int64_t i = lo; i < hi; ++i) {
          const float w = float(x[i]) * fc;
          q[i] = w * w;
        }
      }
    });
  });
}

// One pass over a flat local gradient (an engine's bucket, or one parameter's gradient) for the
// statistics, every segment of the table in one call: table rows (source start, gradient start,
// squares start, length, accumulate). w = c * float(x): w^2 goes to the squares and, with a
// g_scale, g_scale * float(x) to the gradient; an accumulate row adds instead of writing. Segments are cut
// into fixed chunks spread over the threads; each element is written by exactly one of them.
template <typename T>
__attribute__((noinline)) void pack_chunk(const T* __restrict__ x, float* __restrict__ g, float* __restrict__ q,
                                          int64_t n, float c, float gs, bool acc) {
  if (g != nullptr && acc) {
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) {
      const float v = float(x[i]);
      const float w = v * c;
      g[i] = g[i] + v * gs;
      q[i] = q[i] + w * w;
    }
  } else if (g != nullptr) {
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) {
      const float v = float(x[i]);
      const float w = v * c;
      g[i] = v * gs;
      q[i] = w * w;
    }
  } else if (acc) {
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) {
      const float w = float(x[i]) * c;
      q[i] = q[i] + w * w;
    }
  } else {
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) {
      const float w = float(x[i]) * c;
      q[i] = w * w;
    }
  }
}

// main[i] += x[i] as Tensor.add_ rounds it: in fp32, then to main's dtype (round to nearest even).
template <typename T, typename M>
__attribute__((noinline)) void main_chunk(const T* __restrict__ x, M* __restrict__ m, int64_t n) {
  _Pragma("omp simd")
  for (int64_t i = 0; i < n; ++i) m[i] = M(float(m[i]) + float(x[i]));
}

void pack_bucket(const at::Tensor& src, const at::Tensor& table, const at::Tensor& out, double c,
                 c10::optional<double> g_scale, const c10::optional<at::Tensor>& main) {
  const bool with_g = g_scale.has_value();
  const bool with_main = main.has_value() && main->defined();
  if (with_main) {
    check_list({*main}, 1, "main", false);
    TORCH_CHECK(main->numel() == src.numel() &&
                    (main->scalar_type() == at::kFloat || main->scalar_type() == src.scalar_type()),
                "pack_bucket: main must be as long as the source, fp32 or the source's dtype");
  }
  check_list({src}, 1, "src", false);
  check_list({out}, 1, "out", true);
  TORCH_CHECK(table.dtype() == at::kLong && table.dim() == 2 && table.size(1) == 5 && table.is_contiguous() &&
                  table.device().is_cpu(),
              "bucket table must be contiguous int64 [S, 5] (source, gradient, squares, length, accumulate)");
  auto t = table.accessor<int64_t, 2>();
  struct Piece {
    int64_t src, g, q, n;
    bool acc;
  };
  std::vector<Piece> pieces;
  for (int64_t i = 0; i < table.size(0); ++i) {
    const int64_t s = t[i][0], g = t[i][1], q = t[i][2], n = t[i][3];
    TORCH_CHECK(s >= 0 && q >= 0 && n >= 0 && s + n <= src.numel() && q + n <= out.numel() &&
                    (!with_g || (g >= 0 && g + n <= out.numel())),
                "pack_bucket: segment ", i, " is outside the source or the buffer");
    for (int64_t o = 0; o < n; o += kChunk)
      pieces.push_back({s + o, g + o, q + o, std::min(kChunk, n - o), t[i][4] != 0});
  }
  const float fc = float(c);
  const float gs = with_g ? float(*g_scale) : 0.f;
  float* base = out.data_ptr<float>();
  const bool main_fp32 = with_main && main->scalar_type() == at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "pack_bucket", [&] {
    const scalar_t* x = src.data_ptr<scalar_t>();
    float* mf = main_fp32 ? main->data_ptr<float>() : nullptr;
    scalar_t* mx = with_main && !main_fp32 ? main->data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) {
        const Piece& p = pieces[k];
        if (mf != nullptr) main_chunk<scalar_t, float>(x + p.src, mf + p.src, p.n);
        if (mx != nullptr) main_chunk<scalar_t, scalar_t>(x + p.src, mx + p.src, p.n);
        pack_chunk<scalar_t>(x + p.src, with_g ? base + p.g : nullptr, base + p.q, p.n, fc, gs, p.acc);
      }
    });
  });
}

// The reverse move of a reduced statistics bucket: rows (source start, gradient start, squares
// start, length, accumulate); the squares are read src_sq past the row's source start.
__attribute__((noinline)) void move_chunk(const float* __restrict__ x, float* __restrict__ y, int64_t n, bool acc) {
  if (acc) {
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) y[i] = y[i] + x[i];
  } else {
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) y[i] = x[i];
  }
}

void unpack_bucket(const at::Tensor& src, const at::Tensor& table, const at::Tensor& out, int64_t src_sq,
                   bool with_g) {
  check_list({src, out}, 2, "unpack_bucket", true);
  TORCH_CHECK(table.dtype() == at::kLong && table.dim() == 2 && table.size(1) == 5 && table.is_contiguous() &&
                  table.device().is_cpu(),
              "bucket table must be contiguous int64 [S, 5] (source, gradient, squares, length, accumulate)");
  auto t = table.accessor<int64_t, 2>();
  struct Piece {
    int64_t src, dst, n;
    bool acc;
  };
  std::vector<Piece> pieces;
  for (int64_t i = 0; i < table.size(0); ++i) {
    const int64_t s = t[i][0], g = t[i][1], q = t[i][2], n = t[i][3];
    TORCH_CHECK(s >= 0 && n >= 0 && s + src_sq + n <= src.numel() && q >= 0 && q + n <= out.numel() &&
                    (!with_g || (g >= 0 && g + n <= out.numel())),
                "unpack_bucket: segment ", i, " is outside the source or the buffer");
    for (int64_t o = 0; o < n; o += kChunk) {
      const int64_t m = std::min(kChunk, n - o);
      pieces.push_back({s + src_sq + o, q + o, m, t[i][4] != 0});
      if (with_g) pieces.push_back({s + o, g + o, m, t[i][4] != 0});
    }
  }
  const float* x = src.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) move_chunk(x + pieces[k].src, y + pieces[k].dst, pieces[k].n, pieces[k].acc);
  });
}

// One backward's gradient into fp32 statistics: fresh: sum_g = g, sum_sq = g^2;
// else sum_g += g, sum_sq += g^2. Squares are taken in fp32.
//
// With inv_n > 0 it also returns pass 1 of the step for this tensor as one segment (the row
// gsnr_moments would return, [6] float64, with n = 1 / inv_n groups so far), computed on each
// chunk while it is still in cache: when this backward turns out to be the step's last, the
// step reads the statistics once instead of twice. Chunks and their combination are those of
// gsnr_moments, so the row is bit for bit the same.
at::Tensor accumulate_moments(const at::Tensor& grad, const at::Tensor& sum_g, const at::Tensor& sum_sq,
                              bool fresh, double inv_n, double eps) {
  check_list({grad}, 1, "grad", false);
  check_list({sum_g, sum_sq}, 2, "statistics", true);
  TORCH_CHECK(grad.numel() == sum_g.numel() && grad.numel() == sum_sq.numel(), "statistics size mismatch");
  const int64_t numel = grad.numel();
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  const bool moments = inv_n > 0;
  std::vector<double> part(moments ? nchunks * 5 : 0, 0.0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "accumulate_moments", [&] {
    const scalar_t* g = grad.data_ptr<scalar_t>();
    float* a = sum_g.data_ptr<float>();
    float* q = sum_sq.data_ptr<float>();
    at::parallel_for(0, nchunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const int64_t b = c * kChunk, n = std::min(numel, b + kChunk) - b;
        accumulate_chunk(g + b, a + b, q + b, n, fresh);
        if (moments) moments_chunk(a + b, q + b, n, float(inv_n), float(eps), part.data() + c * 5);
      }
    });
  });
  if (!moments) return at::Tensor();
  auto out = at::zeros({6}, at::kDouble);
  double* o = out.data_ptr<double>();
  o[1] = INFINITY;
  o[2] = -INFINITY;
  for (int64_t c = 0; c < nchunks; ++c) {
    const double* pc = part.data() + c * 5;
    o[0] += pc[0];
    o[3] += pc[1];
    o[4] += pc[2];
    o[1] = std::min(o[1], pc[3]);
    o[2] = std::max(o[2], pc[4]);
  }
  o[5] = std::isfinite(o[3]) && std::isfinite(o[4]) ? 0.0 : 1.0;
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using py::arg;
  m.def("gsnr_moments", &gsnr_moments, arg("sum_g"), arg("sum_sq"), arg("seg"), arg("inv_n"), arg("eps"));
  m.def("scaled_grad_norms", &scaled_grad_norms, arg("params"), arg("grads"), arg("sum_g"), arg("sum_sq"),
        arg("avg"), arg("seg"), arg("segf"), arg("inv_n"), arg("eps"), arg("beta3"));
  m.def("sgd_step", &sgd_step, arg("params"), arg("grads"), arg("bufs"), arg("sum_g"), arg("sum_sq"), arg("avg"),
        arg("seg"), arg("segf"), arg("inv_n"), arg("eps"), arg("beta3"), arg("lr"), arg("weight_decay"),
        arg("momentum"), arg("dampening"), arg("nesterov"));
  m.def("adam_step", &adam_step, arg("params"), arg("grads"), arg("exp_avg"), arg("exp_avg_sq"), arg("sum_g"),
        arg("sum_sq"), arg("avg"), arg("seg"), arg("segf"), arg("inv_n"), arg("eps_gsnr"), arg("beta3"), arg("lr"),
        arg("beta1"), arg("beta2"), arg("eps"), arg("weight_decay"), arg("apply"), arg("placement"));
  m.def("lamb_apply", &lamb_apply, arg("params"), arg("exp_avg"), arg("exp_avg_sq"), arg("sum_g"), arg("sum_sq"),
        arg("avg"), arg("seg"), arg("segf"), arg("inv_n"), arg("eps_gsnr"), arg("beta3"), arg("lr"), arg("eps"),
        arg("weight_decay"));
  m.def("nonfinite", &nonfinite, arg("tensors"), arg("seg"));
  m.def("pack_squares", &pack_squares, arg("src"), arg("g_out"), arg("sq_out"), arg("c"), arg("accumulate") = false);
  m.def("pack_bucket", &pack_bucket, arg("src"), arg("table"), arg("out"), arg("c"), arg("g_scale"),
        arg("main") = py::none());
  m.def("unpack_bucket", &unpack_bucket, arg("src"), arg("table"), arg("out"), arg("src_sq"), arg("with_g"));
  m.def("accumulate_moments", &accumulate_moments, arg("grad"), arg("sum_g"), arg("sum_sq"), arg("fresh"),
        arg("inv_n") = 0.0, arg("eps") = 0.0);
}
