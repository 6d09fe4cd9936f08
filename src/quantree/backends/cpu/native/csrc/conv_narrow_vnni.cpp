// The narrow-group convolution's AVX-512 VNNI path (256-bit vpdpbusd), compiled with
// -march=x86-64-v4 -mavx512vnni.
#define QT_NARROW_VNNI 1
#include "conv_narrow_x86.h"
