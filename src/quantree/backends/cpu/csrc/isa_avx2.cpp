// AVX2 path (x86-64-v3: AVX2 + FMA): GEMM micro-kernels, recurrent gate math and float
// activations, 8 lanes wide. Compiled with -march=x86-64-v3 whatever the rest of the
// library's flags; only reached through qt::kernels when the CPU has AVX2 and FMA.
//
// u8 x s8 products: `vpmaddubsw` adds pairs into int16 and saturates (255 * 127 * 2 >
// 32767), which would break bit equality with the other paths. Instead both operands are
// widened to int16 and `vpmaddwd` adds pairs into int32, exact for every input: 16 bytes of
// a packed block (4 columns x 4 k) widen to one register, multiplied by the row's 4
// activations repeated, giving two partial sums per column, folded once at the end.
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#include "qt_kernels.h"
#include "qt_x86_256.h"

namespace qt {

using x86_256::epilogue8;

namespace {

// The 4 activations a[0..3], already int16, repeated 4 times: a load-port broadcast (the
// shuffle port is busy widening B).
inline __m256i bcast4(const int16_t* a) {
    int64_t four;
    std::memcpy(&four, a, 8);
    return _mm256_set1_epi64x(four);
}

// Rows of uint8 (stride lda) -> int16 (stride Kp), once per GEMM call.
void widen_rows(const uint8_t* A, int64_t M, int64_t Kp, int64_t lda, int16_t* out) {
    for (int64_t r = 0; r < M; ++r) {
        int64_t k = 0;
        for (; k + 16 <= Kp; k += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * Kp + k),
                                _mm256_cvtepu8_epi16(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(A + r * lda + k))));
        for (; k < Kp; ++k) out[r * Kp + k] = A[r * lda + k];
    }
}

// acc += madd(a, b). Inline asm keeps each accumulator in its register: with intrinsics,
// GCC 12 moves most of them through the stack every iteration.
inline void madd_acc(__m256i& acc, __m256i a, __m256i b) {
    __m256i t;
    asm("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(a), "x"(b));
}

// Two partial sums per column for columns 0-3 (p) and 4-7 (q) -> the 8 column sums in order.
inline __m256i fold(__m256i p, __m256i q) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(p, q), 0xD8);
}

// MR rows x NR blocks of 16 columns; DUAL also multiplies the rows of the low-byte plane A2
// (see gemm_u8s8 in qt_kernels.h).
template <int MR, int NR, bool DUAL>
void micro(const int16_t* A, const int16_t* A2, int64_t lda, const int8_t* B, int64_t kq,
           int64_t row0, int64_t nb0, int64_t N, const Epilogue& ep) {
    __m256i acc[MR][NR][4], acc2[DUAL ? MR : 1][DUAL ? NR : 1][4];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j)
            for (int q = 0; q < 4; ++q) acc[i][j][q] = _mm256_setzero_si256();
    if constexpr (DUAL) {
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < NR; ++j)
                for (int q = 0; q < 4; ++q) acc2[i][j][q] = _mm256_setzero_si256();
    }
    const int8_t* b = B + nb0 * kq * 64;
    const int16_t* a0 = A + row0 * lda;
    const int16_t* a2 = DUAL ? A2 + row0 * lda : nullptr;
    for (int64_t k = 0; k < kq; ++k) {
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
            const int8_t* bk = b + (j * kq + k) * 64;
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) {
                const __m256i bw = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(bk + 16 * q)));
#pragma GCC unroll 4
                for (int i = 0; i < MR; ++i) {
                    const __m256i av = bcast4(a0 + i * lda + 4 * k);
                    madd_acc(acc[i][j][q], av, bw);
                    if constexpr (DUAL) madd_acc(acc2[i][j][q], bcast4(a2 + i * lda + 4 * k), bw);
                }
            }
        }
    }
    for (int i = 0; i < MR; ++i) {
        for (int j = 0; j < NR; ++j) {
            for (int h = 0; h < 2; ++h) {
                const int64_t n0 = (nb0 + j) * 16 + 8 * h;
                if (n0 >= N) continue;
                const __m256i s = fold(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                __m256i s2;
                if constexpr (DUAL) s2 = fold(acc2[i][j][2 * h], acc2[i][j][2 * h + 1]);
                epilogue8(ep, row0 + i, n0, N - n0 < 8 ? N - n0 : 8, s, DUAL ? &s2 : nullptr);
            }
        }
    }
}

}  // namespace

