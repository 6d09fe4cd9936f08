// C entry points for linear, conv2d (grouped, depthwise), matmul, elementwise ops and softmax
// on int8 activations and packed int8 weights.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "qt_kernels.h"
#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || defined(__AVX2__)
#include <immintrin.h>
#endif

using qt::Epilogue;

// Per-channel requantization of an int8 output: mult = scale / out_scale and
// add = bias / out_scale (the zero point is added after rounding, as the reference does).
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

// The epilogue of a GEMM writing output channels c0, c0 + 1, ... of rows of stride ldc (one
// group of a grouped convolution): every per-channel array is read from c0 on.
static Epilogue make_epilogue(const int32_t* off, const float* scale, const float* bias,
                              float* out_f, int8_t* out_q, int64_t ldc, float inv, float zp,
                              int relu, const Requant* rq, int64_t c0 = 0) {
    Epilogue ep{off + c0, scale + c0, bias ? bias + c0 : nullptr, out_f ? out_f + c0 : nullptr,
                out_q ? out_q + c0 : nullptr, ldc, inv, zp, -128.0f, 127.0f};
    if (relu) ep.qmin = zp > -128.0f ? zp : -128.0f;
    if (out_q && rq) {
        ep.mult = rq->mult.data() + c0;
        ep.add = rq->add.data() + c0;
    }
    return ep;
}

struct ConvGeometry {
    int64_t C, H, W, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW;

    // Where each tap (kh, kw) of output pixel p reads in an NHWC input, -1 in the padding.
    void taps(int64_t p, int64_t* offset) const {
        const int64_t n = p / (OH * OW), oh = (p / OW) % OH, ow = p % OW;
        const int64_t ih0 = oh * sh - ph, iw0 = ow * sw - pw;
        for (int64_t i = 0; i < KH; ++i) {
            const int64_t ih = ih0 + i * dh;
            for (int64_t j = 0; j < KW; ++j) {
                const int64_t iw = iw0 + j * dw;
                const bool inside = ih >= 0 && ih < H && iw >= 0 && iw < W;
                offset[i * KW + j] = inside ? ((n * H + ih) * W + iw) * C : -1;
            }
        }
    }
};

// dst = src + 128 (int8 -> uint8) for n bytes, in 8-byte words: a group's few channels
// per tap are too short for the vectorized byte loop, whose set-up then dominates.
static inline void flip_copy(uint8_t* dst, const int8_t* src, int64_t n) {
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        uint64_t word;
        std::memcpy(&word, src + c, 8);
        word ^= 0x8080808080808080ull;
        std::memcpy(dst + c, &word, 8);
    }
    for (; c < n; ++c) dst[c] = static_cast<uint8_t>(src[c] ^ 0x80);
}

// dst = src ^ flip for n >= 8 bytes, in 8-byte words, the last one ending at n (it overlaps
// the one before): nothing outside [0, n) is read or written, so a kernel row can be copied
// without checking the input's end or leaving a spill for the next copy to rewrite.
static inline void copy_words(uint8_t* dst, const void* src, int64_t n, uint64_t flip) {
    const char* s = static_cast<const char*>(src);
    uint64_t w;
    for (int64_t c = 0; c + 8 < n; c += 8) {
        std::memcpy(&w, s + c, 8);
        w ^= flip;
        std::memcpy(dst + c, &w, 8);
    }
    std::memcpy(&w, s + n - 8, 8);
    w ^= flip;
    std::memcpy(dst + n - 8, &w, 8);
}

// One pixel's kernel row at a border: tap by tap, the zero point where a tap falls outside
// (pad_src: C bytes or more that flip to it; a fill loop of a few bytes became a libc call).
static inline void border_taps(uint8_t* dst, const int8_t* line, int64_t iw0, int64_t W,
                               int64_t KW, int64_t C, const int8_t* pad_src) {
    for (int64_t j = 0; j < KW; ++j) {
        const int64_t iw = iw0 + j;
        flip_copy(dst + j * C, iw < 0 || iw >= W ? pad_src : line + iw * C, C);
    }
}

