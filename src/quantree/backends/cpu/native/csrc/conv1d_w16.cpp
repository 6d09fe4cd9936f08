// 1-d convolutions with int16 weights (per output channel) reading an int8 or int16
// activation: the portable path and the entry point every path shares.
//
// Why: a layer whose 8-bit weights are its accuracy bound (Conformer's convolution module:
// each uniform-initialised kernel at the ~48 dB of 8-bit codes, its output added to the
// residual unscaled) gains 2-9 dB from 16-bit weights, and ran as a float conv on
// dequantized weights, slower than the float model. Here the input is quantized as the
// reference's quantize op rounds it (v = q - zero point, 0 where the padding reads), split
// into its high byte (v >> 8, in [-128, 127]) and low byte (v & 255, in [0, 255]), and each
// plane's products with the int16 weights are summed in int32: a pair of products is under
// 2^24, so blocks of 128 pairs never overflow (AVX2's vpmaddwd reads such pairs). The sum
// 256 * hi + lo is exact in a double, so every path gives the same sums, then one float
// epilogue in one order: float(sum) * scale[o] (+ bias[o]). The result differs from the
// reference's float conv of dequantized values only by the float conv's own rounding.
#include <cstdint>
#include <vector>

#include "qt_kernels.h"

namespace qt {

void w16_panel_portable(const int16_t* colh, const int16_t* coll, int64_t R2, int64_t P8,
                        const int16_t* w, int64_t Rp, int64_t nO, double* dsum) {
    for (int64_t o = 0; o < nO; ++o)
        for (int64_t p = 0; p < P8; ++p) {
            int64_t s = 0;
            for (int64_t j = 0; j < R2; ++j)
                for (int64_t t = 0; t < 2; ++t) {
                    const int64_t at = (j * P8 + p) * 2 + t;
                    const int64_t v = 256 * static_cast<int64_t>(colh[at]) + coll[at];
                    s += v * w[o * Rp + 2 * j + t];
                }
            dsum[o * P8 + p] = static_cast<double>(s);
        }
}

}  // namespace qt

namespace {

constexpr int64_t PANEL = 64;  // output positions per panel (a multiple of 8)
constexpr int64_t DEPTHWISE_TAPS = 64;  // K products of |v| < 2^16 by |w| <= 2^15: exact in a double

// One input channel per output channel (Mamba's and Griffin's causal convs): the panel
// path made a pair-interleaved panel and a kernel call of one output row per channel and
// 64 positions, most of its time in that setup. Here each channel's row is summed tap by
// tap over all positions in doubles: every product and partial sum is an integer under
// 2^53, so the sums are the panel path's exact ones and the epilogue is its expression (the
// same bits).
void depthwise_w16(const int16_t* qh, const int16_t* ql, int64_t Lp, int64_t C, int64_t K,
                   int64_t stride, int64_t dil, int64_t OL, const int16_t* w, int64_t Rp,
                   const float* scale, const float* bias, float* out, int64_t oc, int64_t ol,
                   double* vrow, double* acc) {
    for (int64_t c = 0; c < C; ++c) {
        const int16_t* h = qh + c * Lp;
        const int16_t* lo = ql + c * Lp;
        for (int64_t i = 0; i < Lp; ++i) vrow[i] = 256.0 * h[i] + lo[i];
        for (int64_t p = 0; p < OL; ++p) acc[p] = 0.0;
        for (int64_t k = 0; k < K; ++k) {
            const double wk = w[c * Rp + k];
            const double* v = vrow + k * dil;
            if (stride == 1) {
                for (int64_t p = 0; p < OL; ++p) acc[p] += v[p] * wk;
            } else {
                for (int64_t p = 0; p < OL; ++p) acc[p] += v[p * stride] * wk;
            }
        }
        const float s = scale[c];
        float* dst = out + oc * c;
        if (ol == 1 && bias) {
            const float b = bias[c];
            for (int64_t p = 0; p < OL; ++p) dst[p] = static_cast<float>(acc[p]) * s + b;
        } else if (ol == 1) {
            for (int64_t p = 0; p < OL; ++p) dst[p] = static_cast<float>(acc[p]) * s;
        } else if (bias) {
            const float b = bias[c];
            for (int64_t p = 0; p < OL; ++p) dst[ol * p] = static_cast<float>(acc[p]) * s + b;
        } else {
            for (int64_t p = 0; p < OL; ++p) dst[ol * p] = static_cast<float>(acc[p]) * s;
        }
    }
}

}  // namespace

