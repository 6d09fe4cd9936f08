// AVX-VNNI path (Alder Lake and later, Zen 5): the 256-bit VNNI GEMM, VEX-encoded. Compiled
// with -march=x86-64-v3 -mavxvnni; the gate math and activations are the AVX2 path's.
#include <immintrin.h>

#include <cstring>

#define QT_VNNI256_VEX 1
#define QT_VNNI256_NAME gemm_avxvnni
#include "gemm_vnni256.h"
