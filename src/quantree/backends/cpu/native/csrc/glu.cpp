// int8 GLU: out = q(dq(a) * sigmoid(dq(b))), a and b the two halves of x along one dimension.
//
// Why a table of floats and not of int8 codes: the output depends on both halves' codes, so an
// int8 table would be 256 x 256 per layer; sigmoid depends on b's code alone, so its 256 values
// (computed at lowering by aten's own glu, whose rounding the reference has) are looked up and
// the product and requantization done as the reference does them, in float32.
#include <cstdint>

#include "qt_kernels.h"

extern "C" {

// x: int8 [outer, 2 * half, inner] dense; out: int8 [outer, half, inner] dense. gate[c + 128]
// is sigmoid of b's code c as glu computes it; a is dequantized as (a - zp) * scale.
void qt_glu(const int8_t* x, int64_t outer, int64_t half, int64_t inner, const float* gate,
            float scale, float zp, float inv, float out_zp, int8_t* out) try {
    const int64_t block = half * inner;
    for (int64_t o = 0; o < outer; ++o) {
        const int8_t* __restrict a = x + o * 2 * block;
        const int8_t* __restrict b = a + block;
        const float* __restrict g = gate + 128;
        int8_t* __restrict y = out + o * block;
        for (int64_t i = 0; i < block; ++i) {  // a gather of g: vectorised where the ISA has one
            const int32_t c = b[i];
            const float v = (static_cast<float>(a[i]) - zp) * scale * g[c];
            y[i] = static_cast<int8_t>(static_cast<int32_t>(
                qt::quantize_value(v, inv, out_zp, -128.0f, 127.0f)));
        }
    }
} QT_CATCH

}  // extern "C"