extern "C" {

// Float x [N, C, L] (any strides) quantized to q = clamp(round(x * x_inv) + zp, qmin, qmax)
// (qmin - zp and qmax - zp int16 values), convolved with int16 weights w [OC][Rp] (row o:
// its group's (channel, tap) products in the order c * K + k, zero from (C / groups) * K to
// the even Rp): out[n][o][l] = float(sum) * scale[o] (+ bias[o]), float, through its strides.
void qt_conv1d_w16(const float* x, int64_t sn, int64_t sc, int64_t sl, int64_t batch, int64_t C,
                   int64_t L, float x_inv, float zp, float qmin, float qmax, int64_t OC,
                   int64_t groups, int64_t K, int64_t stride, int64_t pad, int64_t dil,
                   int64_t OL, const int16_t* w, int64_t Rp, const float* scale,
                   const float* bias, float* out, int64_t on, int64_t oc, int64_t ol) try {
    if (batch <= 0 || OC <= 0 || OL <= 0) return;
    const int64_t Cg = C / groups, OCg = OC / groups, R = Cg * K, R2 = (R + 1) / 2;
    const int64_t span = (OL - 1) * stride + (K - 1) * dil + 1;
    const int64_t Lp = span > pad + L ? span : pad + L;  // a padded input row
    const int32_t zero = static_cast<int32_t>(zp);
    std::vector<int16_t> qh(static_cast<size_t>(C * Lp)), ql(qh.size());
    std::vector<int16_t> colh(static_cast<size_t>(R2 * PANEL * 2)), coll(colh.size());
    std::vector<double> dsum(static_cast<size_t>(OCg * PANEL));
    std::vector<int16_t> zeros(static_cast<size_t>(PANEL * stride));
    const bool depthwise = Cg == 1 && OCg == 1 && K <= DEPTHWISE_TAPS;
    std::vector<double> vrow(static_cast<size_t>(depthwise ? Lp : 0));
    std::vector<double> acc(static_cast<size_t>(depthwise ? OL : 0));
    for (int64_t n = 0; n < batch; ++n) {
        if (sc == 1 && sl != 1) {  // channels innermost: read in memory order
            for (int64_t c = 0; c < C; ++c) {
                for (int64_t i = 0; i < pad; ++i) qh[c * Lp + i] = ql[c * Lp + i] = 0;
                for (int64_t i = pad + L; i < Lp; ++i) qh[c * Lp + i] = ql[c * Lp + i] = 0;
            }
            for (int64_t i = 0; i < L; ++i) {
                const float* xi = x + sn * n + sl * i;
                for (int64_t c = 0; c < C; ++c) {
                    const int32_t v =
                        static_cast<int32_t>(qt::quantize_value(xi[c], x_inv, zp, qmin, qmax)) - zero;
                    qh[c * Lp + pad + i] = static_cast<int16_t>(v >> 8);
                    ql[c * Lp + pad + i] = static_cast<int16_t>(v & 255);
                }
            }
        }
        for (int64_t c = 0; c < C && !(sc == 1 && sl != 1); ++c) {
            int16_t* h = qh.data() + c * Lp;
            int16_t* lo = ql.data() + c * Lp;
            const float* xc = x + sn * n + sc * c;
            for (int64_t i = 0; i < pad; ++i) h[i] = lo[i] = 0;
            for (int64_t i = pad + L; i < Lp; ++i) h[i] = lo[i] = 0;
            h += pad;
            lo += pad;
            if (sl == 1) {  // contiguous rows: vectorized
                for (int64_t i = 0; i < L; ++i) {
                    const int32_t v =
                        static_cast<int32_t>(qt::quantize_value(xc[i], x_inv, zp, qmin, qmax)) - zero;
                    h[i] = static_cast<int16_t>(v >> 8);
                    lo[i] = static_cast<int16_t>(v & 255);
                }
                continue;
            }
            for (int64_t i = 0; i < L; ++i) {
                const int32_t v =
                    static_cast<int32_t>(qt::quantize_value(xc[sl * i], x_inv, zp, qmin, qmax)) - zero;
                h[i] = static_cast<int16_t>(v >> 8);
                lo[i] = static_cast<int16_t>(v & 255);
            }
        }
        if (depthwise) {
            depthwise_w16(qh.data(), ql.data(), Lp, C, K, stride, dil, OL, w, Rp, scale, bias,
                          out + on * n, oc, ol, vrow.data(), acc.data());
            continue;
        }
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t p0 = 0; p0 < OL; p0 += PANEL) {
                const int64_t np = OL - p0 < PANEL ? OL - p0 : PANEL, P8 = (np + 7) / 8 * 8;
                for (int64_t j = 0; j < R2; ++j) {
                    // the pair's two rows (a row past the depth reads zeros)
                    const int16_t* rows[4];
                    for (int64_t t = 0; t < 2; ++t) {
                        const int64_t r = 2 * j + t;
                        const int64_t at =
                            r < R ? (g * Cg + r / K) * Lp + (r % K) * dil + p0 * stride : 0;
                        rows[2 * t] = r < R ? qh.data() + at : zeros.data();
                        rows[2 * t + 1] = r < R ? ql.data() + at : zeros.data();
                    }
                    int16_t* ch = colh.data() + j * P8 * 2;
                    int16_t* cl = coll.data() + j * P8 * 2;
                    const int16_t *h0 = rows[0], *l0 = rows[1], *h1 = rows[2], *l1 = rows[3];
                    if (stride == 1) {  // interleaving two contiguous runs: vectorized
                        for (int64_t p = 0; p < np; ++p) {
                            ch[2 * p] = h0[p];
                            ch[2 * p + 1] = h1[p];
                            cl[2 * p] = l0[p];
                            cl[2 * p + 1] = l1[p];
                        }
                    } else {
                        for (int64_t p = 0; p < np; ++p) {
                            ch[2 * p] = h0[p * stride];
                            ch[2 * p + 1] = h1[p * stride];
                            cl[2 * p] = l0[p * stride];
                            cl[2 * p + 1] = l1[p * stride];
                        }
                    }
                    for (int64_t p = 2 * np; p < 2 * P8; ++p) ch[p] = cl[p] = 0;
                }
                qt::kernels.w16_panel(colh.data(), coll.data(), R2, P8, w + g * OCg * Rp, Rp, OCg,
                                      dsum.data());
                for (int64_t o = 0; o < OCg; ++o) {
                    const int64_t oo = g * OCg + o;
                    const float s = scale[oo];
                    const double* d = dsum.data() + o * P8;
                    float* dst = out + on * n + oc * oo + ol * p0;
                    const float b = bias ? bias[oo] : 0.0f;
                    if (ol == 1 && bias) {  // a contiguous row: vectorized
                        for (int64_t p = 0; p < np; ++p) dst[p] = static_cast<float>(d[p]) * s + b;
                    } else if (ol == 1) {
                        for (int64_t p = 0; p < np; ++p) dst[p] = static_cast<float>(d[p]) * s;
                    } else if (bias) {
                        for (int64_t p = 0; p < np; ++p)
                            dst[ol * p] = static_cast<float>(d[p]) * s + b;
                    } else {
                        for (int64_t p = 0; p < np; ++p) dst[ol * p] = static_cast<float>(d[p]) * s;
                    }
                }
            }
    }
}
QT_CATCH

}  // extern "C"