// im2col without groups and with unit horizontal dilation: the KW taps of a kernel row that
// lies inside the input are KW * C consecutive bytes of the NHWC input, copied at once (a
// first layer with 3 channels otherwise pays per 3-byte tap). The pixels of one output row
// are taken together: its interior pixels (whose kernel rows lie inside horizontally) one
// kernel row at a time, a loop of word copies with nothing to decide per pixel, and its
// border pixels tap by tap. The first convolution of the small CNN (9-byte kernel rows,
// 8192 pixels at batch 8) spent a third of its time here when each pixel's position was
// stepped, checked and copied on its own.
static void im2col_rows(const int8_t* x, const ConvGeometry& g, int64_t p0, int64_t rows,
                        uint8_t pad, uint8_t* col, int64_t Kp) {
    const int64_t run = g.KW * g.C, K = g.KH * run;
    const uint64_t flip = 0x8080808080808080ull;
    // interior pixels q: q sw - pw >= 0 and q sw - pw + KW <= W
    const int64_t q_lo = (g.pw + g.sw - 1) / g.sw;
    const int64_t q_hi = g.W - g.KW + g.pw >= 0 ? (g.W - g.KW + g.pw) / g.sw + 1 : 0;
    // the zero point, as input bytes (copied like the input: fill loops become libc calls)
    const std::vector<int8_t> pads(static_cast<size_t>(run), static_cast<int8_t>(pad ^ 0x80));
    int64_t n = p0 / (g.OH * g.OW), oh = (p0 / g.OW) % g.OH, ow = p0 % g.OW;
    for (int64_t r = 0; r < rows;) {
        // the pixels ow .. ow + span - 1 of output row (n, oh), at col rows r ..
        const int64_t span = rows - r < g.OW - ow ? rows - r : g.OW - ow;
        const int64_t ih0 = oh * g.sh - g.ph;
        const int8_t* image = x + n * g.H * g.W * g.C;
        const int64_t a = std::max(ow, std::min(q_lo, ow + span));
        const int64_t b = std::max(a, std::min(q_hi, ow + span));
        if (Kp > K)  // the row's zero padding (at most 3 bytes) first: the copies overwrite
            for (int64_t q = 0; q < span; ++q) {  // all but it (Kp >= 4)
                const uint32_t zero = 0;
                std::memcpy(col + (r + q) * Kp + Kp - 4, &zero, 4);
            }
        for (int64_t i = 0; i < g.KH; ++i) {
            const int64_t ih = ih0 + i * g.dh;
            const bool inside = ih >= 0 && ih < g.H;
            const int8_t* line = inside ? image + ih * g.W * g.C : nullptr;
            uint8_t* dst = col + (r + a - ow) * Kp + i * run;
            if (run >= 8) {  // the interior, one word loop
                if (!inside) {
                    for (int64_t q = a; q < b; ++q, dst += Kp) copy_words(dst, pads.data(), run, flip);
                } else if (run <= 16) {  // two words, no loop per pixel (3-channel inputs)
                    const int8_t* src = line + (a * g.sw - g.pw) * g.C;
                    for (int64_t q = a; q < b; ++q, dst += Kp, src += g.sw * g.C) {
                        uint64_t w0, w1;
                        std::memcpy(&w0, src, 8);
                        std::memcpy(&w1, src + run - 8, 8);
                        w0 ^= flip;
                        w1 ^= flip;
                        std::memcpy(dst, &w0, 8);
                        std::memcpy(dst + run - 8, &w1, 8);
                    }
                } else {
                    const int8_t* src = line + (a * g.sw - g.pw) * g.C;
                    for (int64_t q = a; q < b; ++q, dst += Kp, src += g.sw * g.C)
                        copy_words(dst, src, run, flip);
                }
            } else {
                for (int64_t q = a; q < b; ++q, dst += Kp)
                    flip_copy(dst, inside ? line + (q * g.sw - g.pw) * g.C : pads.data(), run);
            }
            for (int64_t q = ow; q < ow + span; ++q) {  // the border pixels
                if (q == a) q = b;
                if (q >= ow + span) break;
                uint8_t* at = col + (r + q - ow) * Kp + i * run;
                if (inside)
                    border_taps(at, line, q * g.sw - g.pw, g.W, g.KW, g.C, pads.data());
                else
                    flip_copy(at, pads.data(), run);
            }
        }
        r += span;
        ow += span;
        if (ow == g.OW) {
            ow = 0;
            if (++oh == g.OH) {
                oh = 0;
                ++n;
            }
        }
    }
}

