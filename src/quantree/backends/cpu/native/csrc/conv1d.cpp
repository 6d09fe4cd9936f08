// 1-d convolution on [N, C, L] tensors of any strides, int8 or int16 (a float input
// quantized on the fly), through the same GEMM and packed weights as conv2d.
//
// Why not the conv2d of height 1: conv2d works in channels-last layout, and torch has no 3-d
// channels-last memory format, so between an int8 conv1d and a float op (group norm, PReLU,
// GELU: every 1-d model under WEIGHTED_INPUTS) torch copied each tensor to or from that layout
// (ConvTasNet: aten::copy_ 44% of the lowered model's aten time, 1.2x float). Here the input is
// read through its strides and the output written through its strides, in panels of output
// positions: each panel's input span is staged (uint8, per channel) and its GEMM result
// transposed while it is still in cache, so a contiguous [N, C, L] tensor goes in and comes out
// with no copy of the whole tensor.
//
// The arithmetic is conv2d's, term for term: the same im2col row (group-major, (tap, channel)
// order, zero-point padding, Kp zero padded), the same GEMM and epilogue, the depthwise sums
// in depthwise_pixels' order of float operations. An int16 input is conv16's two planes
// (hi = q >> 8 on zero point 0, lo = q & 255 on -128), the hi product written first and the lo
// product (which carries the bias) added to it, as conv16's out.add_(low): bit for bit.
#include <cstdint>
#include <cstring>
#include <vector>

#include "qt_kernels.h"
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

using qt::Epilogue;

namespace {

struct Conv1dArgs {
    const int8_t* x_q;  // int8 input, or null
    const float* x_f;   // float input quantized to int16 (wide), or null
    int64_t sn, sc, sl;  // input strides in elements
    int64_t batch, C, L, x_zp;
    float x_inv, qmin, qmax;  // wide: the int16 quantization
    int64_t OC, groups, K, stride, pad, dil, OL, Kp;
    const int8_t* w;  // groups packed one after the other, or [K][C] when depthwise
    const int32_t* off;  // int8: the offset; wide: the hi plane's
    const float* scale;
    const int32_t* lo_off;  // wide: the lo plane's (which also carries the bias)
    const float* lo_scale;
    const float* bias;  // of the only (int8) or the lo (wide) pass, or null
    int8_t* out_q;
    float* out_f;
    int64_t on, oc, ol;  // output strides in elements
    float inv, zp;
    int relu;
};

// Per channel int8 requantization, as layers.cpp's Requant: mult = scale / out_scale,
// add = bias / out_scale.
struct Requant {
    std::vector<float> mult, add;
    Requant(const float* scale, const float* bias, int64_t N, float inv)
        : mult(static_cast<size_t>(N)), add(static_cast<size_t>(N)) {
        for (int64_t n = 0; n < N; ++n) {
            mult[n] = scale[n] * inv;
            add[n] = bias ? bias[n] * inv : 0.0f;
        }
    }
};

// dst[j * ds + i] = src[i * ss + j] for i < rows, j < cols (bytes): the stage of an
// [N, C, L] input is made along L and turned to channels-last rows here, in 16 x 16 tiles
// (SSE2, part of every x86-64 CPU), where byte-by-byte strided stores cost ~1 ns each.
void transpose_bytes(const uint8_t* src, int64_t ss, int64_t rows, int64_t cols, uint8_t* dst,
                     int64_t ds) {
    int64_t i0 = 0;
#if defined(__x86_64__)
    for (; i0 + 16 <= rows; i0 += 16) {
        int64_t j0 = 0;
        for (; j0 + 16 <= cols; j0 += 16) {
            __m128i a[16], b[16];
            for (int k = 0; k < 16; ++k)
                a[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (i0 + k) * ss + j0));
            for (int k = 0; k < 8; ++k) {  // 16-bit lanes: rows 2k, 2k + 1 of one column
                b[2 * k] = _mm_unpacklo_epi8(a[2 * k], a[2 * k + 1]);
                b[2 * k + 1] = _mm_unpackhi_epi8(a[2 * k], a[2 * k + 1]);
            }
            for (int k = 0; k < 4; ++k) {  // 32-bit lanes: rows 4k..4k+3, columns 4m..4m+3
                a[4 * k] = _mm_unpacklo_epi16(b[4 * k], b[4 * k + 2]);
                a[4 * k + 1] = _mm_unpackhi_epi16(b[4 * k], b[4 * k + 2]);
                a[4 * k + 2] = _mm_unpacklo_epi16(b[4 * k + 1], b[4 * k + 3]);
                a[4 * k + 3] = _mm_unpackhi_epi16(b[4 * k + 1], b[4 * k + 3]);
            }
            for (int h = 0; h < 2; ++h)  // 64-bit lanes: rows 8h..8h+7, columns 2j, 2j + 1
                for (int m = 0; m < 4; ++m) {
                    b[8 * h + 2 * m] = _mm_unpacklo_epi32(a[8 * h + m], a[8 * h + 4 + m]);
                    b[8 * h + 2 * m + 1] = _mm_unpackhi_epi32(a[8 * h + m], a[8 * h + 4 + m]);
                }
            for (int j = 0; j < 8; ++j) {  // a column of 16 rows
                _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (j0 + 2 * j) * ds + i0),
                                 _mm_unpacklo_epi64(b[j], b[8 + j]));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (j0 + 2 * j + 1) * ds + i0),
                                 _mm_unpackhi_epi64(b[j], b[8 + j]));
            }
        }
        for (int64_t i = i0; i < i0 + 16; ++i)
            for (int64_t j = j0; j < cols; ++j) dst[j * ds + i] = src[i * ss + j];
    }
