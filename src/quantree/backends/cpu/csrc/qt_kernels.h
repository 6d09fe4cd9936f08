// Shared declarations of quantree's int8 CPU kernels (plain C ABI, no torch headers).
//
// Weights are packed ahead of time into VNNI blocks: [ceil(N/16)][Kp/4][16][4] int8, with
// Kp = K rounded up to 4 and zero padding. Activations are int8 with a zero point; kernels
// flip them to uint8 (x + 128) so that one `vpdpbusd` multiplies 4 u8 x s8 pairs per lane.
// The caller folds the correction -(zp + 128) * sum_k w[n, k] into the int32 offset.
#pragma once
#include <cstddef>
#include <cstdint>

namespace qt {

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

// C[M, N] = epilogue(A_u8[M, Kp] x packed B); lda is A's row stride (>= Kp). With A_lo
// (a second plane, same layout), the accumulator is 256 * (A.B + off) + A_lo.B: a 16-bit
// operand split into its high and low bytes, in one pass over B.
void gemm_u8s8(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo = nullptr);

// rows of int8 x (stride ldx) -> uint8 (x + 128), zero padded from K to Kp.
void to_u8(const int8_t* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out, int64_t Kp);

inline float quantize_value(float y, float inv, float zp, float lo, float hi) {
    float q = __builtin_nearbyintf(y * inv) + zp;
    return q < lo ? lo : (q > hi ? hi : q);
}

}  // namespace qt
