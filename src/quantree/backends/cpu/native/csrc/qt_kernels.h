// Shared declarations of quantree's int8 CPU kernels (plain C ABI, no torch headers).
//
// The hot loops exist once per instruction set (isa_*.cpp, each compiled with its own target
// flags into the same library) and are reached through `qt::kernels`, a table filled once at
// load by qt_select_isa from what the CPU reports: the build machine's -march never decides.
// Every path reads the one packed weight layout below and gives the same bits.
//
// Weights are packed ahead of time into VNNI blocks: [ceil(N/16)][Kp/4][16][4] int8, with
// Kp = K rounded up to 4 and zero padding. Activations are int8 with a zero point; kernels
// flip them to uint8 (x + 128) so that one `vpdpbusd` multiplies 4 u8 x s8 pairs per lane.
// The caller folds the correction -(zp + 128) * sum_k w[n, k] into the int32 offset.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace qt {

// No C++ exception crosses an ``extern "C"`` entry point (it would terminate the process):
// every entry point is a function-try-block ending in QT_CATCH, which records what failed
// in this thread's error slot, read and cleared by qt_take_error() after each call
// (native/caught.py raises MemoryError for 1, NativeArgumentError for 2).
// qt_errors_pending counts the errors recorded and not yet taken, on every thread: the one
// word Python reads after a call (ctypes, no call), taking its own only when it is not 0.
enum Error : int { NO_ERROR = 0, NO_MEMORY = 1, INTERNAL = 2 };
int& last_error();
void record_error(int error);


struct Epilogue {
    const int32_t* off;  // [N] added to the int32 accumulator
    const float* scale;  // [N] accumulator scale (input scale x weight scale)
    const float* bias;   // [N] float bias, or null
    float* out_f;        // float output, or null
    int8_t* out_q;       // int8 output (when out_f is null)
    int64_t ldc;         // row stride of the output
    float inv_scale;     // 1 / output scale
    float zero_point;    // output zero point
    float qmin;          // lower clamp (the zero point for a fused relu)
    float qmax;
    bool accumulate = false;  // float output: add to what is there
    // int8 output, when set: q = round((acc + off) * mult + add) + zero_point, with
    // mult = scale / out_scale and add = bias / out_scale: fewer steps than the float detour.
    const float* mult = nullptr;
    const float* add = nullptr;
    const int32_t* row_off = nullptr;  // [M] added to every accumulator of a row, or null
};

class PreparedB;

// C[M, N] = epilogue(A_u8[M, Kp] x packed B); lda is A's row stride (>= Kp). With A_lo
// (a second plane, same layout), the accumulator is 256 * (A.B + off) + A_lo.B: a 16-bit
// operand split into its high and low bytes, in one pass over B. With prepared (B prepared
// once for many products, below) the path skips what it would otherwise derive from B.
// (Defined below, through the path chosen at load; empty products write nothing.)
// With w7 (every byte of B within [-63, 63], qt::within7) a path may take its GEMM for such
// weights (Kernels::gemm_w7): same bits, faster where the path has one.
inline void gemm_u8s8(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                      const int8_t* B, const Epilogue& ep, const uint8_t* A_lo = nullptr,
                      const PreparedB* prepared = nullptr, bool w7 = false);

// Whether the n bytes of a packed weight all lie within [-63, 63]: the 7-bit weights of a
// reduced-range recipe (recipes/int8.py REDUCED_WEIGHT_MAX), for which AVX2's saturating
// `vpmaddubsw` is exact. Proven from the bytes at the call rather than taken from a flag,
// so a weight read from a file can never claim it falsely.
bool within7(const int8_t* B, int64_t n);

// rows of int8 x (stride ldx) -> uint8 (x + 128), zero padded from K to Kp.
void to_u8(const int8_t* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out, int64_t Kp);

// Round to nearest even (the current rounding mode), as nearbyintf. Without SSE4.1 (the
// x86-64 baseline of the portable build) nearbyintf is a libm call per element; cvtss2si
// rounds the same way wherever x is not an integer already (|x| < 2^23), and copysign keeps
// nearbyintf's -0 for x in (-0.5, -0].
static inline float round_even(float x) {
#if defined(__x86_64__) && !defined(__SSE4_1__)
    return __builtin_fabsf(x) < 8388608.0f
               ? __builtin_copysignf(static_cast<float>(_mm_cvtss_si32(_mm_set_ss(x))), x)
               : x;
#else
    return __builtin_nearbyintf(x);
#endif
}

// static: the ISA files include this header too, and an out-of-line copy compiled with
// AVX-512 flags must never be what the portable code links against.
static inline float quantize_value(float y, float inv, float zp, float lo, float hi) {
    float q = round_even(y * inv) + zp;
    return q < lo ? lo : (q > hi ? hi : q);
}

