// The narrow-group convolution's AVX2 path (vpmaddwd), compiled with -march=x86-64-v3.
#include "conv_narrow_x86.h"
