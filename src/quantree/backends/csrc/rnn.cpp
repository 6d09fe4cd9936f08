// One recurrent layer and direction (LSTM, GRU, RNN tanh/relu) as a single compiled loop.
//
// The input projection of all time steps is one int8 GEMM; each step then runs one int8
// GEMM(V) of the hidden state (requantized to int8 with a fixed scale) against W_hh and the
// gate math in float. The cell state and the float hidden state never leave the kernel.
#include <cmath>
#include <vector>

#include "qt_kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

enum Kind { LSTM = 0, GRU = 1, RNN_TANH = 2, RNN_RELU = 3 };

struct Step {
    int kind;
    int64_t H;
    float h_inv, h_zp, y_inv, y_zp;
};

#if defined(__AVX512F__)
inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
inline __m512 vsig(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
inline __m512 vtanh(__m512 x) {
    const __m512 s = vsig(_mm512_add_ps(x, x));
    return _mm512_sub_ps(_mm512_add_ps(s, s), _mm512_set1_ps(1.0f));
}
inline __m512i vquant(__m512 h, float inv, float zp) {
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(h, _mm512_set1_ps(inv)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_add_ps(q, _mm512_set1_ps(zp));
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
    return _mm512_cvtps_epi32(q);
}

// Gate math of one batch row; gx/gh hold the G*H pre-activations, h/c the float states.
void cell(const Step& s, const float* gx, const float* gh, float* h, float* c, uint8_t* hu8,
          int8_t* y) {
    const int64_t H = s.H;
    for (int64_t j = 0; j < H; j += 16) {
        const __mmask16 m = H - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                        : static_cast<__mmask16>((1u << (H - j)) - 1u);
        auto pre = [&](int64_t g) {
            return _mm512_add_ps(_mm512_maskz_loadu_ps(m, gx + g * H + j),
                                 _mm512_maskz_loadu_ps(m, gh + g * H + j));
        };
        __m512 hv;
        if (s.kind == LSTM) {
            const __m512 i = vsig(pre(0)), f = vsig(pre(1)), g = vtanh(pre(2)), o = vsig(pre(3));
            const __m512 cv = _mm512_fmadd_ps(f, _mm512_maskz_loadu_ps(m, c + j),
                                              _mm512_mul_ps(i, g));
            _mm512_mask_storeu_ps(c + j, m, cv);
            hv = _mm512_mul_ps(o, vtanh(cv));
        } else if (s.kind == GRU) {
            const __m512 r = vsig(pre(0)), z = vsig(pre(1));
            const __m512 n = vtanh(_mm512_fmadd_ps(r, _mm512_maskz_loadu_ps(m, gh + 2 * H + j),
                                                   _mm512_maskz_loadu_ps(m, gx + 2 * H + j)));
            const __m512 prev = _mm512_maskz_loadu_ps(m, h + j);
            hv = _mm512_fmadd_ps(z, _mm512_sub_ps(prev, n), n);
        } else if (s.kind == RNN_TANH) {
            hv = vtanh(pre(0));
        } else {
            hv = _mm512_max_ps(pre(0), _mm512_setzero_ps());
        }
        _mm512_mask_storeu_ps(h + j, m, hv);
        const __m512i hq = _mm512_add_epi32(vquant(hv, s.h_inv, s.h_zp), _mm512_set1_epi32(128));
        _mm512_mask_cvtusepi32_storeu_epi8(hu8 + j, m, hq);
        _mm512_mask_cvtsepi32_storeu_epi8(y + j, m, vquant(hv, s.y_inv, s.y_zp));
    }
}
#else
inline float sig(float x) { return 1.0f / (1.0f + std::exp(-x)); }

void cell(const Step& s, const float* gx, const float* gh, float* h, float* c, uint8_t* hu8,
          int8_t* y) {
    const int64_t H = s.H;
    for (int64_t j = 0; j < H; ++j) {
        auto pre = [&](int64_t g) { return gx[g * H + j] + gh[g * H + j]; };
        float hv;
        if (s.kind == LSTM) {
            c[j] = sig(pre(1)) * c[j] + sig(pre(0)) * std::tanh(pre(2));
            hv = sig(pre(3)) * std::tanh(c[j]);
        } else if (s.kind == GRU) {
            const float r = sig(pre(0)), z = sig(pre(1));
            const float n = std::tanh(gx[2 * H + j] + r * gh[2 * H + j]);
            hv = n + z * (h[j] - n);
        } else if (s.kind == RNN_TANH) {
            hv = std::tanh(pre(0));
        } else {
            hv = pre(0) > 0.0f ? pre(0) : 0.0f;
        }
        h[j] = hv;
        hu8[j] = static_cast<uint8_t>(
            qt::quantize_value(hv, s.h_inv, s.h_zp, -128.0f, 127.0f) + 128.0f);
        y[j] = static_cast<int8_t>(qt::quantize_value(hv, s.y_inv, s.y_zp, -128.0f, 127.0f));
    }
}
#endif

}  // namespace

extern "C" {

// x: int8 [T*B, K] time-major; y: int8 rows of stride y_ld (already offset to this
// direction's columns); h/c: float [B, H] initial states, overwritten by the final ones.
void qt_rnn_layer(int kind, int64_t T, int64_t B, int64_t K, int64_t H, int reverse,
                  const int8_t* x, const int8_t* w_ih, int64_t kp_ih, const int32_t* off_ih,
                  const float* sc_ih, const float* b_ih, const int8_t* w_hh, int64_t kp_hh,
                  const int32_t* off_hh, const float* sc_hh, const float* b_hh, float h_inv,
                  float h_zp, int8_t* y, int64_t y_ld, float y_inv, float y_zp, float* h,
                  float* c) {
    const int64_t G = kind == LSTM ? 4 : (kind == GRU ? 3 : 1), N = G * H;
    std::vector<uint8_t> xu(static_cast<size_t>(T * B * kp_ih));
    qt::to_u8(x, T * B, K, K, xu.data(), kp_ih);
    std::vector<float> gx(static_cast<size_t>(T * B * N)), gh(static_cast<size_t>(B * N));
    const qt::Epilogue ex{off_ih, sc_ih, b_ih, gx.data(), nullptr, N, 0, 0, 0, 0};
    qt::gemm_u8s8(T * B, N, kp_ih, xu.data(), kp_ih, w_ih, ex);

    std::vector<uint8_t> hu8(static_cast<size_t>(B * kp_hh), 0);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < H; ++j)
            hu8[b * kp_hh + j] = static_cast<uint8_t>(
                qt::quantize_value(h[b * H + j], h_inv, h_zp, -128.0f, 127.0f) + 128.0f);
    const qt::Epilogue eh{off_hh, sc_hh, b_hh, gh.data(), nullptr, N, 0, 0, 0, 0};
    const Step s{kind, H, h_inv, h_zp, y_inv, y_zp};
    for (int64_t step = 0; step < T; ++step) {
        const int64_t t = reverse ? T - 1 - step : step;
        qt::gemm_u8s8(B, N, kp_hh, hu8.data(), kp_hh, w_hh, eh);
        for (int64_t b = 0; b < B; ++b) {
            cell(s, gx.data() + (t * B + b) * N, gh.data() + b * N, h + b * H,
                 c ? c + b * H : nullptr, hu8.data() + b * kp_hh, y + (t * B + b) * y_ld);
        }
    }
}

}  // extern "C"
