// The AVX2 path's GEMM for weights proven within [-63, 63] (Kernels::gemm_w7, qt::within7):
// the 256-bit VNNI GEMM with each `vpdpbusd` as `vpmaddubsw` + `vpmaddwd` by ones + `vpaddd`
// (gemm_vnni256.h, QT_VNNI256_AVX2). Compiled with -march=x86-64-v3. Why it exists beside
// isa_avx2.cpp's int16 GEMM: see that file's header.
#include <immintrin.h>

#include <cstring>

#define QT_VNNI256_AVX2 1
#define QT_VNNI256_NAME gemm_avx2_w7
#include "gemm_vnni256.h"