// Rows [p0, p0 + rows) of the channels-last im2col, group-major: row r holds, for each
// group in turn, (kh, kw, c) of its Cg channels at output pixel p0 + r as uint8 (x + 128),
// zero padded to Kp; padding taps read the zero point. One GEMM per group then reads its
// own Kp columns of every row (row stride groups * Kp).
static void im2col(const int8_t* x, const int8_t* x_end, const ConvGeometry& g, int64_t groups,
                   int64_t p0, int64_t rows, uint8_t pad, uint8_t* col, int64_t Kp) {
    const int64_t taps = g.KH * g.KW, Cg = g.C / groups, K = taps * Cg;
    if (groups == 1 && g.dw == 1) {  // a kernel row inside the input is one contiguous run
        im2col_rows(x, g, p0, rows, pad, col, Kp);
        return;
    }
    std::vector<int64_t> offset(static_cast<size_t>(taps));
    for (int64_t r = 0; r < rows; ++r) {
        g.taps(p0 + r, offset.data());
        uint8_t* dst = col + r * groups * Kp;
        for (int64_t gi = 0; gi < groups; ++gi) {
            for (int64_t t = 0; t < taps; ++t, dst += Cg) {
                if (offset[t] < 0) {
                    std::memset(dst, pad, static_cast<size_t>(Cg));
                    continue;
                }
                const int8_t* src = x + offset[t] + gi * Cg;
                if (Cg <= 4 && src + 4 <= x_end) {  // one word; the spill is rewritten next
                    uint32_t word;
                    std::memcpy(&word, src, 4);
                    word ^= 0x80808080u;
                    std::memcpy(dst, &word, 4);
                    continue;
                }
                flip_copy(dst, src, Cg);
            }
            std::memset(dst, 0, static_cast<size_t>(Kp - K));
            dst += Kp - K;
        }
    }
}

// Output pixels of a depthwise conv: for each channel, the sum over taps of (x + 128) * w
// plus `off`, requantized as the GEMM epilogue does (same float operations in the same
// order, so the result equals the grouped GEMM's bit for bit). src[r * taps + t] is where
// tap t of pixel r reads its C channels; outputs have row stride C.
struct Depthwise {
    int64_t taps, C;
    const int8_t* w;  // [taps][C]
    const int32_t* off;
    const float* scale;
    const float* bias;
    const Requant& rq;
    float zp, qmin;
};

// Channels c0.. one at a time: the portable build's whole loop, the AVX2 build's last block of
// fewer than 8 channels.
[[maybe_unused]] static void depthwise_channels(const Depthwise& d, const int8_t* const* src,
                                                int64_t rows, int64_t c0, int8_t* out_q,
                                                float* out_f) {
    for (int64_t r = 0; r < rows; ++r) {
        const int8_t* const* s = src + r * d.taps;
        for (int64_t c = c0; c < d.C; ++c) {
            int32_t acc = d.off[c];
            for (int64_t t = 0; t < d.taps; ++t)
                acc += static_cast<int32_t>(static_cast<uint8_t>(s[t][c] ^ 0x80)) *
                       d.w[t * d.C + c];
            const float v = static_cast<float>(acc);
            if (out_f) {
                const float y = v * d.scale[c];
                out_f[r * d.C + c] = d.bias ? y + d.bias[c] : y;
                continue;
            }
            float q = qt::round_even(v * d.rq.mult[c] + d.rq.add[c]) + d.zp;
            q = q < d.qmin ? d.qmin : (q > 127.0f ? 127.0f : q);
            out_q[r * d.C + c] = static_cast<int8_t>(q);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

// Channels in vectors of 16: a block's weights are widened to int32 once for all pixels.
static void depthwise_pixels(const Depthwise& d, const int8_t* const* src, int64_t rows,
                             int8_t* out_q, float* out_f) {
    std::vector<int32_t> w32(static_cast<size_t>(d.taps * 16));
    const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
    for (int64_t c0 = 0; c0 < d.C; c0 += 16) {
        const int64_t n = d.C - c0 < 16 ? d.C - c0 : 16;
        const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
        for (int64_t t = 0; t < d.taps; ++t)
            _mm512_storeu_si512(w32.data() + t * 16, _mm512_cvtepi8_epi32(
                                                         _mm_maskz_loadu_epi8(m, d.w + t * d.C + c0)));
        const __m512i off = _mm512_maskz_loadu_epi32(m, d.off + c0);
        const __m512 mult = _mm512_maskz_loadu_ps(m, d.rq.mult.data() + c0);
        const __m512 add = _mm512_maskz_loadu_ps(m, d.rq.add.data() + c0);
        for (int64_t r = 0; r < rows; ++r) {
            const int8_t* const* s = src + r * d.taps;
            __m512i acc = off;
            for (int64_t t = 0; t < d.taps; ++t) {
                const __m128i xs = _mm_xor_si128(_mm_maskz_loadu_epi8(m, s[t] + c0), flip);
                const __m512i wt = _mm512_loadu_si512(w32.data() + t * 16);
                acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(xs), wt));
            }
            const __m512 v = _mm512_cvtepi32_ps(acc);
            if (out_f) {
                __m512 y = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, d.scale + c0));
                if (d.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, d.bias + c0));
                _mm512_mask_storeu_ps(out_f + r * d.C + c0, m, y);
                continue;
            }
            __m512 q = _mm512_add_ps(_mm512_mul_ps(v, mult), add);
            q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_add_ps(q, _mm512_set1_ps(d.zp));
            q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(d.qmin)), _mm512_set1_ps(127.0f));
            _mm512_mask_cvtsepi32_storeu_epi8(out_q + r * d.C + c0, m, _mm512_cvtps_epi32(q));
        }
    }
}