#endif
    for (int64_t i = i0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) dst[j * ds + i] = src[i * ss + j];
}

// dst[j * ds + i] = src[i * ss + j] for floats: a GEMM panel [rows][OC] into [OC][L], in
// 4 x 4 tiles (SSE, part of every x86-64 CPU).
void transpose_floats(const float* src, int64_t ss, int64_t rows, int64_t cols, float* dst,
                      int64_t ds) {
    int64_t i0 = 0;
#if defined(__x86_64__)
    for (; i0 + 4 <= rows; i0 += 4) {
        int64_t j0 = 0;
        for (; j0 + 4 <= cols; j0 += 4) {
            __m128 r0 = _mm_loadu_ps(src + i0 * ss + j0), r1 = _mm_loadu_ps(src + (i0 + 1) * ss + j0);
            __m128 r2 = _mm_loadu_ps(src + (i0 + 2) * ss + j0);
            __m128 r3 = _mm_loadu_ps(src + (i0 + 3) * ss + j0);
            _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
            _mm_storeu_ps(dst + j0 * ds + i0, r0);
            _mm_storeu_ps(dst + (j0 + 1) * ds + i0, r1);
            _mm_storeu_ps(dst + (j0 + 2) * ds + i0, r2);
            _mm_storeu_ps(dst + (j0 + 3) * ds + i0, r3);
        }
        for (int64_t i = i0; i < i0 + 4; ++i)
            for (int64_t j = j0; j < cols; ++j) dst[j * ds + i] = src[i * ss + j];
    }
#endif
    for (int64_t i = i0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) dst[j * ds + i] = src[i * ss + j];
}

