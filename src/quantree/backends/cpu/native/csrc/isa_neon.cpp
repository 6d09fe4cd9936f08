// aarch64 NEON path without the dot-product extension (-march=armv8-a): int8 x int8
// products widened to int16 (`smull`, exact: at most 128 * 128), pairs added into int32
// (`sadalp`). Also the recurrent gate math and float activations of both aarch64 paths
// (ASIMD is part of every aarch64 CPU). Only reached through qt::kernels on aarch64.
#if defined(__aarch64__)
#include "qt_neon.h"
#include "qt_neon_math.h"

namespace qt {
namespace {

struct WideningDot {
    // acc[i][c] = sum_k x[i][k] w[c][k] over one block (16 columns = 4 registers of 4 x 4).
    template <int MR>
    static void rows(const int8_t* X, int64_t lda, const int8_t* b, int64_t kq,
                     int32_t (*acc)[16]) {
        int32x4_t lo[MR][4], hi[MR][4];
        for (int i = 0; i < MR; ++i)
            for (int q = 0; q < 4; ++q) lo[i][q] = hi[i][q] = vdupq_n_s32(0);
        for (int64_t k = 0; k < kq; ++k) {
            int8x16_t bv[4];
            for (int q = 0; q < 4; ++q) bv[q] = vld1q_s8(b + k * 64 + 16 * q);
            for (int i = 0; i < MR; ++i) {
                int32_t four;
                __builtin_memcpy(&four, X + i * lda + 4 * k, 4);
                const int8x8_t a = vreinterpret_s8_s32(vdup_n_s32(four));
                for (int q = 0; q < 4; ++q) {
                    lo[i][q] = vpadalq_s16(lo[i][q], vmull_s8(vget_low_s8(bv[q]), a));
                    hi[i][q] = vpadalq_s16(hi[i][q], vmull_s8(vget_high_s8(bv[q]), a));
                }
            }
        }
        // lo: lanes (c0 k01, c0 k23, c1 k01, c1 k23); hi: the same for c2, c3
        for (int i = 0; i < MR; ++i)
            for (int q = 0; q < 4; ++q)
                vst1q_s32(acc[i] + 4 * q, vpaddq_s32(lo[i][q], hi[i][q]));
    }
};

}  // namespace

void gemm_neon(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    gemm_neon_any<WideningDot>(M, N, Kp, A, lda, B, ep, A_lo);
}

namespace {

using neon_math::vsig;
using neon_math::vtanh;

// m (1..4) floats; the lanes past m read as 0.
inline float32x4_t load4(const float* p, int64_t m) {
    if (m == 4) return vld1q_f32(p);
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t i = 0; i < m; ++i) t[i] = p[i];
    return vld1q_f32(t);
}
inline void store4(float* p, float32x4_t v, int64_t m) {
    if (m == 4) return vst1q_f32(p, v);
    float t[4];
    vst1q_f32(t, v);
    for (int64_t i = 0; i < m; ++i) p[i] = t[i];
}
// quantize_value lane by lane: round half to even (vrndnq, what nearbyintf does in the
// default rounding mode), plus the zero point, clamped; then the offset the caller stores.
inline int32x4_t vquant(float32x4_t v, float inv, float zp, float lo, float hi, float offset) {
    float32x4_t q = vaddq_f32(vrndnq_f32(vmulq_f32(v, vdupq_n_f32(inv))), vdupq_n_f32(zp));
    q = vminq_f32(vmaxq_f32(q, vdupq_n_f32(lo)), vdupq_n_f32(hi));
    return vcvtq_s32_f32(vaddq_f32(q, vdupq_n_f32(offset)));
}
template <typename T>
inline void store_bytes(T* p, int32x4_t v, int64_t m) {
    int32_t t[4];
    vst1q_s32(t, v);
    for (int64_t i = 0; i < m; ++i) p[i] = static_cast<T>(t[i]);
}

}  // namespace

// Gate math of one batch row (qt::CellFn): the x86 vector paths' arithmetic, 4 lanes at a time.
void cell_neon(const RnnStep& s, const float* gx, const float* gh, float* h, float* c,
               uint8_t* hu8, int8_t* y, float* yf, float* raw) {
    const int64_t H = s.H;
    for (int64_t j = 0; j < H; j += 4) {
        const int64_t m = H - j < 4 ? H - j : 4;
        auto pre = [&](int64_t g) { return vaddq_f32(load4(gx + g * H + j, m), load4(gh + g * H + j, m)); };
        float32x4_t hv;
        if (s.kind == LSTM) {
            const float32x4_t i = vsig(pre(0)), f = vsig(pre(1)), g = vtanh(pre(2)), o = vsig(pre(3));
            const float32x4_t cv = vfmaq_f32(vmulq_f32(i, g), f, load4(c + j, m));
            store4(c + j, cv, m);
            hv = vmulq_f32(o, vtanh(cv));
            if (raw) {
                store4(raw + j, hv, m);
                continue;
            }
        } else if (s.kind == GRU) {
            const float32x4_t r = vsig(pre(0)), z = vsig(pre(1));
            const float32x4_t n =
                vtanh(vfmaq_f32(load4(gx + 2 * H + j, m), r, load4(gh + 2 * H + j, m)));
            hv = vfmaq_f32(n, z, vsubq_f32(load4(h + j, m), n));
        } else if (s.kind == RNN_TANH) {
            hv = vtanh(pre(0));
        } else {
            hv = vmaxq_f32(pre(0), vdupq_n_f32(0.0f));
        }
        store4(h + j, hv, m);
        if (s.lo_offset) {
            const int32x4_t q = vquant(hv, s.h_inv, 0.0f, -32768.0f, 32767.0f, 0.0f);
            store_bytes(hu8 + j, vaddq_s32(vshrq_n_s32(q, 8), vdupq_n_s32(128)), m);
            store_bytes(hu8 + s.lo_offset + j, vandq_s32(q, vdupq_n_s32(255)), m);
        } else {
            store_bytes(hu8 + j, vquant(hv, s.h_inv, s.h_zp, -128.0f, 127.0f, 128.0f), m);
        }
        if (yf)
            store4(yf + j, hv, m);
        else
            store_bytes(y + j, vquant(hv, s.y_inv, s.y_zp, -128.0f, 127.0f, 0.0f), m);
    }
}

void activation_neon(int kind, const float* a, float* out, int64_t n) {
    for (int64_t j = 0; j < n; j += 4) {
        const int64_t m = n - j < 4 ? n - j : 4;
        const float32x4_t x = load4(a + j, m);
        store4(out + j, kind == 0 ? vsig(x) : vtanh(x), m);
    }
}

}  // namespace qt
#endif