#elif defined(__AVX2__)

// The AVX-512 path's arithmetic 8 channels at a time (the x86-64-v3 library); a last block of
// fewer than 8 channels takes the one-channel loop below. Without it GCC kept the portable
// loop scalar (taps innermost), and depthwise convs made an image model slower than float
// on AVX2 CPUs (benchmarks/README.md, "AVX2 depthwise").
static void depthwise_pixels(const Depthwise& d, const int8_t* const* src, int64_t rows,
                             int8_t* out_q, float* out_f) {
    std::vector<int32_t> w32(static_cast<size_t>(d.taps * 8));
    const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
    const int64_t full = d.C - d.C % 8;
    for (int64_t c0 = 0; c0 < full; c0 += 8) {
        for (int64_t t = 0; t < d.taps; ++t)
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(w32.data() + t * 8),
                _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(d.w + t * d.C + c0))));
        const __m256i off = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d.off + c0));
        const __m256 mult = _mm256_loadu_ps(d.rq.mult.data() + c0);
        const __m256 add = _mm256_loadu_ps(d.rq.add.data() + c0);
        for (int64_t r = 0; r < rows; ++r) {
            const int8_t* const* s = src + r * d.taps;
            __m256i acc = off;
            for (int64_t t = 0; t < d.taps; ++t) {
                const __m128i xs = _mm_xor_si128(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s[t] + c0)), flip);
                const __m256i wt =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w32.data() + t * 8));
                acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(xs), wt));
            }
            const __m256 v = _mm256_cvtepi32_ps(acc);
            if (out_f) {
                __m256 y = _mm256_mul_ps(v, _mm256_loadu_ps(d.scale + c0));
                if (d.bias) y = _mm256_add_ps(y, _mm256_loadu_ps(d.bias + c0));
                _mm256_storeu_ps(out_f + r * d.C + c0, y);
                continue;
            }
            __m256 q = _mm256_add_ps(_mm256_mul_ps(v, mult), add);
            q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm256_add_ps(q, _mm256_set1_ps(d.zp));
            q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(d.qmin)), _mm256_set1_ps(127.0f));
            const __m256i q32 = _mm256_cvtps_epi32(q);  // integral, in [-128, 127]
            const __m128i q16 =
                _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(out_q + r * d.C + c0),
                             _mm_packs_epi16(q16, q16));
        }
    }
    if (full < d.C) depthwise_channels(d, src, rows, full, out_q, out_f);
}

#else  // portable: the same arithmetic, one channel at a time

static void depthwise_pixels(const Depthwise& d, const int8_t* const* src, int64_t rows,
                             int8_t* out_q, float* out_f) {
    depthwise_channels(d, src, rows, 0, out_q, out_f);
}

#endif