// The input positions [p0, p0 + span) of batch n, every channel, as uint8 planes: position
// i of channel c at hi[i * dp + c * dc] (dp = 1: one row per channel, what the depthwise sums
// read; dc = 1: channels-last rows, what im2col copies in runs). x + 128 for int8 (the zero
// point outside the input), or the int16 value's hi + 128 and lo bytes for a float input (0
// outside: hi 128, lo 0). One pass over the input along its inner stride.
void stage(const Conv1dArgs& a, int64_t n, int64_t p0, int64_t span, int64_t dp, int64_t dc,
           uint8_t* hi, uint8_t* lo) {
    const bool wide = a.x_f != nullptr;
    const uint8_t pad_hi = wide ? 128 : static_cast<uint8_t>(a.x_zp + 128);
    const int64_t begin = p0 < 0 ? 0 : p0, end = p0 + span < a.L ? p0 + span : a.L;
    const int64_t inside = end > begin ? end - begin : 0;
    const int64_t before = inside ? begin - p0 : span;
    for (int64_t i = 0; i < span; ++i) {
        if (i == before) i += inside;
        if (i >= span) break;
        for (int64_t c = 0; c < a.C; ++c) {
            hi[i * dp + c * dc] = pad_hi;
            if (wide) lo[i * dp + c * dc] = 0;
        }
    }
    if (!inside) return;
    // along L (each channel's run of positions) when that is the inner stride, else along
    // the channels (each position's run of channels, a channels-last input)
    const bool along_l = a.sl <= a.sc || a.C == 1;
    const int64_t outer = along_l ? a.C : inside, inner = along_l ? inside : a.C;
    const int64_t s_inner = along_l ? a.sl : a.sc, d_inner = along_l ? dp : dc;
    for (int64_t o = 0; o < outer; ++o) {
        const int64_t src0 = a.sn * n + (along_l ? a.sc * o + a.sl * begin : a.sl * (begin + o));
        const int64_t dst0 = along_l ? o * dc + before * dp : (before + o) * dp;
        uint8_t* h = hi + dst0;
        if (s_inner == 1 && d_inner == 1) {  // contiguous both sides: vectorized
            if (wide) {
                const float* x = a.x_f + src0;
                uint8_t* l = lo + dst0;
                for (int64_t i = 0; i < inner; ++i) {
                    const int32_t q = static_cast<int32_t>(
                        qt::quantize_value(x[i], a.x_inv, 0.0f, a.qmin, a.qmax));
                    h[i] = static_cast<uint8_t>((q >> 8) + 128);
                    l[i] = static_cast<uint8_t>(q & 255);
                }
            } else {
                const int8_t* x = a.x_q + src0;
                for (int64_t i = 0; i < inner; ++i) h[i] = static_cast<uint8_t>(x[i] ^ 0x80);
            }
            continue;
        }
        if (wide) {
            uint8_t* l = lo + dst0;
            for (int64_t i = 0; i < inner; ++i) {
                const float v = a.x_f[src0 + s_inner * i];
                const int32_t q =
                    static_cast<int32_t>(qt::quantize_value(v, a.x_inv, 0.0f, a.qmin, a.qmax));
                h[d_inner * i] = static_cast<uint8_t>((q >> 8) + 128);
                l[d_inner * i] = static_cast<uint8_t>(q & 255);
            }
        } else {
            for (int64_t i = 0; i < inner; ++i)
                h[d_inner * i] = static_cast<uint8_t>(a.x_q[src0 + s_inner * i] ^ 0x80);
        }
    }
}

// Rows of the im2col from a channels-last stage of row stride C: row r, group g holds
// (tap, channel) of the group's channels at output position r of the panel, zero padded to
// Kp; a tap is a run of the group's channels, and without groups and dilation the taps of a
// row are one run.
void im2col(const Conv1dArgs& a, const uint8_t* st, int64_t rows, uint8_t* col) {
    const int64_t Cg = a.C / a.groups, lda = a.groups * a.Kp, Kg = a.K * Cg;
    const bool one_run = a.groups == 1 && a.dil == 1;
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* src = st + r * a.stride * a.C;
        uint8_t* dst = col + r * lda;
        for (int64_t g = 0; g < a.groups; ++g, dst += a.Kp) {
            if (one_run) {
                std::memcpy(dst, src, static_cast<size_t>(Kg));
            } else {
                for (int64_t t = 0; t < a.K; ++t)
                    std::memcpy(dst + t * Cg, src + t * a.dil * a.C + g * Cg,
                                static_cast<size_t>(Cg));
            }
            std::memset(dst + Kg, 0, static_cast<size_t>(a.Kp - Kg));
        }
    }
}

