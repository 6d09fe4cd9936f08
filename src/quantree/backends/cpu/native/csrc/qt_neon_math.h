// Vectorized float exp / sigmoid / tanh for the aarch64 paths, four lanes at a time.
//
// The same degree-6 polynomial on the same Cody-Waite reduced argument as qt_vmath.h (the
// x86 vector paths), so that a recurrent layer's gate math costs a few instructions per
// element instead of a libm expf / tanhf call: on a phone core those calls are about as
// slow as the int8 GEMV of the step itself. Like the x86 paths, the result differs from
// libm in the last bits; the kernel check holds it to a stated tolerance (kernel_check.cpp,
// "gate_math").
#pragma once
#if defined(__aarch64__)
#include <arm_neon.h>

namespace qt {
namespace neon_math {

static inline float32x4_t vexp(float32x4_t x) {
    x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(88.0f)), vdupq_n_f32(-88.0f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
    r = vfmsq_f32(r, n, vdupq_n_f32(1.428606765330187045e-06f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    // times 2^n, n in [-127, 127]: two factors 2^(n/2) keep every one a normal float
    const int32x4_t ni = vcvtq_s32_f32(n);
    const int32x4_t half = vshrq_n_s32(ni, 1);
    const float32x4_t a = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, vdupq_n_s32(127)), 23));
    const float32x4_t b =
        vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(ni, half), vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, a), b);
}

static inline float32x4_t vsig(float32x4_t x) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    return vdivq_f32(one, vaddq_f32(one, vexp(vnegq_f32(x))));
}

static inline float32x4_t vtanh(float32x4_t x) {
    const float32x4_t s = vsig(vaddq_f32(x, x));
    return vsubq_f32(vaddq_f32(s, s), vdupq_n_f32(1.0f));
}

}  // namespace neon_math
}  // namespace qt
#endif