// The rows of an int8 or int16 table (qt_embedding_rows*): indices checked first.
template <typename T>
int64_t embedding_rows(const T* table, int64_t rows, int64_t cols, const int64_t* idx, int64_t n,
                       const float* scale, const int32_t* zp, float* out) {
    for (int64_t i = 0; i < n; ++i)
        if (idx[i] < 0 || idx[i] >= rows) return i;
    for (int64_t i = 0; i < n; ++i) {
        const T* row = table + idx[i] * cols;
        const float s = scale[idx[i]];
        const int32_t z = zp[idx[i]];
        float* o = out + i * cols;
        for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<float>(row[j] - z) * s;
    }
    return -1;
}

extern "C" {

// y[M, N] = x[M, K] (int8) . W^T; int8 output when out_f is null, else float.
void qt_linear(const int8_t* x, int64_t M, int64_t K, int64_t N, int64_t Kp, const int8_t* w,
               const int32_t* off, const float* scale, const float* bias, int8_t* out_q,
               float* out_f, float inv, float zp, int relu) try {
    std::vector<uint8_t> a(static_cast<size_t>(M * Kp));
    qt::to_u8(x, M, K, K, a.data(), Kp);
    const Requant rq(scale, bias, N, inv);
    const Epilogue ep = make_epilogue(off, scale, bias, out_f, out_q, N, inv, zp, relu, &rq);
    // 7-bit weights proven only where a path has a GEMM for them and the product has rows
    // enough (a GEMV would read the weight twice: once to prove it, once to multiply)
    const bool w7 = M > 2 && qt::kernels.gemm_w7 && qt::within7(w, (N + 15) / 16 * 16 * Kp);
    qt::gemm_u8s8(M, N, Kp, a.data(), Kp, w, ep, nullptr, nullptr, w7);
} QT_CATCH

// int8 grouped conv on NHWC (channels-last) tensors: for each panel of output pixels, the
// group-major im2col, then one GEMM per group of its packed weight, written straight into
// the group's columns of the NHWC output. The weight holds the groups one after the other,
// each packed with K ordered (kh, kw, c) and padded to Kp. (ph, pw) is the padding before
// the input; OH and OW may imply a different padding after it (asymmetric 'same'): the
// kernel reads the zero point wherever a tap falls outside.
void qt_conv2d_grouped(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
                       int64_t x_zp, int64_t OC, int64_t groups, int64_t KH, int64_t KW,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t OH, int64_t OW, int64_t Kp, const int8_t* w, const int32_t* off,
                       const float* scale, const float* bias, int8_t* out_q, float* out_f,
                       float inv, float zp, int relu) try {
    const ConvGeometry g{C, H, W, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW};
    const int64_t P = batch * OH * OW, OCg = OC / groups, lda = groups * Kp, panel = 256;
    const int64_t group_weight = (OCg + 15) / 16 * Kp * 16;
    const uint8_t pad = static_cast<uint8_t>(x_zp + 128);
    // not zero filled: im2col writes every byte of the rows it fills (their padding included)
    std::unique_ptr<uint8_t[]> col(new uint8_t[static_cast<size_t>((P < panel ? P : panel) * lda + 8)]);
    const Requant rq(scale, bias, OC, inv);
    // fewer than 16 output channels a group: every group's products at once (conv_narrow.cpp)
    const bool narrow = groups > 1 && OCg < 16;
    std::vector<uint8_t> narrow_w;
    std::vector<int32_t> narrow_acc;
    if (narrow) {
        narrow_w.resize(static_cast<size_t>(
            qt::kernels.narrow_prepare(w, groups, OCg, Kp, group_weight, nullptr)));
        qt::kernels.narrow_prepare(w, groups, OCg, Kp, group_weight, narrow_w.data());
        narrow_acc.resize(static_cast<size_t>((P < panel ? P : panel) * OC));
    }
    // Each group's weight prepared once for the whole call (the AVX2 path's int16 panels;
    // nothing on paths that read the packed bytes as they are). Unprepared, every GEMM below
    // widens all of it again, and within a GEMM once per L2-sized panel of rows: for a large
    // map, dozens of passes over the weight per call. A weight whose int16 copy is larger
    // than kPreparedMax is left to the GEMM: that copy, twice the bytes, would stream from
    // beyond L2 for every panel of rows, where widening the int8 bytes in L1 as they are
    // read costs less (resnet18's 512-channel convs, benchmarks/README.md, h-cnn26). A map of
    // one panel of pixels (P <= panel) widens each weight once anyway: the copy would only
    // add an allocation and a pass (mobilenet_v2's small late maps).
    constexpr int64_t kPreparedMax = int64_t{3} << 19;  // 1.5 MiB
    // 7-bit weights (a reduced-range recipe), proven once per call from the bytes: on the
    // AVX2 path their GEMM reads the packed bytes as they are (isa_avx2_w7.cpp), nothing to
    // prepare. One pass over the weight, less than the preparation it replaces.
    const bool w7 = !narrow && qt::kernels.gemm_w7 && P > 2 &&
                    qt::within7(w, groups * group_weight);
    std::vector<std::unique_ptr<qt::PreparedB>> prepared;
    if (!narrow && !w7 && qt::kernels.prepare && P > panel &&
        2 * group_weight * groups <= kPreparedMax)
        for (int64_t gi = 0; gi < groups; ++gi)
            prepared.push_back(std::make_unique<qt::PreparedB>(
                w + gi * group_weight, OCg, Kp, P < panel ? P : panel));
    for (int64_t p0 = 0; p0 < P; p0 += panel) {
        const int64_t rows = P - p0 < panel ? P - p0 : panel;
        im2col(x, x + batch * H * W * C, g, groups, p0, rows, pad, col.get(), Kp);
        if (narrow) {
            qt::kernels.narrow(narrow_w.data(), rows, groups, OCg, Kp, col.get(), lda,
                               narrow_acc.data());
            qt::kernels.rows_epilogue(
                make_epilogue(off, scale, bias, out_f ? out_f + p0 * OC : nullptr,
                              out_q ? out_q + p0 * OC : nullptr, OC, inv, zp, relu, &rq),
                narrow_acc.data(), rows, OC);
            continue;
        }
        for (int64_t gi = 0; gi < groups; ++gi) {
            const Epilogue ep =
                make_epilogue(off, scale, bias, out_f ? out_f + p0 * OC : nullptr,
                              out_q ? out_q + p0 * OC : nullptr, OC, inv, zp, relu, &rq,
                              gi * OCg);
            qt::gemm_u8s8(rows, OCg, Kp, col.get() + gi * Kp, lda, w + gi * group_weight, ep,
                          nullptr, prepared.empty() ? nullptr : prepared[gi].get(), w7);
        }
    }
} QT_CATCH

// The same with groups = 1 (the entry point of the first release).
void qt_conv2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W, int64_t x_zp,
               int64_t OC, int64_t KH, int64_t KW, int64_t sh, int64_t sw, int64_t ph,
               int64_t pw, int64_t dh, int64_t dw, int64_t OH, int64_t OW, int64_t Kp,
               const int8_t* w, const int32_t* off, const float* scale, const float* bias,
               int8_t* out_q, float* out_f, float inv, float zp, int relu) try {
    qt_conv2d_grouped(x, batch, C, H, W, x_zp, OC, 1, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW,
                      Kp, w, off, scale, bias, out_q, out_f, inv, zp, relu);
} QT_CATCH

