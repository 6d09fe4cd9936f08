// int8 transposed convolution (1-d as 2-d of height 1) on a channels-last input: per panel of
// input pixels and per group, the GEMM of the pixels' channels against the packed weight gives
// every (tap, output channel) contribution of each pixel, which is scattered into an int32
// accumulator at the output pixel the tap reaches (col2im); bias and requantization (or the
// float output) run once per output element at the end, as conv's epilogue does.
//
// Why a scatter and not a convolution of the zero-stuffed input: the stuffed zeros are
// stride^2 of the multiplications of a 2-d layer (stride 8 in a vocoder's upsampler: 7 of 8).
// Why GEMM output in float: the shared micro-kernels (one per ISA, one packed layout) end in
// conv's epilogue and have no int32 output. With scale 1, no bias and the zero-point correction
// as the offset, that float is sum_k (x - zp) * w exactly while |sum| < 2^24: each term is at
// most 255 * 127 in magnitude, so the reduction runs in chunks of CHUNK input channels
// (512 * 255 * 127 < 2^24), each packed on its own and added in int32. The result is the
// exact integer accumulation, whatever path ran the GEMM.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "qt_kernels.h"

namespace {

constexpr int64_t CHUNK = 512;  // input channels a GEMM reduces over at most (see above)
constexpr int64_t PANEL = 128;  // input pixels a GEMM takes at once
constexpr int64_t BLOCK = 256;  // GEMM columns (tap, output channel) written at once

struct Geometry {
    int64_t C, H, W, OC, groups, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW;
};

// The tap each GEMM column group belongs to: (th, tw) of tap t = th * KW + tw, so the scatter
// divides nothing per row.
struct Taps {
    std::vector<int64_t> h, w;
    explicit Taps(const Geometry& g)
        : h(static_cast<size_t>(g.KH * g.KW)), w(static_cast<size_t>(g.KH * g.KW)) {
        for (int64_t t = 0; t < g.KH * g.KW; ++t) {
            h[static_cast<size_t>(t)] = t / g.KW;
            w[static_cast<size_t>(t)] = t % g.KW;
        }
    }
};

// acc[j] += cols[j] for a run of n columns: the GEMM wrote exact integers, so the conversion
// is exact and its order irrelevant (a plain loop the compiler vectorizes).
inline void add_run(int32_t* __restrict dst, const float* __restrict src, int64_t n) {
    for (int64_t j = 0; j < n; ++j) dst[j] += static_cast<int32_t>(src[j]);
}

// Add the float columns [n0, n0 + nb) of `rows` input pixels (from pixel p0 of the image) to
// the int32 accumulator [OH, OW, OC] of the image; columns are (tap, output channel of group
// g), the exact integers the GEMM wrote.
//
// With one group and dilation 1 along the width, the taps of one kernel row land on
// consecutive output pixels, so their columns (kw, output channel) are one contiguous run in
// both the columns and the accumulator: per input pixel and kernel row, the run's valid part
// (the taps inside the output) is found by arithmetic and added in one loop. With few output
// channels a tap is a run of two or four, and walking the taps one by one, not the
// additions, was the kernel's cost.
void scatter(const Geometry& g, const Taps& taps, int64_t grp, const float* cols, int64_t ldc,
             int64_t p0, int64_t rows, int64_t n0, int64_t nb, int32_t* acc) {
    const int64_t OCg = g.OC / g.groups;
    int64_t ih = p0 / g.W, iw = p0 % g.W;
    if (g.groups == 1 && g.dw == 1) {
        const int64_t row_cols = g.KW * g.OC;  // the columns of one kernel row
        const int64_t th_first = n0 / row_cols, th_last = (n0 + nb - 1) / row_cols;
        for (int64_t r = 0; r < rows; ++r) {
            const float* src_row = cols + r * ldc - n0;
            const int64_t ow0 = iw * g.sw - g.pw;
            const int64_t tw_lo = ow0 < 0 ? -ow0 : 0;
            const int64_t tw_hi = g.OW - ow0 < g.KW ? g.OW - ow0 : g.KW;
            for (int64_t th = th_first; th <= th_last && tw_lo < tw_hi; ++th) {
                const int64_t oh = ih * g.sh - g.ph + th * g.dh;
                if (oh < 0 || oh >= g.OH) continue;
                const int64_t c0 = th * row_cols;
                const int64_t lo = std::max<int64_t>(n0, c0 + tw_lo * g.OC);
                const int64_t hi = std::min<int64_t>(n0 + nb, c0 + tw_hi * g.OC);
                if (lo < hi)
                    add_run(acc + (oh * g.OW + ow0) * g.OC + (lo - c0), src_row + lo, hi - lo);
            }
            if (++iw == g.W) {
                iw = 0;
                ++ih;
            }
        }
        return;
    }
    const int64_t t_first = n0 / OCg, t_last = (n0 + nb - 1) / OCg;
    for (int64_t r = 0; r < rows; ++r) {
        const float* src_row = cols + r * ldc;
        for (int64_t t = t_first; t <= t_last; ++t) {
            const int64_t oh = ih * g.sh - g.ph + taps.h[static_cast<size_t>(t)] * g.dh;
            const int64_t ow = iw * g.sw - g.pw + taps.w[static_cast<size_t>(t)] * g.dw;
            if (oh < 0 || oh >= g.OH || ow < 0 || ow >= g.OW) continue;
            const int64_t j0 = std::max<int64_t>(n0, t * OCg) - t * OCg;
            const int64_t j1 = std::min<int64_t>(n0 + nb, (t + 1) * OCg) - t * OCg;
            add_run(acc + (oh * g.OW + ow) * g.OC + grp * OCg + j0, src_row + t * OCg - n0 + j0,
                    j1 - j0);
        }
        if (++iw == g.W) {
            iw = 0;
            ++ih;
        }
    }
}

// One output pixel's OC channels (at stride oc): (acc + off) * scale (+ bias).
void epilogue_float(const int32_t* acc, const int32_t* off, const float* scale,
                    const float* bias, int64_t OC, float* out, int64_t oc) {
    for (int64_t o = 0; o < OC; ++o) {
        float y = static_cast<float>(acc[o] + off[o]) * scale[o];
        if (bias) y += bias[o];
        out[o * oc] = y;
    }
}

// The same requantized as conv's int8 epilogue: round((acc + off) * mult + add) + zp, clamped.
void epilogue_int8(const int32_t* acc, const int32_t* off, const float* mult, const float* add,
                   int64_t OC, float zp, float qmin, int8_t* out, int64_t oc) {
    for (int64_t o = 0; o < OC; ++o) {
        float q = qt::round_even(static_cast<float>(acc[o] + off[o]) * mult[o] + add[o]) + zp;
        q = q < qmin ? qmin : (q > 127.0f ? 127.0f : q);
        out[o * oc] = static_cast<int8_t>(q);
    }
}

// Output pixels [0, pixels) of an image whose output is dense in the accumulator's order
// (channels innermost, pixel after pixel: an int8 result, a 2-d float one), written as one
// flat run. The per-channel arrays are repeated to a whole number of pixels of at least 64
// elements, so the inner loop is a plain elementwise one over contiguous arrays whatever
// the channel count (two channels per pixel made a loop of two). Each element's float
// operations are epilogue_int8's / epilogue_float's, in the same order.
struct Flat {
    int64_t width;  // elements a repeat holds: whole pixels, at least 64
    std::vector<int32_t> off;
    std::vector<float> a, b;  // int8: mult, add; float: scale, bias
    Flat(int64_t OC, const int32_t* off_, const float* a_, const float* b_) {
        width = OC * ((64 + OC - 1) / OC);
        off.resize(static_cast<size_t>(width));
        a.resize(off.size());
        b.resize(off.size());
        for (int64_t j = 0; j < width; ++j) {
            const int64_t o = j % OC;
            off[static_cast<size_t>(j)] = off_[o];
            a[static_cast<size_t>(j)] = a_[o];
            b[static_cast<size_t>(j)] = b_ ? b_[o] : 0.0f;
        }
    }
};

void flat_int8(const Flat& f, const int32_t* __restrict acc, int64_t n, float zp, float qmin,
               int8_t* __restrict out) {
    const int32_t* __restrict off = f.off.data();
    const float* __restrict mult = f.a.data();
    const float* __restrict add = f.b.data();
    for (int64_t base = 0; base < n; base += f.width) {
        const int64_t m = n - base < f.width ? n - base : f.width;
        for (int64_t j = 0; j < m; ++j) {
            float q = qt::round_even(static_cast<float>(acc[base + j] + off[j]) * mult[j] +
                                     add[j]) +
                      zp;
            q = q < qmin ? qmin : (q > 127.0f ? 127.0f : q);
            out[base + j] = static_cast<int8_t>(q);
        }
    }
}

void flat_float(const Flat& f, bool bias, const int32_t* __restrict acc, int64_t n,
                float* __restrict out) {
    const int32_t* __restrict off = f.off.data();
    const float* __restrict scale = f.a.data();
    const float* __restrict add = f.b.data();
    for (int64_t base = 0; base < n; base += f.width) {
        const int64_t m = n - base < f.width ? n - base : f.width;
        if (bias)
            for (int64_t j = 0; j < m; ++j)
                out[base + j] = static_cast<float>(acc[base + j] + off[j]) * scale[j] + add[j];
        else
            for (int64_t j = 0; j < m; ++j)
                out[base + j] = static_cast<float>(acc[base + j] + off[j]) * scale[j];
    }
}

// A float result whose channels are rows of pixels (the 1-d [N, O, L] layout): channel by
// channel, the pixels written contiguously.
void rows_float(const int32_t* acc, const int32_t* off, const float* scale, const float* bias,
                int64_t OC, int64_t pixels, float* out, int64_t oc) {
    for (int64_t o = 0; o < OC; ++o) {
        float* __restrict dst = out + o * oc;
        const int32_t k = off[o];
        const float s = scale[o];
        if (bias) {
            const float b = bias[o];
            for (int64_t p = 0; p < pixels; ++p)
                dst[p] = static_cast<float>(acc[p * OC + o] + k) * s + b;
        } else {
            for (int64_t p = 0; p < pixels; ++p)
                dst[p] = static_cast<float>(acc[p * OC + o] + k) * s;
        }
    }
}

// The scatter-GEMM loop shared by the int8 and the int16 (two byte plane) forms: per image,
// panel of input pixels, group and chunk of input channels, `fill` writes each plane's uint8
// GEMM operand (rows x Kp, as to_u8 writes an int8 input), the GEMM of plane i with column
// offsets col_off[i] is scattered into accumulator i, and once the image is summed `finish`
// writes its output from the accumulators.
template <int Planes, class Fill, class Finish>
void transposed(const Geometry& g, int64_t batch, const int8_t* w,
                const int32_t* const (&col_off)[Planes], Fill fill, Finish finish) {
    const int64_t Cg = g.C / g.groups, OCg = g.OC / g.groups, N = g.KH * g.KW * OCg;
    const int64_t P = g.H * g.W;
    const int64_t chunks = Cg > 0 ? (Cg + CHUNK - 1) / CHUNK : 0;
    const int64_t Np = (N + 15) / 16 * 16;
    const int64_t panel = P < PANEL ? P : PANEL;
    std::vector<int32_t> acc[Planes];
    for (auto& a : acc) a.resize(static_cast<size_t>(g.OH * g.OW * g.OC));
    const int64_t Kp_max = (std::min<int64_t>(Cg, CHUNK) + 3) / 4 * 4;
    std::vector<uint8_t> a[Planes];
    uint8_t* ap[Planes];
    for (int i = 0; i < Planes; ++i) {
        a[i].resize(static_cast<size_t>(panel * Kp_max));
        ap[i] = a[i].data();
    }
    const int64_t ldc = N < BLOCK ? N : BLOCK;
    std::vector<float> cols(static_cast<size_t>(panel * ldc));
    const std::vector<float> ones(static_cast<size_t>(N), 1.0f);
    const Taps taps(g);
    for (int64_t n = 0; n < batch; ++n) {
        for (auto& v : acc) std::fill(v.begin(), v.end(), 0);
        for (int64_t p0 = 0; p0 < P; p0 += panel) {
            const int64_t rows = P - p0 < panel ? P - p0 : panel;
            const int8_t* wg = w;
            int64_t og = 0;
            for (int64_t grp = 0; grp < g.groups; ++grp) {
                for (int64_t k = 0; k < chunks; ++k) {
                    const int64_t Kc = std::min<int64_t>(CHUNK, Cg - k * CHUNK);
                    const int64_t Kp = (Kc + 3) / 4 * 4;
                    fill(n, p0, rows, grp * Cg + k * CHUNK, Kc, Kp, ap);
                    for (int i = 0; i < Planes; ++i)
                        for (int64_t n0 = 0; n0 < N; n0 += BLOCK) {
                            const int64_t nb = N - n0 < BLOCK ? N - n0 : BLOCK;
                            qt::Epilogue ep{col_off[i] + og + n0, ones.data() + n0, nullptr,
                                            cols.data(), nullptr, ldc, 0.0f, 0.0f, -128.0f, 127.0f};
                            qt::gemm_u8s8(rows, nb, Kp, ap[i], Kp, wg + n0 * Kp, ep);
                            scatter(g, taps, grp, cols.data(), ldc, p0, rows, n0, nb,
                                    acc[i].data());
                        }
                    wg += Np * Kp;
                    og += N;
                }
            }
        }
        finish(n, acc);
    }
}

}  // namespace

