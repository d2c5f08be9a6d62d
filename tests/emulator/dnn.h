// What the emulated cuDNN's files share (dnn.cpp: handles, descriptors, convolutions;
// dnn_norm.cpp: batch normalisation; dnn_graph.cpp: the graph API): status and type codes,
// the tensor and convolution descriptors, element loads and stores by type code, the
// convolution itself.
#pragma once
#include "half.h"
#include "queue.h"
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

typedef int Status;
enum { SUCCESS = 0, BAD_PARAM = 2000, NOT_SUPPORTED = 3000 };
enum { FLOAT = 0, HALF = 2, BFLOAT16 = 9 };
enum { NCHW = 0, NHWC = 1 };

#define API extern "C" __attribute__((visibility("default")))

struct Tensor {
    int format = -1, type = -1, n = 0, c = 0, h = 0, w = 0;
    // Element (a, b, y, x) in NCHW order of the dims (KCRS for a filter).
    int64_t at(int a, int b, int y, int x) const {
        return format == NHWC ? (((int64_t)a * h + y) * w + x) * c + b : (((int64_t)a * c + b) * h + y) * w + x;
    }
    int64_t size() const { return (int64_t)n * c * h * w; }
};

// A type code as an element kind (see half.h).
static Kind kind(int type) { return type == FLOAT ? K_F32 : type == HALF ? K_F16 : K_BF16; }
static float load(const void* p, int type, int64_t i) { return load(p, kind(type), i); }
static void store(void* p, int type, int64_t i, float v) { store(p, kind(type), i, v); }


enum { FMA_MATH = 3 };
struct Conv {
    int pad_h = 0, pad_w = 0, u = 1, v = 1, dil_h = 1, dil_w = 1, groups = 1, math = 0;
};

enum Pass { FORWARD, DATA, FILTER };
// One pass of the convolution c, now, on the host (dnn.cpp): forward y = alpha conv(x, w) +
// beta y, backward data into x, backward filter into w, f32 accumulation; `vary`: in another
// summation order each run, as a non-deterministic algorithm adds.
void conv_compute(Pass pass, float alpha, float beta, const Tensor& x, const void* xp, const Tensor& w,
                  const void* wp, const Conv& c, const Tensor& y, const void* yp, bool vary = false);
