// A group norm's epilogue rows (norm_block.cpp): y = act(x * a + b), then * s, then + r.
// The AVX2 rows (norm_block_avx2.cpp) and the portable ones compute the same float
// operations in the same order; they differ only in erf / exp (rational / polynomial
// approximations on AVX2, libm's on the portable path), to float rounding.
#pragma once

#include <cstdint>

namespace qt::norm_block {

enum Act : int64_t { NONE = 0, GELU = 1, GLU = 2 };

// One sample [C, S] dense, output channel c (of co) at out + c * S:
// gelu: out = s[c] * gelu(x[c] * a[c] + b[c]) + r[c] (s, r null: no multiply / add);
// glu:  out = s[c] * ((x[c] * a[c] + b[c]) * sigmoid(x[c + co] * a[c + co] + b[c + co])) + r[c];
// none: out = s[c] * (x[c] * a[c] + b[c]) + r[c].
struct Sample {
    const float* x;
    const float* a;
    const float* b;
    const float* s;  // co scales, or null
    const float* r;  // the residual [co, S], or null
    float* out;
    int64_t co, S;
};

void rows_portable(int64_t act, const Sample& w);
#if defined(__x86_64__)
void rows_avx2(int64_t act, const Sample& w);
#endif

}  // namespace qt::norm_block
