// Float row sums for the float norms (group_norm.cpp, norm_block.cpp): 16 independent
// partial sums, a reduction the compiler vectorizes on every path, the same order for both
// so a norm block's statistics are the group norm's.
#pragma once
#include <cstdint>

namespace qt {

constexpr int ROW_SUM_LANES = 16;

// sum over r[0..n) of (r[s] - m)^power, power 1 or 2.
template <int power>
inline float row_sum(const float* __restrict r, int64_t n, float m) {
    float acc[ROW_SUM_LANES] = {};
    int64_t s = 0;
    for (; s + ROW_SUM_LANES <= n; s += ROW_SUM_LANES)
        for (int k = 0; k < ROW_SUM_LANES; ++k) {
            const float d = r[s + k] - m;
            acc[k] += power == 1 ? d : d * d;
        }
    float total = 0.0f;
    for (int k = 0; k < ROW_SUM_LANES; ++k) total += acc[k];
    for (; s < n; ++s) {
        const float d = r[s] - m;
        total += power == 1 ? d : d * d;
    }
    return total;
}

}  // namespace qt