// int8 depthwise conv (groups = C = OC) on NHWC tensors: one output channel per input
// channel, so instead of GEMMs of one column per group, panels of output pixels accumulate
// their taps over vectors of 16 channels. Weight [KH*KW][C]; the input is read as x + 128
// and padding as the zero point, so `off` is the GEMM's int32 correction.
void qt_conv2d_depthwise(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
                         int64_t x_zp, int64_t KH, int64_t KW, int64_t sh, int64_t sw,
                         int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t OH, int64_t OW,
                         const int8_t* w, const int32_t* off, const float* scale,
                         const float* bias, int8_t* out_q, float* out_f, float inv, float zp,
                         int relu) try {
    const ConvGeometry g{C, H, W, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW};
    const int64_t taps = KH * KW, P = batch * OH * OW, panel = 64;
    const std::vector<int8_t> pad(static_cast<size_t>(C), static_cast<int8_t>(x_zp));
    std::vector<int64_t> offset(static_cast<size_t>(taps));
    std::vector<const int8_t*> src(static_cast<size_t>(panel * taps));
    const Requant rq(scale, bias, C, inv);
    const float qmin = relu && zp > -128.0f ? zp : -128.0f;
    const Depthwise d{taps, C, w, off, scale, bias, rq, zp, qmin};
    for (int64_t p0 = 0; p0 < P; p0 += panel) {
        const int64_t rows = P - p0 < panel ? P - p0 : panel;
        for (int64_t r = 0; r < rows; ++r) {
            g.taps(p0 + r, offset.data());
            for (int64_t t = 0; t < taps; ++t)
                src[r * taps + t] = offset[t] < 0 ? pad.data() : x + offset[t];
        }
        depthwise_pixels(d, src.data(), rows, out_q ? out_q + p0 * C : nullptr,
                         out_f ? out_f + p0 * C : nullptr);
    }
} QT_CATCH