extern "C" {

// x: int8 [N, H, W, C] dense (channels-last; a 1-d input is H = 1). The weight holds, group
// after group, each chunk of at most CHUNK input channels packed on its own (qt_kernels.h's
// layout) as the [KH * KW * OCg, Kc] matrix whose rows are ordered (kh, kw, output channel);
// col_off holds, in the same order, the zero-point correction of each chunk's columns
// (-(x_zp + 128) * the column's weight sum). Output element (n, o, oh, ow), at element strides
// (on, oc, oh_s, ow_s), is (acc + out_off[o]) * scale[o] (+ bias[o]) as float, or requantized
// to int8 (inv, zp, relu) as conv's epilogue does: round((acc + off) * (scale / s_out) +
// bias / s_out) + zp. (ph, pw) is the padding torch removes at the output's start; OH and OW
// include any output_padding.
void qt_conv_transpose(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
                       int64_t OC, int64_t groups, int64_t KH, int64_t KW, int64_t sh,
                       int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t OH,
                       int64_t OW, const int8_t* w, const int32_t* col_off,
                       const int32_t* out_off, const float* scale, const float* bias,
                       int8_t* out_q, float* out_f, int64_t on, int64_t oc, int64_t oh_s,
                       int64_t ow_s, float inv, float zp, int relu) try {
    const Geometry g{C, H, W, OC, groups, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW};
    if (batch <= 0 || OC <= 0 || OH <= 0 || OW <= 0) return;
    const int64_t P = H * W;
    const float qmin = relu ? (zp > -128.0f ? zp : -128.0f) : -128.0f;
    std::vector<float> mult(static_cast<size_t>(OC)), add(mult.size());
    for (int64_t o = 0; o < OC; ++o) {  // conv's Requant (layers.cpp)
        mult[o] = scale[o] * inv;
        add[o] = bias ? bias[o] * inv : 0.0f;
    }
    const Flat flat = out_f ? Flat(OC, out_off, scale, bias) : Flat(OC, out_off, mult.data(), add.data());
    const int32_t* const offs[1] = {col_off};
    const auto fill = [&](int64_t n, int64_t p0, int64_t rows, int64_t c0, int64_t Kc,
                          int64_t Kp, uint8_t* const* a) {
        qt::to_u8(x + (n * P + p0) * C + c0, rows, Kc, C, a[0], Kp);
    };
    const auto finish = [&](int64_t n, const std::vector<int32_t>(&accs)[1]) {
        const std::vector<int32_t>& acc = accs[0];
        int8_t* const image_q = out_q ? out_q + n * on : nullptr;
        float* const image_f = out_f ? out_f + n * on : nullptr;
        if (oc == 1 && ow_s == OC && (OH == 1 || oh_s == OW * OC)) {  // dense, channels innermost
            if (out_f)
                flat_float(flat, bias != nullptr, acc.data(), OH * OW * OC, image_f);
            else
                flat_int8(flat, acc.data(), OH * OW * OC, zp, qmin, image_q);
            return;
        }
        if (out_f && OH == 1 && ow_s == 1) {  // the 1-d float layout [N, O, L]
            rows_float(acc.data(), out_off, scale, bias, OC, OW, image_f, oc);
            return;
        }
        for (int64_t oh = 0; oh < OH; ++oh)
            for (int64_t ow = 0; ow < OW; ++ow) {
                const int32_t* src = acc.data() + (oh * OW + ow) * OC;
                const int64_t base = oh * oh_s + ow * ow_s;
                if (out_f)
                    epilogue_float(src, out_off, scale, bias, OC, image_f + base, oc);
                else
                    epilogue_int8(src, out_off, mult.data(), add.data(), OC, zp, qmin,
                                  image_q + base, oc);
            }
    };
    transposed<1>(g, batch, w, offs, fill, finish);
} QT_CATCH

// The int16-input form in one call: float x [N, C, H, W] (any element strides sn, sc, sh_, sw_;
// a 1-d input is H = 1) quantized to int16 q = clamp(round(x * x_inv), qmin, qmax) as the two
// byte planes hi = q >> 8 (zero point 0, column offsets hi_col_off) and lo = (q & 255) - 128
// (zero point -128, lo_col_off), each summed exactly as qt_conv_transpose sums an int8 input,
// on one weight. Float out: float(acc_hi) * hi_scale[o] + (float(acc_lo + out_off[o]) *
// scale[o] (+ bias[o])), the float operations of the two int8 calls' float results added
// (what the two-call route computed), so the two are equal bit for bit.
void qt_conv_transpose16(const float* x, int64_t sn, int64_t sc, int64_t sxh, int64_t sxw,
                         int64_t batch, int64_t C, int64_t H, int64_t W, float x_inv, float qmin,
                         float qmax, int64_t OC, int64_t groups, int64_t KH, int64_t KW,
                         int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                         int64_t OH, int64_t OW, const int8_t* w, const int32_t* hi_col_off,
                         const int32_t* lo_col_off, const int32_t* out_off,
                         const float* hi_scale, const float* scale, const float* bias,
                         float* out, int64_t on, int64_t oc, int64_t oh_s, int64_t ow_s) try {
    const Geometry g{C, H, W, OC, groups, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW};
    if (batch <= 0 || OC <= 0 || OH <= 0 || OW <= 0) return;
    const int32_t* const offs[2] = {hi_col_off, lo_col_off};
    const auto fill = [&](int64_t n, int64_t p0, int64_t rows, int64_t c0, int64_t Kc,
                          int64_t Kp, uint8_t* const* a) {
        uint8_t* __restrict hi = a[0];
        uint8_t* __restrict lo = a[1];
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t k = Kc; k < Kp; ++k) hi[r * Kp + k] = lo[r * Kp + k] = 0;
        int64_t ih = p0 / W, iw = p0 % W;
        for (int64_t r = 0; r < rows; ++r) {  // pixel by pixel: runs along a row of the image
            const float* src = x + sn * n + sxh * ih + sxw * iw + sc * c0;
            for (int64_t k = 0; k < Kc; ++k) {
                const int32_t q =
                    static_cast<int32_t>(qt::quantize_value(src[sc * k], x_inv, 0.0f, qmin, qmax));
                hi[r * Kp + k] = static_cast<uint8_t>((q >> 8) + 128);
                lo[r * Kp + k] = static_cast<uint8_t>(q & 255);
            }
            if (++iw == W) {
                iw = 0;
                ++ih;
            }
        }
    };
    const auto finish = [&](int64_t n, const std::vector<int32_t>(&accs)[2]) {
        const int32_t* ah = accs[0].data();
        const int32_t* al = accs[1].data();
        float* const image = out + n * on;
        for (int64_t o = 0; o < OC; ++o) {
            const float s_hi = hi_scale[o], s_lo = scale[o], b = bias ? bias[o] : 0.0f;
            const int32_t k = out_off[o];
            float* dst = image + o * oc;
            for (int64_t oh = 0; oh < OH; ++oh) {
                const int32_t* h = ah + oh * OW * OC + o;
                const int32_t* l = al + oh * OW * OC + o;
                float* d = dst + oh * oh_s;
                if (bias)
                    for (int64_t ow = 0; ow < OW; ++ow)
                        d[ow * ow_s] = static_cast<float>(h[ow * OC]) * s_hi +
                                       (static_cast<float>(l[ow * OC] + k) * s_lo + b);
                else
                    for (int64_t ow = 0; ow < OW; ++ow)
                        d[ow * ow_s] = static_cast<float>(h[ow * OC]) * s_hi +
                                       static_cast<float>(l[ow * OC] + k) * s_lo;
            }
        }
    };
    transposed<2>(g, batch, w, offs, fill, finish);
} QT_CATCH

}  // extern "C"
