// int16-input 1-d convolutions of few channels (conv16 of [N, C, L], groups 1), summed tap by
// tap along the output positions instead of through the GEMM.
//
// Why: conv1d.cpp's route stages each panel, turns it channels-last, builds its im2col and runs
// the GEMM once per byte plane; with 2-32 channels in and out (HDemucs' residual branches:
// 8 -> 2 channels, kernel 3; 2 -> 16, kernel 1) the GEMM fills a few of its 16 output lanes and
// its Kp of 4-32 bytes, and every panel (every batch row: the frequency branch runs 32 rows of
// 64 positions) pays the staging and two products' set-up. Here each output channel's row is a
// sum over (channel, tap) of one weight times a contiguous run of staged input values, a loop
// the compiler vectorizes along the positions, and a strided convolution reads its input split
// into `stride` phases, so every run stays contiguous.
//
// The sums are conv16's, exactly: the high byte plane (q >> 8, on zero point 0) and the low one
// (q & 255) each summed in int32 (exact in any order), the GEMM's uint8 accumulator rebuilt
// (+ 128 per weight on the high plane: its bytes are hi + 128, 128 outside the input) before
// the given offset is added, then the two epilogues of conv1d.cpp's wide pass in their order of
// float operations: float(acc_hi + off) * scale, then + (float(acc_lo + lo_off) * lo_scale +
// bias). The result equals the GEMM route's bit for bit.
#include <cstdint>
#include <vector>

#include "qt_kernels.h"

extern "C" {

// Float x [N, C, L] (any strides) quantized to int16 (x_inv, qmin, qmax), convolved with a
// weight packed for the GEMM (groups 1, K ordered (tap, channel), depth Kp): float out [N, OC,
// OL] through its strides.
void qt_conv1d16_small(const float* x, int64_t sn, int64_t sc, int64_t sl, int64_t batch,
                       int64_t C, int64_t L, float x_inv, float qmin, float qmax, int64_t OC,
                       int64_t K, int64_t stride, int64_t pad, int64_t dil, int64_t OL,
                       int64_t Kp, const int8_t* w, const int32_t* off, const float* scale,
                       const int32_t* lo_off, const float* lo_scale, const float* bias,
                       float* out, int64_t on, int64_t oc, int64_t ol) try {
    if (batch <= 0 || OC <= 0 || OL <= 0) return;
    // the weight as [OC][C][K] int16, and each channel's GEMM correction 128 * sum_k w
    std::vector<int16_t> wt(static_cast<size_t>(OC * C * K));
    std::vector<int32_t> hi_base(static_cast<size_t>(OC));
    for (int64_t o = 0; o < OC; ++o) {
        int32_t sum = 0;
        for (int64_t t = 0; t < K; ++t)
            for (int64_t c = 0; c < C; ++c) {
                const int64_t k = t * C + c;
                const int8_t v = w[(o / 16) * (Kp / 4) * 64 + (k / 4) * 64 + (o % 16) * 4 + k % 4];
                wt[static_cast<size_t>((o * C + c) * K + t)] = v;
                sum += v;
            }
        hi_base[static_cast<size_t>(o)] = 128 * sum;
    }
    // staged input: per channel, `stride` phases of M values each; phase r, index m holds
    // input position p0 + m * stride + r (0 outside the input, as both planes' padding reads)
    const int64_t span = (OL - 1) * stride + (K - 1) * dil + 1;
    const int64_t M = (span + stride - 1) / stride;
    std::vector<int16_t> hi(static_cast<size_t>(C * stride * M)), lo(hi.size());
    std::vector<int32_t> acc_hi(static_cast<size_t>(OL)), acc_lo(acc_hi.size());
    for (int64_t n = 0; n < batch; ++n) {
        for (int64_t c = 0; c < C; ++c)
            for (int64_t r = 0; r < stride; ++r) {
                int16_t* h = hi.data() + (c * stride + r) * M;
                int16_t* lw = lo.data() + (c * stride + r) * M;
                const float* xc = x + sn * n + sc * c;
                // m such that p = m * stride + r - pad lies in [0, L)
                int64_t m0 = pad - r > 0 ? (pad - r + stride - 1) / stride : 0;
                int64_t m1 = L + pad - r > 0 ? (L + pad - r + stride - 1) / stride : 0;
                m0 = m0 < M ? m0 : M;
                m1 = m1 < M ? (m1 > m0 ? m1 : m0) : M;
                for (int64_t m = 0; m < m0; ++m) h[m] = lw[m] = 0;
                for (int64_t m = m1; m < M; ++m) h[m] = lw[m] = 0;
                const float* xs = xc + sl * (m0 * stride + r - pad);
                const int64_t step = sl * stride;
                if (step == 1) {  // contiguous: vectorized
                    for (int64_t m = m0; m < m1; ++m) {
                        const int32_t q = static_cast<int32_t>(
                            qt::quantize_value(xs[m - m0], x_inv, 0.0f, qmin, qmax));
                        h[m] = static_cast<int16_t>(q >> 8);
                        lw[m] = static_cast<int16_t>(q & 255);
                    }
                    continue;
                }
                for (int64_t m = m0; m < m1; ++m) {
                    const int32_t q = static_cast<int32_t>(
                        qt::quantize_value(xs[step * (m - m0)], x_inv, 0.0f, qmin, qmax));
                    h[m] = static_cast<int16_t>(q >> 8);
                    lw[m] = static_cast<int16_t>(q & 255);
                }
            }
        for (int64_t o = 0; o < OC; ++o) {
            int32_t* ah = acc_hi.data();
            int32_t* al = acc_lo.data();
            for (int64_t l = 0; l < OL; ++l) ah[l] = al[l] = 0;
            for (int64_t c = 0; c < C; ++c)
                for (int64_t t = 0; t < K; ++t) {
                    const int32_t wv = wt[static_cast<size_t>((o * C + c) * K + t)];
                    const int64_t d = t * dil, at = (c * stride + d % stride) * M + d / stride;
                    const int16_t* h = hi.data() + at;
                    const int16_t* lw = lo.data() + at;
                    for (int64_t l = 0; l < OL; ++l) {
                        ah[l] += wv * static_cast<int32_t>(h[l]);
                        al[l] += wv * static_cast<int32_t>(lw[l]);
                    }
                }
            const int32_t add_hi = hi_base[static_cast<size_t>(o)] + off[o], add_lo = lo_off[o];
            const float s_hi = scale[o], s_lo = lo_scale[o], b = bias ? bias[o] : 0.0f;
            float* dst = out + on * n + oc * o;
            if (bias)
                for (int64_t l = 0; l < OL; ++l)
                    dst[ol * l] = static_cast<float>(ah[l] + add_hi) * s_hi +
                                  (static_cast<float>(al[l] + add_lo) * s_lo + b);
            else
                for (int64_t l = 0; l < OL; ++l)
                    dst[ol * l] = static_cast<float>(ah[l] + add_hi) * s_hi +
                                  static_cast<float>(al[l] + add_lo) * s_lo;
        }
    }
}
QT_CATCH

}  // extern "C"