// y[M, N] = q16(x[M, K]) . W^T, float out: x quantized to int16 (zero point 0) as two uint8
// planes, multiplied in one dual pass over W (the accumulator is 256 * (hi.W + off) + lo.W,
// see gemm_u8s8), on the input scale x the weight's; off = -128 sum_k w undoes the hi plane's
// +128. The bias is float (the int32 bias's exact grid would need off / 256).
void qt_linear16(const float* x, int64_t M, int64_t K, int64_t N, int64_t Kp, const int8_t* w,
                 const int32_t* off, const float* scale, const float* bias, float* out,
                 float inv, float qmin, float qmax) try {
    std::vector<uint8_t> planes(static_cast<size_t>(2 * M * Kp));
    uint8_t* lo = planes.data() + M * Kp;
    qt::split16_rows(x, M, K, K, inv, qmin, qmax, planes.data(), lo, Kp);
    const Epilogue ep{off, scale, bias, out, nullptr, N, 0.0f, 0.0f, -128.0f, 127.0f};
    qt::gemm_u8s8(M, N, Kp, planes.data(), Kp, w, ep, lo);
} QT_CATCH

// Batched int8 activation x activation matmul: c[b] = (a[b] - za) . (w[b] - zb), both
// operands dynamic. Each b[b] ([K, N]) is packed on the fly; the zero point of b becomes a
// per-row correction -zb * sum_k (a - za).
void qt_matmul(const int8_t* a, const int8_t* bmat, int64_t batch, int64_t M, int64_t K,
               int64_t N, float za, float zb, float scale, int8_t* out_q, float* out_f,
               float inv, float zp) try {
    const int64_t Kp = (K + 3) / 4 * 4, NB = (N + 15) / 16;
    std::vector<uint8_t> au(static_cast<size_t>(M * Kp));
    std::vector<int8_t> packed(static_cast<size_t>(NB * Kp * 16), 0);
    std::vector<int32_t> off(static_cast<size_t>(N)), row(static_cast<size_t>(M));
    const std::vector<float> scales(static_cast<size_t>(N), scale);
    const Requant rq(scales.data(), nullptr, N, inv);
    const int32_t ia = static_cast<int32_t>(za), ib = static_cast<int32_t>(zb);
    for (int64_t t = 0; t < batch; ++t) {
        const int8_t* at = a + t * M * K;
        const int8_t* bt = bmat + t * K * N;
        qt::to_u8(at, M, K, K, au.data(), Kp);
        for (int64_t m = 0; m < M; ++m) {
            int32_t s = 0;
            for (int64_t k = 0; k < K; ++k) s += at[m * K + k] - ia;
            row[m] = -ib * s;
        }
        for (int64_t n = 0; n < N; ++n) {
            int32_t s = 0;
            for (int64_t k = 0; k < K; ++k) s += bt[k * N + n];
            off[n] = -(ia + 128) * s;
        }
        for (int64_t k = 0; k < K; ++k)
            for (int64_t n = 0; n < N; ++n)
                packed[((n / 16) * (Kp / 4) + k / 4) * 64 + (n % 16) * 4 + k % 4] = bt[k * N + n];
        Epilogue ep = make_epilogue(off.data(), scales.data(), nullptr,
                                    out_f ? out_f + t * M * N : nullptr,
                                    out_q ? out_q + t * M * N : nullptr, N, inv, zp, 0, &rq);
        ep.row_off = row.data();
        qt::gemm_u8s8(M, N, Kp, au.data(), Kp, packed.data(), ep);
    }
} QT_CATCH

// quantize_per_tensor / dequantize_per_tensor of quantized_decomposed, int8 [-128, 127]:
// q = clamp(round_half_even(x * inv) + zp), x = (q - zp) * scale, in float32.
void qt_quantize(const float* x, int64_t n, float inv, float zp, int8_t* out) try {
    for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<int8_t>(qt::quantize_value(x[i], inv, zp, -128.0f, 127.0f));
} QT_CATCH

