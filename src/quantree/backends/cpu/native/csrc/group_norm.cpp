// Float group norm over [N, C, S] (S: the spatial sizes flattened), contiguous or
// channels-last, the output in the input's layout.
//
// Why by hand: ATen's CPU group norm copies a channels-last input to contiguous first, and
// the native convolutions hand their float outputs over channels-last (ConvTasNet's and
// HDemucs' norms sit between convolutions): measured at batch 1 on [1, 128, 999], ATen
// takes about 4x as long on that layout as on a contiguous one. Here both layouts are read
// as they lie, in three passes that vectorize along the contiguous dimension: per-channel
// sums (the group mean), per-channel sums of squared deviations from it (the group
// variance, two-pass, so no cancellation), then y = x * a[c] + b[c] with
// a = w * rstd, b = bias - mean * a. Per-channel partial sums are float, the group's sums
// double. ATen's own reduction order differs, so results agree to float rounding, not bits.
#include <cmath>
#include <cstdint>
#include <vector>

#include "qt_kernels.h"
#include "qt_row_sum.h"

namespace {

using qt::row_sum;

}  // namespace

extern "C" {

// x, out float with element strides: contiguous (sc = S, ss = 1) or channels-last
// (sc = 1, ss = C); sample n at n * C * S. weight, bias: C floats or null.
void qt_group_norm(const float* x, int64_t N, int64_t C, int64_t S, int64_t channels_last,
                   int64_t G, const float* weight, const float* bias, float eps, float* out) try {
    if (N <= 0 || C <= 0 || G <= 0) return;
    const int64_t cg = C / G;
    std::vector<float> part(static_cast<size_t>(C));
    std::vector<float> a(static_cast<size_t>(C)), b(static_cast<size_t>(C));
    std::vector<double> mean(static_cast<size_t>(G)), rstd(static_cast<size_t>(G));
    const double count = static_cast<double>(cg * S);
    for (int64_t n = 0; n < N; ++n) {
        const float* xn = x + n * C * S;
        float* on = out + n * C * S;
        // pass 1: per-channel sums
        float* __restrict p = part.data();
        if (channels_last) {
            for (int64_t c = 0; c < C; ++c) p[c] = 0.0f;
            for (int64_t s = 0; s < S; ++s) {
                const float* __restrict row = xn + s * C;
                for (int64_t c = 0; c < C; ++c) p[c] += row[c];
            }
        } else {
            for (int64_t c = 0; c < C; ++c) p[c] = row_sum<1>(xn + c * S, S, 0.0f);
        }
        for (int64_t g = 0; g < G; ++g) {
            double sum = 0.0;
            for (int64_t c = g * cg; c < (g + 1) * cg; ++c) sum += p[c];
            mean[g] = count > 0 ? sum / count : 0.0;
        }
        // pass 2: per-channel sums of squared deviations from the group mean
        for (int64_t c = 0; c < C; ++c) a[c] = static_cast<float>(mean[c / cg]);
        const float* __restrict m = a.data();
        if (channels_last) {
            for (int64_t c = 0; c < C; ++c) p[c] = 0.0f;
            for (int64_t s = 0; s < S; ++s) {
                const float* __restrict row = xn + s * C;
                for (int64_t c = 0; c < C; ++c) {
                    const float d = row[c] - m[c];
                    p[c] += d * d;
                }
            }
        } else {
            for (int64_t c = 0; c < C; ++c) p[c] = row_sum<2>(xn + c * S, S, m[c]);
        }
        for (int64_t g = 0; g < G; ++g) {
            double sq = 0.0;
            for (int64_t c = g * cg; c < (g + 1) * cg; ++c) sq += p[c];
            const double var = count > 0 ? sq / count : 0.0;
            rstd[g] = 1.0 / std::sqrt(var + static_cast<double>(eps));
        }
        for (int64_t c = 0; c < C; ++c) {
            const double r = rstd[c / cg], w = weight ? weight[c] : 1.0;
            const double scale = w * r;
            a[c] = static_cast<float>(scale);
            b[c] = static_cast<float>((bias ? bias[c] : 0.0) - mean[c / cg] * scale);
        }
        // pass 3: y = x * a[c] + b[c]
        const float* __restrict av = a.data();
        const float* __restrict bv = b.data();
        if (channels_last) {
            for (int64_t s = 0; s < S; ++s) {
                const float* __restrict row = xn + s * C;
                float* __restrict dst = on + s * C;
                for (int64_t c = 0; c < C; ++c) dst[c] = row[c] * av[c] + bv[c];
            }
        } else {
            for (int64_t c = 0; c < C; ++c) {
                const float* __restrict row = xn + c * S;
                float* __restrict dst = on + c * S;
                const float ac = av[c], bc = bv[c];
                for (int64_t s = 0; s < S; ++s) dst[s] = row[s] * ac + bc;
            }
        }
    }
} QT_CATCH

}  // extern "C"
