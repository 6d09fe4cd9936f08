// int8 GEMM on packed weights: the portable path, and the choice of the path every kernel
// takes (qt_select_isa), made once from what the CPU reports.
#include <atomic>
#include <cmath>
#include <cstring>

#include "qt_kernels.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#ifndef QT_SOURCE_DIGEST
#define QT_SOURCE_DIGEST "unknown"
#endif

namespace qt {

void to_u8(const int8_t* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out, int64_t Kp) {
    for (int64_t m = 0; m < M; ++m) {
        const int8_t* src = x + m * ldx;
        uint8_t* dst = out + m * Kp;
        for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<uint8_t>(src[k] ^ 0x80);
        for (int64_t k = K; k < Kp; ++k) dst[k] = 0;
    }
}

// The reference GEMM: same packed layout, same arithmetic, written for clarity first. Per row
// and block of 16 columns, 16 int32 sums over k, the innermost loop running over the
// columns so that the compiler vectorizes it (the portable path of CPUs other than x86-64).
void gemm_reference(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                    const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t kq = Kp / 4;
    for (int64_t r = 0; r < M; ++r) {
        const uint8_t* a = A + r * lda;
        const uint8_t* a2 = A_lo ? A_lo + r * lda : nullptr;
        for (int64_t nb = 0; nb * 16 < N; ++nb) {
            const int8_t* b = B + nb * kq * 64;
            int32_t acc[16] = {}, acc2[16] = {};
            for (int64_t k = 0; k < kq; ++k) {
                for (int u = 0; u < 4; ++u) {
                    const int32_t x = a[4 * k + u];
                    for (int c = 0; c < 16; ++c) acc[c] += x * b[k * 64 + c * 4 + u];
                }
                if (a2) {
                    for (int u = 0; u < 4; ++u) {
                        const int32_t x = a2[4 * k + u];
                        for (int c = 0; c < 16; ++c) acc2[c] += x * b[k * 64 + c * 4 + u];
                    }
                }
            }
            for (int c = 0; c < 16 && nb * 16 + c < N; ++c)
                epilogue_one(ep, r, nb * 16 + c, acc[c], acc2[c], a2 != nullptr);
        }
    }
}

#if defined(__x86_64__)
constexpr GemmFn gemm_portable = gemm_sse2;
#else
constexpr GemmFn gemm_portable = gemm_reference;
#endif

void activation_portable(int kind, const float* a, float* out, int64_t n) {
    if (kind == 0) {
        for (int64_t j = 0; j < n; ++j) out[j] = 1.0f / (1.0f + std::exp(-a[j]));
    } else {
        for (int64_t j = 0; j < n; ++j) out[j] = std::tanh(a[j]);
    }
}

void lookup_portable(const int8_t* table, const int8_t* __restrict x, int8_t* __restrict out,
                     int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = table[static_cast<int>(x[i]) + 128];
}

Kernels kernels{gemm_portable, cell_portable, activation_portable};

// 64 bytes at a time, a fold the compiler vectorizes (byte compares), leaving at the first
// block past 7 bits: a 7-bit weight is read once, a full-range one (the default recipe)
// mostly within its first blocks, not whole on every call.
bool within7(const int8_t* B, int64_t n) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        int bad = 0;
        for (int j = 0; j < 64; ++j) bad |= (B[i + j] > 63) | (B[i + j] < -63);
        if (bad) return false;
    }
    int bad = 0;
    for (; i < n; ++i) bad |= (B[i] > 63) | (B[i] < -63);
    return bad == 0;
}

}  // namespace qt

static int active_isa = qt::PORTABLE;
static int amx_mode = 1;  // qt_amx: 0 off, 1 from the size where the tiles pay, 2 always

// Whether this CPU has AMX int8 and the OS lets this process use its tile data (Linux asks
// for it once per process: arch_prctl ARCH_REQ_XCOMP_PERM). Asked once.
static bool amx_usable() {
#if defined(__x86_64__) && defined(__linux__)
    static const bool usable = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
        if (!tile || !int8) return false;
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return usable;
#else
    return false;
#endif
}

