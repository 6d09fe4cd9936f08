// A float group norm and what follows it in a residual branch, in one call: HDemucs' (and
// Demucs') DConv branch is conv -> GroupNorm(1) -> GELU -> conv -> GroupNorm(1) -> GLU ->
// LayerScale -> + x, and its int16 convolutions leave the norms, activations, scale and add
// float between them: six ATen calls, six passes over the map, per branch (20 norms and 20
// activations a forward), as many as the float model pays. Here a norm, its activation
// (GELU, or GLU along the channels), the per-channel scale and the residual add are one
// pass after the norm's statistics.
//
// Statistics as group_norm.cpp's contiguous path (float per-channel partial sums, double
// group sums, two passes), so the norm agrees with ATen's to float rounding; the epilogue
// applies ATen's ops' float operations in the graph's order (norm, activation, scale,
// residual).
#include <cmath>
#include <cstdint>
#include <vector>

#include "qt_kernels.h"
#include "qt_norm_block.h"

extern "C" int qt_current_isa();

namespace {

using qt::norm_block::Row;

constexpr int LANES = 16;

template <int power>
float row_sum(const float* __restrict r, int64_t n, float m) {
    float acc[LANES] = {};
    int64_t s = 0;
    for (; s + LANES <= n; s += LANES)
        for (int k = 0; k < LANES; ++k) {
            const float d = r[s + k] - m;
            acc[k] += power == 1 ? d : d * d;
        }
    float total = 0.0f;
    for (int k = 0; k < LANES; ++k) total += acc[k];
    for (; s < n; ++s) {
        const float d = r[s] - m;
        total += power == 1 ? d : d * d;
    }
    return total;
}

float gelu(float v) { return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f)); }

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

void rows_portable(int64_t act, const Row& w, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        float v = w.x[i] * w.a + w.b;
        if (act == qt::norm_block::GELU) v = gelu(v);
        if (act == qt::norm_block::GLU) v = v * sigmoid(w.xg[i] * w.ag + w.bg);
        if (w.s) v = w.s[0] * v;
        if (w.r) v = w.r[i] + v;
        w.out[i] = v;
    }
}

}  // namespace

extern "C" {

// x float [N, C, S] dense; weight, bias: C floats or null; act a norm_block::Act; scale:
// Co floats or null (Co = C / 2 for GLU, else C); residual: [N, Co, S] dense or null;
// out: [N, Co, S] dense.
void qt_norm_block(const float* x, int64_t N, int64_t C, int64_t S, int64_t G,
                   const float* weight, const float* bias, float eps, int64_t act,
                   const float* scale, const float* residual, float* out) try {
    if (N <= 0 || C <= 0 || G <= 0) return;
    const int64_t cg = C / G, co = act == qt::norm_block::GLU ? C / 2 : C;
    std::vector<float> part(static_cast<size_t>(C)), a(static_cast<size_t>(C)),
        b(static_cast<size_t>(C));
    std::vector<double> mean(static_cast<size_t>(G));
    const double count = static_cast<double>(cg * S);
#if defined(__x86_64__)
    const int isa = qt_current_isa();
    const bool avx2 = isa == qt::AVX2 || isa == qt::AVXVNNI || isa == qt::AVX512VNNI;
#endif
    for (int64_t n = 0; n < N; ++n) {
        const float* xn = x + n * C * S;
        for (int64_t c = 0; c < C; ++c) part[c] = row_sum<1>(xn + c * S, S, 0.0f);
        for (int64_t g = 0; g < G; ++g) {
            double sum = 0.0;
            for (int64_t c = g * cg; c < (g + 1) * cg; ++c) sum += part[c];
            mean[g] = count > 0 ? sum / count : 0.0;
        }
        for (int64_t c = 0; c < C; ++c)
            part[c] = row_sum<2>(xn + c * S, S, static_cast<float>(mean[c / cg]));
        for (int64_t g = 0; g < G; ++g) {
            double sq = 0.0;
            for (int64_t c = g * cg; c < (g + 1) * cg; ++c) sq += part[c];
            const double rstd = 1.0 / std::sqrt((count > 0 ? sq / count : 0.0) +
                                                static_cast<double>(eps));
            for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
                const double k = (weight ? weight[c] : 1.0) * rstd;
                a[c] = static_cast<float>(k);
                b[c] = static_cast<float>((bias ? bias[c] : 0.0) - mean[g] * k);
            }
        }
        for (int64_t c = 0; c < co; ++c) {
            const int64_t cgate = act == qt::norm_block::GLU ? c + co : c;
            const Row row{xn + c * S,
                          act == qt::norm_block::GLU ? xn + cgate * S : nullptr,
                          a[c], b[c], a[cgate], b[cgate],
                          scale ? scale + c : nullptr,
                          residual ? residual + (n * co + c) * S : nullptr,
                          out + (n * co + c) * S};
#if defined(__x86_64__)
            if (avx2) {
                qt::norm_block::rows_avx2(act, row, S);
                continue;
            }
#endif
            rows_portable(act, row, S);
        }
    }
} QT_CATCH

}  // extern "C"
