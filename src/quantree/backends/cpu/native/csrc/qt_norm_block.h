// A group norm's epilogue rows (norm_block.cpp): y = act(x * a + b), then * s, then + r.
// The AVX2 rows (norm_block_avx2.cpp) and the portable ones compute the same float
// operations in the same order; they differ only in erf / exp (rational / polynomial
// approximations on AVX2, libm's on the portable path), to float rounding.
#pragma once

#include <cstdint>

namespace qt::norm_block {

enum Act : int64_t { NONE = 0, GELU = 1, GLU = 2 };

// gelu: out[i] = s * gelu(x[i] * a + b) + r[i] (s == 1 and r null: no multiply / add).
// glu:  out[i] = s * ((x[i] * a + b) * sigmoid(xg[i] * ag + bg)) + r[i].
// none: out[i] = s * (x[i] * a + b) + r[i].
struct Row {
    const float* x;
    const float* xg;  // glu's gate row, else null
    float a, b, ag, bg;
    const float* s;  // the output channel's scale, or null
    const float* r;  // the residual row, or null
    float* out;
};

#if defined(__x86_64__)
void rows_avx2(int64_t act, const Row& row, int64_t n);
#endif

}  // namespace qt::norm_block
