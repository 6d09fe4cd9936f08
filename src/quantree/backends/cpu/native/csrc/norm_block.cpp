// A float group norm and what follows it in a residual branch, in one call: HDemucs' (and
// Demucs') DConv branch is conv -> GroupNorm(1) -> GELU -> conv -> GroupNorm(1) -> GLU ->
// LayerScale -> + x, and its int16 convolutions leave the norms, activations, scale and add
// float between them: six ATen calls, six passes over the map, per branch (20 norms and 20
// activations a forward), as many as the float model pays. Here a norm, its activation
// (GELU, or GLU along the channels), the per-channel scale and the residual add are one
// pass after the norm's statistics.
//
// Statistics in two passes (mean, then squared deviations from it), float partial sums of
// blocks of 1024 values and double sums of the blocks, so the norm agrees with ATen's to
// float rounding; the epilogue
// applies ATen's ops' float operations in the graph's order (norm, activation, scale,
// residual).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qt_kernels.h"
#include "qt_row_sum.h"
#include "qt_norm_block.h"

extern "C" int qt_current_isa();

namespace {

using qt::row_sum;

constexpr int64_t BLOCK = 1024;

template <int power>
double block_sum(const float* r, int64_t n, float m) {
    double total = 0.0;
    for (int64_t s = 0; s < n; s += BLOCK) total += row_sum<power>(r + s, std::min(BLOCK, n - s), m);
    return total;
}

float gelu(float v) { return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f)); }

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

}  // namespace

namespace qt::norm_block {

void rows_portable(int64_t act, const Sample& w) {
    for (int64_t c = 0; c < w.co; ++c) {
        const float* x = w.x + c * w.S;
        const float* xg = w.x + (c + w.co) * w.S;
        const float* r = w.r ? w.r + c * w.S : nullptr;
        float* out = w.out + c * w.S;
        for (int64_t i = 0; i < w.S; ++i) {
            float v = x[i] * w.a[c] + w.b[c];
            if (act == GELU) v = gelu(v);
            if (act == GLU) v = v * sigmoid(xg[i] * w.a[c + w.co] + w.b[c + w.co]);
            if (w.s) v = w.s[c] * v;
            if (r) v = r[i] + v;
            out[i] = v;
        }
    }
}

}  // namespace qt::norm_block

extern "C" {

// x float [N, C, S] dense; weight, bias: C floats or null; act a norm_block::Act; scale:
// Co floats or null (Co = C / 2 for GLU, else C); residual: [N, Co, S] dense or null;
// out: [N, Co, S] dense.
void qt_norm_block(const float* x, int64_t N, int64_t C, int64_t S, int64_t G,
                   const float* weight, const float* bias, float eps, int64_t act,
                   const float* scale, const float* residual, float* out) try {
    if (N <= 0 || C <= 0 || G <= 0) return;
    const int64_t cg = C / G, co = act == qt::norm_block::GLU ? C / 2 : C;
    std::vector<float> a(static_cast<size_t>(C)), b(static_cast<size_t>(C));
    const double count = static_cast<double>(cg * S);
#if defined(__x86_64__)
    const int isa = qt_current_isa();
    const bool avx2 = isa == qt::AVX2 || isa == qt::AVXVNNI || isa == qt::AVX512VNNI;
#endif
    for (int64_t n = 0; n < N; ++n) {
        const float* xn = x + n * C * S;
        // a group's channels lie one after another in a dense map: its cg * S values are one
        // run, summed in float blocks of BLOCK (vectorized, no per-channel reduction: the
        // branches' rows are 64 positions long) and the blocks in double
        for (int64_t g = 0; g < G; ++g) {
            const float* xg = xn + g * cg * S;
            const double m = count > 0 ? block_sum<1>(xg, cg * S, 0.0f) / count : 0.0;
            const double sq = block_sum<2>(xg, cg * S, static_cast<float>(m));
            const double rstd = 1.0 / std::sqrt((count > 0 ? sq / count : 0.0) +
                                                static_cast<double>(eps));
            for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
                const double k = (weight ? weight[c] : 1.0) * rstd;
                a[c] = static_cast<float>(k);
                b[c] = static_cast<float>((bias ? bias[c] : 0.0) - m * k);
            }
        }
        const qt::norm_block::Sample sample{xn, a.data(), b.data(), scale,
                                            residual ? residual + n * co * S : nullptr,
                                            out + n * co * S, co, S};
#if defined(__x86_64__)
        if (avx2) {
            qt::norm_block::rows_avx2(act, sample);
            continue;
        }
#endif
        qt::norm_block::rows_portable(act, sample);
    }
} QT_CATCH

}  // extern "C"