// Float rows (stride lda) quantized to int16 q = clamp(round(x * inv), qmin, qmax) as two
// uint8 planes of stride Kp, zero padded from K: hi = (q >> 8) + 128, lo = q & 255, so that the
// hi plane read as uint8 is the int8 plane q >> 8 shifted as to_u8 shifts any int8 input.
static inline void split16_rows(const float* a, int64_t rows, int64_t K, int64_t lda, float inv,
                                float qmin, float qmax, uint8_t* hi, uint8_t* lo, int64_t Kp) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < K; ++k) {
            const int32_t q = static_cast<int32_t>(qt::quantize_value(a[r * lda + k], inv, 0.0f,
                                                                      qmin, qmax));
            hi[r * Kp + k] = static_cast<uint8_t>((q >> 8) + 128);
            lo[r * Kp + k] = static_cast<uint8_t>(q & 255);
        }
        for (int64_t k = K; k < Kp; ++k) hi[r * Kp + k] = lo[r * Kp + k] = 0;
    }
}

// The epilogue of one output element, as every path computes it (the vector paths use it
// for column tails): acc and acc2 are the int32 dot products of the high and low planes.
static inline void epilogue_one(const Epilogue& ep, int64_t r, int64_t n, int32_t acc,
                                int32_t acc2, bool dual) {
    if (ep.row_off) acc += ep.row_off[r];
    float v = static_cast<float>(acc + ep.off[n]);
    if (dual) v = v * 256.0f + static_cast<float>(acc2);
    if (ep.mult) {
        float q = round_even(v * ep.mult[n] + ep.add[n]) + ep.zero_point;
        q = q < ep.qmin ? ep.qmin : (q > ep.qmax ? ep.qmax : q);
        ep.out_q[r * ep.ldc + n] = static_cast<int8_t>(q);
        return;
    }
    float y = v * ep.scale[n];
    if (ep.bias) y += ep.bias[n];
    if (ep.out_f) {
        ep.out_f[r * ep.ldc + n] = ep.accumulate ? ep.out_f[r * ep.ldc + n] + y : y;
    } else {
        ep.out_q[r * ep.ldc + n] =
            static_cast<int8_t>(quantize_value(y, ep.inv_scale, ep.zero_point, ep.qmin, ep.qmax));
    }
}

enum RnnKind { LSTM = 0, GRU = 1, RNN_TANH = 2, RNN_RELU = 3 };

// One step of a recurrent layer's gate math (see rnn.cpp).
struct RnnStep {
    int kind;  // an RnnKind
    int64_t H;
    float h_inv, h_zp, y_inv, y_zp;
    int64_t lo_offset;  // wide: distance from a row's hi plane to its lo plane, else 0
};

// Kernel paths, in increasing order of preference.
enum Isa { PORTABLE = 0, AVX2 = 1, AVXVNNI = 2, AVX512VNNI = 3, NEON = 4, NEONDOT = 5 };

using GemmFn = void (*)(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                        const int8_t* B, const Epilogue& ep, const uint8_t* A_lo);
// Gate math of one batch row: gx/gh hold the G*H pre-activations, h/c the float states.
using CellFn = void (*)(const RnnStep& s, const float* gx, const float* gh, float* h, float* c,
                        uint8_t* hu8, int8_t* y, float* yf, float* raw);
// kind 0: sigmoid, 1: tanh, of n floats.
using ActivationFn = void (*)(int kind, const float* a, float* out, int64_t n);
// What a path's GEMM derives from a packed B on every call, made once for a B that many
// calls of `rows` rows share (a recurrent layer's W_ih and W_hh, multiplied at every step):
// on the AVX2 path the int16 panels, whose widening took ~10% of an LSTM step at batch 32
// (perf). Returns the bytes needed when out is null, 0 when the path would not use it;
// writes them to out (32-byte aligned) otherwise.
using PrepareFn = int64_t (*)(const int8_t* B, int64_t N, int64_t Kp, int64_t rows, void* out);
// The GEMM of a path with a PrepareFn, reading what it prepared.
using PreparedGemmFn = void (*)(int64_t M, int64_t N, int64_t Kp, const uint8_t* A,
                                int64_t lda, const int8_t* B, const Epilogue& ep,
                                const uint8_t* A_lo, const void* prepared);

// out[i] = table[x[i] + 128] for n bytes: any pointwise int8 -> int8 function, tabulated at
// lowering (cells mode's sigmoid / tanh / requantizations, qt_lookup). Exact on every path.
using LookupFn = void (*)(const int8_t* table, const int8_t* x, int8_t* out, int64_t n);
void lookup_portable(const int8_t* table, const int8_t* x, int8_t* out, int64_t n);

