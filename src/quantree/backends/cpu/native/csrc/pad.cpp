// Reflect and replicate padding of the last dimension of int8 [N, C, L] (any strides) into a
// contiguous [N, C, left + L + right].
//
// Why by hand: codecs reflect-pad every convolution's input (Encodec: 25 pads a call), and
// ATen's reflection_pad1d on int8 is a scalar loop per element, slower again on a conv's
// channels-last output; here each row is one copy (a memcpy where the row is contiguous) plus
// its few edge values. A pure copy of codes: the result equals ATen's element for element.
#include <cstdint>
#include <cstring>

#include "qt_kernels.h"

extern "C" {

// reflect: out[j] = x[|j - left|] mirrored at both ends (left, right < L); replicate: the
// edge value repeated (L >= 1). The caller checks those bounds.
void qt_pad_last_i8(const int8_t* x, int64_t N, int64_t C, int64_t L, int64_t sn, int64_t sc,
                    int64_t sl, int64_t left, int64_t right, int64_t replicate,
                    int8_t* out) try {
    const int64_t OL = left + L + right;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) {
            const int8_t* src = x + n * sn + c * sc;
            int8_t* dst = out + (n * C + c) * OL;
            if (sl == 1) {
                std::memcpy(dst + left, src, static_cast<size_t>(L));
            } else {
                for (int64_t l = 0; l < L; ++l) dst[left + l] = src[l * sl];
            }
            const int8_t* row = dst + left;  // the copied row, contiguous
            for (int64_t j = 0; j < left; ++j)
                dst[j] = replicate ? row[0] : row[left - j];
            for (int64_t j = 0; j < right; ++j)
                dst[left + L + j] = replicate ? row[L - 1] : row[L - 2 - j];
        }
} QT_CATCH

}  // extern "C"