void gemm_avx2(int64_t M, int64_t N, int64_t Kp, const uint8_t* A_u8, int64_t lda_u8,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo_u8) {
    const int64_t nblocks = (N + 15) / 16, kq = Kp / 4, lda = Kp;
    const size_t plane = static_cast<size_t>(M * Kp);
    int16_t* A = static_cast<int16_t*>(std::malloc(plane * (A_lo_u8 ? 4 : 2)));
    if (!A) std::abort();  // as operator new would, without its exception
    widen_rows(A_u8, M, Kp, lda_u8, A);
    const int16_t* A_lo = nullptr;
    if (A_lo_u8) {
        widen_rows(A_lo_u8, M, Kp, lda_u8, A + plane);
        A_lo = A + plane;
        // the int16 operand of a wide recurrent step or a stacked layer's input
        for (int64_t r = 0; r < M; ++r)
            for (int64_t nb = 0; nb < nblocks; ++nb)
                micro<1, 1, true>(A, A_lo, lda, B, kq, r, nb, N, ep);
    } else if (M < 2) {  // GEMV: two blocks (8 accumulator chains) per pass over a row
        for (int64_t r = 0; r < M; ++r) {
            int64_t nb = 0;
            for (; nb + 2 <= nblocks; nb += 2) micro<1, 2, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
            if (nb < nblocks) micro<1, 1, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
        }
    } else {
        const int64_t panel = 96;  // rows sharing one block of B while it is in L1
        for (int64_t r0 = 0; r0 < M; r0 += panel) {
            const int64_t r1 = r0 + panel < M ? r0 + panel : M;
            for (int64_t nb = 0; nb < nblocks; ++nb) {
                int64_t r = r0;
                for (; r + 2 <= r1; r += 2) micro<2, 1, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
                for (; r < r1; ++r) micro<1, 1, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
            }
        }
    }
    std::free(A);
}

using x86_256::load8;
using x86_256::round8;
using x86_256::store8;
using x86_256::store8_bytes;
using x86_256::vsig;
using x86_256::vtanh;

static inline __m256i vquant(__m256 h, float inv, float zp) {
    __m256 q = _mm256_add_ps(round8(_mm256_mul_ps(h, _mm256_set1_ps(inv))), _mm256_set1_ps(zp));
    return _mm256_cvtps_epi32(x86_256::clamp8(q, -128.0f, 127.0f));
}

// Gate math of one batch row (qt::CellFn), the AVX-512 path's arithmetic 8 lanes at a time.
void cell_avx2(const RnnStep& s, const float* gx, const float* gh, float* h, float* c,
               uint8_t* hu8, int8_t* y, float* yf, float* raw) {
    const int64_t H = s.H;
    for (int64_t j = 0; j < H; j += 8) {
        const int64_t m = H - j < 8 ? H - j : 8;
        auto pre = [&](int64_t g) {
            return _mm256_add_ps(load8(gx + g * H + j, m), load8(gh + g * H + j, m));
        };
        __m256 hv;
        if (s.kind == LSTM) {
            const __m256 i = vsig(pre(0)), f = vsig(pre(1)), g = vtanh(pre(2)), o = vsig(pre(3));
            const __m256 cv = _mm256_fmadd_ps(f, load8(c + j, m), _mm256_mul_ps(i, g));
            store8(c + j, cv, m);
            hv = _mm256_mul_ps(o, vtanh(cv));
            if (raw) {
                store8(raw + j, hv, m);
                continue;
            }
        } else if (s.kind == GRU) {
            const __m256 r = vsig(pre(0)), z = vsig(pre(1));
            const __m256 n =
                vtanh(_mm256_fmadd_ps(r, load8(gh + 2 * H + j, m), load8(gx + 2 * H + j, m)));
            hv = _mm256_fmadd_ps(z, _mm256_sub_ps(load8(h + j, m), n), n);
        } else if (s.kind == RNN_TANH) {
            hv = vtanh(pre(0));
        } else {
            hv = _mm256_max_ps(pre(0), _mm256_setzero_ps());
        }
        store8(h + j, hv, m);
        if (s.lo_offset) {
            __m256 q = round8(_mm256_mul_ps(hv, _mm256_set1_ps(s.h_inv)));
            const __m256i qi = _mm256_cvtps_epi32(x86_256::clamp8(q, -32768.0f, 32767.0f));
            const __m256i hi = _mm256_add_epi32(_mm256_srai_epi32(qi, 8), _mm256_set1_epi32(128));
            const __m256i lo = _mm256_and_si256(qi, _mm256_set1_epi32(255));
            store8_bytes(hu8 + j, hi, m, false);
            store8_bytes(hu8 + s.lo_offset + j, lo, m, false);
        } else {
            const __m256i hq = _mm256_add_epi32(vquant(hv, s.h_inv, s.h_zp), _mm256_set1_epi32(128));
            store8_bytes(hu8 + j, hq, m, false);
        }
        if (yf)
            store8(yf + j, hv, m);
        else
            store8_bytes(y + j, vquant(hv, s.y_inv, s.y_zp), m, true);
    }
}

void activation_avx2(int kind, const float* a, float* out, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) {
        const int64_t m = n - j < 8 ? n - j : 8;
        const __m256 x = load8(a + j, m);
        store8(out + j, kind == 0 ? vsig(x) : vtanh(x), m);
    }
}

}  // namespace qt