// Grouped convolutions with fewer than 16 output channels a group (conv_narrow.cpp): the
// weight rearranged once per call from the GEMM-packed groups (bytes needed when out is
// null), the int32 products of a panel of im2col rows (acc[r * groups * OCg + channel]),
// and the epilogue of those rows (ep.ldc = N, no row_off).
using NarrowPrepareFn = int64_t (*)(const int8_t* B, int64_t groups, int64_t OCg, int64_t Kp,
                                   int64_t group_stride, void* out);
using NarrowFn = void (*)(const void* prepared, int64_t rows, int64_t groups, int64_t OCg,
                          int64_t Kp, const uint8_t* col, int64_t lda, int32_t* acc);
using RowsEpilogueFn = void (*)(const Epilogue& ep, const int32_t* acc, int64_t rows,
                                int64_t N);
int64_t narrow_prepare_portable(const int8_t*, int64_t, int64_t, int64_t, int64_t, void*);
void narrow_portable(const void*, int64_t, int64_t, int64_t, int64_t, const uint8_t*, int64_t,
                     int32_t*);
void rows_epilogue_portable(const Epilogue&, const int32_t*, int64_t, int64_t);
#if defined(__x86_64__)
int64_t narrow_prepare_avx2(const int8_t*, int64_t, int64_t, int64_t, int64_t, void*);
void narrow_avx2(const void*, int64_t, int64_t, int64_t, int64_t, const uint8_t*, int64_t,
                 int32_t*);
void rows_epilogue_avx2(const Epilogue&, const int32_t*, int64_t, int64_t);
int64_t narrow_prepare_vnni(const int8_t*, int64_t, int64_t, int64_t, int64_t, void*);
void narrow_vnni(const void*, int64_t, int64_t, int64_t, int64_t, const uint8_t*, int64_t,
                 int32_t*);
#endif

// Float rows [M, K] quantized to symmetric int16 q = clamp(round(x * inv), qmin, 32767) as
// two uint8 planes of stride Kp, zero padded: hi = (q >> 8) + 128, lo = q & 255 (a recurrent
// layer's int16 input, rnn.cpp).
using Planes16Fn = void (*)(const float* x, int64_t M, int64_t K, float inv, uint8_t* hi,
                            uint8_t* lo, int64_t Kp, float qmin);
void planes16_portable(const float*, int64_t, int64_t, float, uint8_t*, uint8_t*, int64_t,
                       float);
// y[i] = clamp(round(y[i] * inv), -32768, 32767) * scale in place: a float output rounded
// onto a symmetric int16 grid (the graph's quantize and dequantize, fused).
using Round16Fn = void (*)(float* y, int64_t n, float inv, float scale);
void round16_portable(float*, int64_t, float, float);

// int16-weight 1-d convolutions (conv1d_w16.cpp): the exact sums of one panel. colh / coll
// hold R2 pairs of im2col rows of P8 positions, [R2][P8][2] int16, the high (v >> 8) and low
// (v & 255) bytes of each input value v; w holds nO weight rows of stride Rp (pairs along
// the rows, zero past the group's depth). dsum[o * P8 + p] = sum_r w[o][r] * v[r][p], exact
// (a double holds every such sum), on every path.
using W16PanelFn = void (*)(const int16_t* colh, const int16_t* coll, int64_t R2, int64_t P8,
                            const int16_t* w, int64_t Rp, int64_t nO, double* dsum);
void w16_panel_portable(const int16_t*, const int16_t*, int64_t, int64_t, const int16_t*,
                        int64_t, int64_t, double*);
#if defined(__x86_64__)
void w16_panel_avx2(const int16_t*, const int16_t*, int64_t, int64_t, const int16_t*, int64_t,
                    int64_t, double*);
#endif

struct Kernels {
    GemmFn gemm;
    CellFn cell;
    ActivationFn activation;
    PrepareFn prepare = nullptr;  // paths that read the packed bytes as they are have none
    PreparedGemmFn gemm_prepared = nullptr;
    LookupFn lookup = lookup_portable;
    NarrowPrepareFn narrow_prepare = narrow_prepare_portable;
    NarrowFn narrow = narrow_portable;
    RowsEpilogueFn rows_epilogue = rows_epilogue_portable;
    Planes16Fn planes16 = planes16_portable;
    Round16Fn round16 = round16_portable;
    W16PanelFn w16_panel = w16_panel_portable;
    // The GEMM of weights within [-63, 63] (gemm_u8s8's w7), on paths where it differs from
    // `gemm`: AVX2 without VNNI (isa_avx2_w7.cpp). Null elsewhere.
    GemmFn gemm_w7 = nullptr;
};
extern Kernels kernels;  // set by qt_select_isa (the portable path until then)