// float -> int16 q = clamp(round(x * inv), qmin, qmax) (zero point 0, as the symmetric int16
// reference quantize), written as two int8 planes hi = q >> 8 and lo = (q & 255) - 128, so that
// q = 256 * hi + (lo + 128): each plane is an int8 tensor the int8 kernels read exactly (hi on
// zero point 0, lo on zero point -128), and their two products sum to the 16-bit one.
void qt_split16(const float* x, int64_t n, float inv, float qmin, float qmax, int8_t* hi,
                int8_t* lo) try {
    for (int64_t i = 0; i < n; ++i) {
        const int32_t q = static_cast<int32_t>(qt::quantize_value(x[i], inv, 0.0f, qmin, qmax));
        hi[i] = static_cast<int8_t>(q >> 8);
        lo[i] = static_cast<int8_t>((q & 255) - 128);
    }
} QT_CATCH

void qt_dequantize(const int8_t* q, int64_t n, float scale, float zp, float* out) try {
    for (int64_t i = 0; i < n; ++i) out[i] = (static_cast<float>(q[i]) - zp) * scale;
} QT_CATCH

// Rows idx[0..n) of an int8 [rows, cols] table, each dequantized on its own grid, as
// ``(row - zp[r]) * scale[r]`` in int32 then float, the reference's arithmetic. One call
// instead of the five ATen ops (gather, two index lookups, sub, mul) an unrolled decoder paid
// at every step. Returns the position of the first index out of range (nothing written),
// or -1.
int64_t qt_embedding_rows(const int8_t* table, int64_t rows, int64_t cols, const int64_t* idx,
                          int64_t n, const float* scale, const int32_t* zp, float* out) {
    return embedding_rows(table, rows, cols, idx, n, scale, zp, out);
}

// As qt_embedding_rows, for an int16 table (a transformer's token table, whose rows are read
// in float: 8-bit rows were its largest error). The fallback it replaces, five ATen ops on
// the gathered rows, cost an int16 lookup twice an int8 one.
int64_t qt_embedding_rows16(const int16_t* table, int64_t rows, int64_t cols,
                            const int64_t* idx, int64_t n, const float* scale, const int32_t* zp,
                            float* out) {
    return embedding_rows(table, rows, cols, idx, n, scale, zp, out);
}

// Elementwise add (op 0), mul (op 1) or sub (op 2) of two int8 tensors, each dequantized exactly as the
// reference does, combined in float, requantized: one pass instead of four ATen chains.
void qt_binary(int op, const int8_t* a, const int8_t* b, int64_t n, float sa, float za, float sb,
               float zb, float inv, float zp, int8_t* out) try {
    for (int64_t i = 0; i < n; ++i) {
        const float x = (static_cast<float>(a[i]) - za) * sa;
        const float y = (static_cast<float>(b[i]) - zb) * sb;
        const float r = op == 0 ? x + y : (op == 1 ? x * y : x - y);
        out[i] = static_cast<int8_t>(qt::quantize_value(r, inv, zp, -128.0f, 127.0f));
    }
} QT_CATCH

// out[i] = table[x[i] + 128]: any pointwise int8 -> int8 function, tabulated at lowering.
void qt_lookup(const int8_t* x, int64_t n, const int8_t* table, int8_t* out) try {
    qt::kernels.lookup(table, x, out, n);
} QT_CATCH

// Softmax over the last dimension of int8 rows: exp(x_i - max x) depends only on the code
// difference max q - q_i (0..255), so exp_table[d] = exp(-d * scale) is computed once at
// lowering; each row is then a max, table lookups, a sum and a requantization.
void qt_softmax(const int8_t* x, int64_t rows, int64_t cols, const float* exp_table, float inv,
                float zp, int8_t* out) try {
    std::vector<float> e(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
        const int8_t* row = x + r * cols;
        int32_t top = -128;
        for (int64_t c = 0; c < cols; ++c) top = row[c] > top ? row[c] : top;
        float sum = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
            e[c] = exp_table[top - row[c]];
            sum += e[c];
        }
        const float recip = 1.0f / sum;
        for (int64_t c = 0; c < cols; ++c)
            out[r * cols + c] =
                static_cast<int8_t>(qt::quantize_value(e[c] * recip, inv, zp, -128.0f, 127.0f));
    }
} QT_CATCH

}  // extern "C"