// On the AVX-512 VNNI path of a CPU and OS that offer AMX, the GEMM is the one that puts
// products of many rows on the tiles (isa_avx512.cpp); every other kernel stays.
static void apply_amx() {
#if defined(__x86_64__)
    if (active_isa != qt::AVX512VNNI) return;
    qt::kernels.gemm = amx_mode == 0 || !amx_usable() ? qt::gemm_avx512vnni
                       : amx_mode == 2              ? qt::gemm_avx512amx_all
                                                    : qt::gemm_avx512amx;
#endif
}

extern "C" {
std::atomic<int> qt_errors_pending{0};  // read by native/caught.py as a plain int
}

int& qt::last_error() {
    thread_local int error = qt::NO_ERROR;
    return error;
}

void qt::record_error(int error) {
    if (last_error() == NO_ERROR) qt_errors_pending.fetch_add(1);
    last_error() = error;
}

extern "C" {

// What the last failed entry point of this thread recorded (qt::Error), cleared.
int qt_take_error() {
    const int error = qt::last_error();
    if (error != qt::NO_ERROR) qt_errors_pending.fetch_sub(1);
    qt::last_error() = qt::NO_ERROR;
    return error;
}

// Throws what ``what`` names (1 std::bad_alloc, 2 a std::runtime_error) inside a guarded
// entry point, else nothing: the check that the guard (QT_CATCH) reaches Python.
void qt_guard_probe(int what) try {
    if (what == 1) throw std::bad_alloc();
    if (what == 2) throw std::runtime_error("probe");
} QT_CATCH

// The digest of the sources this library was built from (build_native.sources_digest).
const char* qt_source_digest() { return QT_SOURCE_DIGEST; }

// What the CPU reports, as bits: 1 AVX2, 2 FMA, 4 AVX-VNNI, 8 AVX-512 F, 16 AVX-512 BW,
// 32 AVX-512 VL, 64 AVX-512 VNNI, 128 ASIMD (NEON), 256 the dot product (sdot/udot),
// 512 all of x86-64-v3, 1024 all of x86-64-v4 (the prebuilt library's variants).
int qt_cpu_features() {
    int bits = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    bits |= __builtin_cpu_supports("avx2") ? 1 : 0;
    bits |= __builtin_cpu_supports("fma") ? 2 : 0;
    bits |= __builtin_cpu_supports("avxvnni") ? 4 : 0;
    bits |= __builtin_cpu_supports("avx512f") ? 8 : 0;
    bits |= __builtin_cpu_supports("avx512bw") ? 16 : 0;
    bits |= __builtin_cpu_supports("avx512vl") ? 32 : 0;
    bits |= __builtin_cpu_supports("avx512vnni") ? 64 : 0;
    bits |= __builtin_cpu_supports("x86-64-v3") ? 512 : 0;
    bits |= __builtin_cpu_supports("x86-64-v4") ? 1024 : 0;
#elif defined(__aarch64__)
    bits |= 128;
#if defined(__linux__)
    bits |= (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) ? 256 : 0;
#elif defined(__APPLE__)
    bits |= 256;
#endif
#endif
    return bits;
}

// The path qt_select_isa chose last (a qt::Isa).
int qt_current_isa() { return active_isa; }

// The path for a CPU reporting `features` (qt_cpu_features' bits), at most `cap` (a
// qt::Isa). A pure function of the bits, so that tests can ask it about CPUs no machine
// here has (Skylake-SP, Alder Lake, Sapphire Rapids). Each x86 path needs the whole -march
// level its files are compiled with (build_native.X86_ISA_SOURCES), not only the features
// it was written for: the compiler may use any instruction of that level there (BMI2's
// shlx and AVX-512 DQ's vpmullq do appear in isa_avx512.cpp), and a CPU or a virtual
// machine may report AVX2 and FMA without the rest of x86-64-v3. The bits come from libgcc
// (__builtin_cpu_supports), which counts AVX and AVX-512 only when the OS saves their
// registers (OSXSAVE, then XGETBV's XCR0).
int qt_isa_for(int features, int cap) {
    using namespace qt;
#if defined(__x86_64__)
    const bool v3 = (features & 512) != 0, v4 = v3 && (features & 1024) != 0;
    if (cap >= AVX512VNNI && v4 && (features & 64)) return AVX512VNNI;
    // an AVX-512 VNNI CPU without AVX-VNNI runs the AVX-VNNI path's EVEX twin
    if (cap >= AVXVNNI && v3 && ((features & 4) || (v4 && (features & 64)))) return AVXVNNI;
    if (cap >= AVX2 && v3) return AVX2;
#elif defined(__aarch64__)
    if (cap >= NEONDOT && (features & 256)) return NEONDOT;
    if (cap >= NEON) return NEON;
#else
    (void)features, (void)cap;
#endif
    return PORTABLE;
}

// Chooses the path of every kernel: the best the CPU supports, at most `cap` (a qt::Isa).
// Returns the path taken. On an AVX-512 VNNI CPU without AVX-VNNI, the AVX-VNNI path runs
// its EVEX twin (same code, same results), so that it can be tested there.
int qt_select_isa(int cap) {
    using namespace qt;
    const int features = qt_cpu_features();
    const int isa = qt_isa_for(features, cap);
    kernels = Kernels{gemm_portable, cell_portable, activation_portable};
#if defined(__x86_64__)
    if (isa == AVX512VNNI) {
        kernels = Kernels{gemm_avx512vnni, cell_avx512, activation_avx512};
        kernels.planes16 = planes16_avx512;
        kernels.round16 = round16_avx512;
    } else if (isa == AVXVNNI) {
        kernels = Kernels{(features & 4) ? gemm_avxvnni : gemm_vnni256_evex, cell_avx2,
                          activation_avx2, nullptr, nullptr, lookup_avx2};
    } else if (isa == AVX2) {
        kernels = Kernels{gemm_avx2, cell_avx2, activation_avx2, prepare_avx2, gemm_avx2_prepared,
                          lookup_avx2};
        kernels.gemm_w7 = gemm_avx2_w7;  // 7-bit weights: `vpmaddubsw`, exact for them
    }
    if (isa == AVX512VNNI) {  // the narrow-group convolution's paths (conv_narrow_*.cpp)
        kernels.narrow_prepare = narrow_prepare_vnni;
        kernels.narrow = narrow_vnni;
    } else if (isa != PORTABLE) {
        kernels.narrow_prepare = narrow_prepare_avx2;
        kernels.narrow = narrow_avx2;
    }
    if (isa != PORTABLE) kernels.rows_epilogue = rows_epilogue_avx2;
    if (isa != PORTABLE) kernels.w16_panel = w16_panel_avx2;  // conv1d_w16_avx2.cpp
#elif defined(__aarch64__)
    // ASIMD is part of every aarch64 CPU; the dot product (sdot) is optional (ARMv8.2+)
    if (isa == NEONDOT) {
        kernels = Kernels{gemm_neondot, cell_neon, activation_neon};
    } else if (isa == NEON) {
        kernels = Kernels{gemm_neon, cell_neon, activation_neon};
    }
#endif
    active_isa = isa;
    apply_amx();
    return isa;
}

// AMX tiles for the AVX-512 VNNI path's GEMMs, where the CPU and the OS offer them: 1 (the
// default) for products from the size where they pay, 2 for every product of 16 rows and
// more (the checks: small odd shapes reach the tiles' tails), 0 off (benchmarks compare);
// -1 only asks. The same bits in every mode. Returns the mode in effect (0 where the CPU,
// the OS or the current path gives no AMX).
int qt_amx(int mode) {
    if (mode >= 0) amx_mode = mode > 2 ? 2 : mode;
    apply_amx();
#if defined(__x86_64__)
    return active_isa == qt::AVX512VNNI && amx_usable() ? amx_mode : 0;
#else
    return 0;
#endif
}

}  // extern "C"