// B prepared by the current path for products of `rows` rows each (see PrepareFn), freed
// with it; empty where the path has nothing to prepare. Used only while the path that made
// it is the current one.
class PreparedB {
  public:
    PreparedB(const int8_t* B, int64_t N, int64_t Kp, int64_t rows) : by_(kernels.prepare) {
        const int64_t size = by_ && N > 0 && Kp > 0 ? by_(B, N, Kp, rows, nullptr) : 0;
        if (size <= 0) return;
        data_ = std::aligned_alloc(32, static_cast<size_t>((size + 31) / 32 * 32));
        if (!data_) throw std::bad_alloc();  // caught at the entry point (QT_CATCH)
        by_(B, N, Kp, rows, data_);
    }
    ~PreparedB() { std::free(data_); }
    PreparedB(const PreparedB&) = delete;
    PreparedB& operator=(const PreparedB&) = delete;
    const void* get() const { return kernels.prepare == by_ ? data_ : nullptr; }

  private:
    PrepareFn by_;
    void* data_ = nullptr;
};

// The portable path's GEMM: gemm_sse2 on x86-64 (SSE2 is part of every x86-64 CPU), else
// gemm_reference, plain C++ that the compiler vectorizes. gemm_reference is also what the
// C-level check holds every path to.
void gemm_reference(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                    const Epilogue&, const uint8_t*);
#if defined(__x86_64__)
void gemm_sse2(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
               const Epilogue&, const uint8_t*);
#endif
void cell_portable(const RnnStep&, const float*, const float*, float*, float*, uint8_t*,
                   int8_t*, float*, float*);
void activation_portable(int, const float*, float*, int64_t);
#if defined(__x86_64__)
void gemm_avx512amx(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                    const Epilogue&, const uint8_t*);
void gemm_avx512amx_all(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                        const Epilogue&, const uint8_t*);
void gemm_avx512vnni(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                     const Epilogue&, const uint8_t*);
void gemm_vnni256_evex(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                       const Epilogue&, const uint8_t*);
void cell_avx512(const RnnStep&, const float*, const float*, float*, float*, uint8_t*, int8_t*,
                 float*, float*);
void activation_avx512(int, const float*, float*, int64_t);
void planes16_avx512(const float*, int64_t, int64_t, float, uint8_t*, uint8_t*, int64_t, float);
void round16_avx512(float*, int64_t, float, float);
void gemm_avxvnni(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                  const Epilogue&, const uint8_t*);
void gemm_avx2(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
               const Epilogue&, const uint8_t*);
void gemm_avx2_w7(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                  const Epilogue&, const uint8_t*);
int64_t prepare_avx2(const int8_t*, int64_t, int64_t, int64_t, void*);
void gemm_avx2_prepared(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                        const Epilogue&, const uint8_t*, const void*);
void cell_avx2(const RnnStep&, const float*, const float*, float*, float*, uint8_t*, int8_t*,
               float*, float*);
void activation_avx2(int, const float*, float*, int64_t);
void lookup_avx2(const int8_t*, const int8_t*, int8_t*, int64_t);
#endif
#if defined(__aarch64__)
void gemm_neon(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
               const Epilogue&, const uint8_t*);
void gemm_neondot(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*,
                  const Epilogue&, const uint8_t*);
void cell_neon(const RnnStep&, const float*, const float*, float*, float*, uint8_t*, int8_t*,
               float*, float*);
void activation_neon(int, const float*, float*, int64_t);
#endif

inline void gemm_u8s8(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                      const int8_t* B, const Epilogue& ep, const uint8_t* A_lo,
                      const PreparedB* prepared, bool w7) {
    if (M <= 0 || N <= 0) return;
    if (w7 && kernels.gemm_w7) {
        kernels.gemm_w7(M, N, Kp, A, lda, B, ep, A_lo);
        return;
    }
    const void* p = prepared ? prepared->get() : nullptr;
    if (p)
        kernels.gemm_prepared(M, N, Kp, A, lda, B, ep, A_lo, p);
    else
        kernels.gemm(M, N, Kp, A, lda, B, ep, A_lo);
}

// softmax(q k^T * scale + mask) v of every (batch, head) (attention.cpp): element strides
// of the batch, head and row dimensions (the last dimension's is 1); mask may be null.
struct AttentionArgs {
    const float *q, *k, *v, *mask;
    float* out;
    int64_t B, H, Sq, Sk, D, Dv;
    int64_t qs[3], ks[3], vs[3], ms[3], os[3];
    float scale;
};

}  // namespace qt

#define QT_CATCH                                                        \
    catch (const std::bad_alloc&) { qt::record_error(qt::NO_MEMORY); }    \
    catch (const std::length_error&) { qt::record_error(qt::NO_MEMORY); } \
    catch (...) { qt::record_error(qt::INTERNAL); }