// Depthwise (one input and one output channel per group, weight [K][C]): the sum over taps
// of staged bytes times the weight plus `off`, then depthwise_pixels' epilogue, written
// straight to the output through its strides.
void depthwise(const Conv1dArgs& a, const Requant& rq, const uint8_t* hi, const uint8_t* lo,
               int64_t span, int64_t n, int64_t l0, int64_t rows, int32_t* acc, int32_t* acc2) {
    const bool wide = a.x_f != nullptr;
    const float qmin = a.relu && a.zp > -128.0f ? a.zp : -128.0f;
    for (int64_t c = 0; c < a.C; ++c) {
        const uint8_t* h = hi + c * span;
        for (int64_t r = 0; r < rows; ++r) acc[r] = a.off[c];
        for (int64_t t = 0; t < a.K; ++t) {
            const int32_t wt = a.w[t * a.C + c];
            const uint8_t* s = h + t * a.dil;
            if (a.stride == 1)
                for (int64_t r = 0; r < rows; ++r) acc[r] += static_cast<int32_t>(s[r]) * wt;
            else
                for (int64_t r = 0; r < rows; ++r)
                    acc[r] += static_cast<int32_t>(s[r * a.stride]) * wt;
        }
        if (wide) {
            const uint8_t* l = lo + c * span;
            for (int64_t r = 0; r < rows; ++r) acc2[r] = a.lo_off[c];
            for (int64_t t = 0; t < a.K; ++t) {
                const int32_t wt = a.w[t * a.C + c];
                const uint8_t* s = l + t * a.dil;
                if (a.stride == 1)
                    for (int64_t r = 0; r < rows; ++r) acc2[r] += static_cast<int32_t>(s[r]) * wt;
                else
                    for (int64_t r = 0; r < rows; ++r)
                        acc2[r] += static_cast<int32_t>(s[r * a.stride]) * wt;
            }
        }
        const int64_t base = a.on * n + a.oc * c + a.ol * l0;
        if (a.out_f) {
            float* out = a.out_f + base;
            const float sc = a.scale[c];
            if (a.ol == 1 && wide) {  // contiguous: vectorized
                const float ls = a.lo_scale[c], b = a.bias ? a.bias[c] : 0.0f;
                if (a.bias)
                    for (int64_t r = 0; r < rows; ++r)
                        out[r] = static_cast<float>(acc[r]) * sc +
                                 (static_cast<float>(acc2[r]) * ls + b);
                else
                    for (int64_t r = 0; r < rows; ++r)
                        out[r] = static_cast<float>(acc[r]) * sc + static_cast<float>(acc2[r]) * ls;
                continue;
            }
            for (int64_t r = 0; r < rows; ++r) {
                float y = static_cast<float>(acc[r]) * sc;
                if (wide) {
                    float y2 = static_cast<float>(acc2[r]) * a.lo_scale[c];
                    if (a.bias) y2 = y2 + a.bias[c];
                    y = y + y2;
                } else if (a.bias) {
                    y = y + a.bias[c];
                }
                out[a.ol * r] = y;
            }
        } else {
            int8_t* out = a.out_q + base;
            const float mult = rq.mult[c], add = rq.add[c];
            for (int64_t r = 0; r < rows; ++r) {
                float q = qt::round_even(static_cast<float>(acc[r]) * mult + add) + a.zp;
                q = q < qmin ? qmin : (q > 127.0f ? 127.0f : q);
                out[a.ol * r] = static_cast<int8_t>(q);
            }
        }
    }
}

}  // namespace

extern "C" {

// int8 (x_q) or int16-from-float (x_f) 1-d convolution, [N, C, L] -> [N, OC, OL], both of any
// strides (elements). Float output (out_f) or int8 (out_q, requantized with inv / zp / relu).
// The weight and offsets are what conv2d reads for the same layer: depthwise when
// groups == C == OC, else each group packed in turn with K ordered (tap, channel).
void qt_conv1d(const int8_t* x_q, const float* x_f, int64_t sn, int64_t sc, int64_t sl,
               int64_t batch, int64_t C, int64_t L, int64_t x_zp, float x_inv, float qmin,
               float qmax, int64_t OC, int64_t groups, int64_t K, int64_t stride, int64_t pad,
               int64_t dil, int64_t OL, int64_t Kp, const int8_t* w, const int32_t* off,
               const float* scale, const int32_t* lo_off, const float* lo_scale,
               const float* bias, int8_t* out_q, float* out_f, int64_t on, int64_t oc,
               int64_t ol, float inv, float zp, int relu) try {
    const Conv1dArgs a{x_q, x_f, sn, sc, sl, batch, C, L, x_zp, x_inv, qmin, qmax,
                       OC, groups, K, stride, pad, dil, OL, Kp, w, off, scale, lo_off,
                       lo_scale, bias, out_q, out_f, on, oc, ol, inv, zp, relu};
    if (batch <= 0 || OC <= 0 || OL <= 0) return;
    const bool wide = x_f != nullptr, dw = groups == C && C == OC;
    // the output's channels are adjacent: the GEMM writes rows straight into it
    const bool direct = oc == 1 && !dw;
    // a pointwise layer's stage is its im2col already (rows of C = Kp bytes)
    const bool pointwise = !dw && K == 1 && stride == 1 && groups == 1 && Kp == C;
    // panel: the scratch of a transposed GEMM result stays near 256 KB
    int64_t panel = dw || direct ? 256 : 65536 / OC;
    panel = panel < 16 ? 16 : (panel > 256 ? 256 : panel);
    panel = panel < OL ? panel : OL;
    const int64_t span_max = (panel - 1) * stride + (K - 1) * dil + 1;
    const int64_t lda = groups * Kp, OCg = OC / groups;
    const int64_t group_weight = (OCg + 15) / 16 * Kp * 16;
    std::vector<uint8_t> hi(static_cast<size_t>(C * span_max)), lo(wide ? hi.size() : 0);
    // an input whose positions are adjacent (contiguous [N, C, L]) is staged along them
    const bool along_l = !dw && C > 1 && sl < sc;
    std::vector<uint8_t> row_hi(along_l ? hi.size() : 0), row_lo(along_l ? lo.size() : 0);
    std::vector<uint8_t> col(dw || pointwise ? 0 : static_cast<size_t>(panel * lda));
    std::vector<uint8_t> col_lo(wide ? col.size() : 0);
    std::vector<float> scratch_f(!dw && !direct && out_f ? static_cast<size_t>(panel * OC) : 0);
    std::vector<int8_t> scratch_q(!dw && !direct && out_q ? static_cast<size_t>(panel * OC) : 0);
    std::vector<int32_t> acc(dw ? static_cast<size_t>(panel) : 0), acc2(acc.size());
    const Requant rq(scale, bias, OC, inv);
    for (int64_t n = 0; n < batch; ++n) {
        for (int64_t l0 = 0; l0 < OL; l0 += panel) {
            const int64_t rows = OL - l0 < panel ? OL - l0 : panel;
            const int64_t span = (rows - 1) * stride + (K - 1) * dil + 1;
            const int64_t p0 = l0 * stride - pad;
            if (dw) {
                stage(a, n, p0, span, 1, span, hi.data(), wide ? lo.data() : nullptr);
                depthwise(a, rq, hi.data(), lo.data(), span, n, l0, rows, acc.data(),
                          acc2.data());
                continue;
            }
            if (along_l) {  // along L into rows, then turned into channels-last rows
                stage(a, n, p0, span, 1, span, row_hi.data(), wide ? row_lo.data() : nullptr);
                transpose_bytes(row_hi.data(), span, C, span, hi.data(), C);
                if (wide) transpose_bytes(row_lo.data(), span, C, span, lo.data(), C);
            } else {
                stage(a, n, p0, span, C, 1, hi.data(), wide ? lo.data() : nullptr);
            }
            const uint8_t* A = hi.data();
            const uint8_t* A_lo = lo.data();
            if (!pointwise) {
                im2col(a, hi.data(), rows, col.data());
                if (wide) im2col(a, lo.data(), rows, col_lo.data());
                A = col.data();
                A_lo = col_lo.data();
            }
            const int64_t base = on * n + ol * l0;
            float* dst_f = out_f ? (direct ? out_f + base : scratch_f.data()) : nullptr;
            int8_t* dst_q = out_q ? (direct ? out_q + base : scratch_q.data()) : nullptr;
            const int64_t ldc = direct ? ol : OC;
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t c0 = g * OCg;
                Epilogue ep{off + c0, scale + c0, nullptr, dst_f ? dst_f + c0 : nullptr,
                            dst_q ? dst_q + c0 : nullptr, ldc, inv, zp, -128.0f, 127.0f};
                if (relu) ep.qmin = zp > -128.0f ? zp : -128.0f;
                if (!wide) {
                    ep.bias = bias ? bias + c0 : nullptr;
                    if (dst_q) {
                        ep.mult = rq.mult.data() + c0;
                        ep.add = rq.add.data() + c0;
                    }
                }
                const int8_t* wg = w + g * group_weight;
                qt::gemm_u8s8(rows, OCg, Kp, A + g * Kp, lda, wg, ep);
                if (wide) {  // conv16's low plane, added to the high plane's product
                    Epilogue lo_ep = ep;
                    lo_ep.off = lo_off + c0;
                    lo_ep.scale = lo_scale + c0;
                    lo_ep.bias = bias ? bias + c0 : nullptr;
                    lo_ep.accumulate = true;
                    qt::gemm_u8s8(rows, OCg, Kp, A_lo + g * Kp, lda, wg, lo_ep);
                }
            }
            if (direct) continue;
            if (out_f && ol == 1) {  // the panel, transposed into the output
                transpose_floats(scratch_f.data(), OC, rows, OC, out_f + base, oc);
                continue;
            }
            for (int64_t c = 0; c < OC; ++c) {
                const int64_t o = base + oc * c;
                if (out_f)
                    for (int64_t r = 0; r < rows; ++r)
                        out_f[o + ol * r] = scratch_f[static_cast<size_t>(r * OC + c)];
                else
                    for (int64_t r = 0; r < rows; ++r)
                        out_q[o + ol * r] = scratch_q[static_cast<size_t>(r * OC + c)];
            }
        }
    }
} QT_CATCH

}  // extern "C"
