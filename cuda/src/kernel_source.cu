// weftcc reduction kernels. Compiled once per process by NVRTC (weftcc-cuda/src/kernels.rs).
// The same text also compiles as host C++ with -DWEFT_HOST_TEST, where every kernel runs as a
// single-thread loop; the unit tests of kernels.rs compare that build with weftcc's CPU kernels.
// Self-contained on purpose: no headers, so NVRTC needs no include paths, and the half and
// bfloat16 conversions are the same code on host and device.
//
// Semantics (identical to weftcc-collectives/src/reduce.rs):
//  * integers: sum and prod wrap, min and max exact; avg divides truncating toward zero;
//    premulsum scaling multiplies in double, rounds to nearest-even, saturates (NaN -> 0);
//  * float and double: IEEE arithmetic; min/max return the other operand when one is NaN;
//  * half and bfloat16: every operation in float, rounded back to nearest-even.

#ifdef WEFT_HOST_TEST
#define WEFT_GLOBAL extern "C"
#define WEFT_DEVICE static inline
struct weft_dim3 { unsigned int x; };
static const weft_dim3 threadIdx = {0}, blockIdx = {0}, blockDim = {1}, gridDim = {1};
#else
#define WEFT_GLOBAL extern "C" __global__
#define WEFT_DEVICE static __device__ inline
#endif
#define WEFT_ALIGN16 __attribute__((aligned(16)))

typedef unsigned long long weft_size;
typedef signed char weft_i8_t;
typedef unsigned char weft_u8_t;
typedef int weft_i32_t;
typedef unsigned int weft_u32_t;
typedef long long weft_i64_t;
typedef unsigned long long weft_u64_t;
typedef float weft_f32_t;
typedef double weft_f64_t;
typedef unsigned short weft_f16_t;
typedef unsigned short weft_bf16_t;

struct WEFT_ALIGN16 weft_vec16 { unsigned long long lo, hi; };

union weft_f32_bits { float f; unsigned int u; };

WEFT_DEVICE unsigned int weft_f32_to_u32(float f) { union weft_f32_bits b; b.f = f; return b.u; }
WEFT_DEVICE float weft_u32_to_f32(unsigned int u) { union weft_f32_bits b; b.u = u; return b.f; }

// IEEE binary16 <-> binary32, round to nearest-even.
WEFT_DEVICE float weft_f16_to_f32(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int e = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int m = (unsigned int)h & 0x3ffu;
    unsigned int bits;
    if (e == 0) {
        if (m == 0) {
            bits = sign;
        } else {
            e = 113;
            while ((m & 0x400u) == 0) { m <<= 1; e--; }
            bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    return weft_u32_to_f32(bits);
}

WEFT_DEVICE unsigned short weft_f32_to_f16(float f) {
    unsigned int x = weft_f32_to_u32(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {  // infinity or NaN (NaN stays quiet and keeps its top payload)
        return (unsigned short)(sign | 0x7c00u | (ax > 0x7f800000u ? (0x200u | ((ax >> 13) & 0x3ffu)) : 0u));
    }
    if (ax < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        if (ax < 0x33000000u) return (unsigned short)sign;  // at most 2^-25: rounds to zero
        unsigned int e = ax >> 23;
        unsigned int m = (ax & 0x7fffffu) | 0x800000u;
        unsigned int shift = 126u - e;
        unsigned int r = m >> shift;
        unsigned int rem = m & ((1u << shift) - 1u);
        unsigned int half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (unsigned short)(sign | r);
    }
    unsigned int r = (ax >> 13) - (112u << 10);  // rebias; overflow carries into infinity
    unsigned int rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    if (r > 0x7c00u) r = 0x7c00u;
    return (unsigned short)(sign | r);
}

// bfloat16 <-> binary32, round to nearest-even (NaN stays quiet).
WEFT_DEVICE float weft_bf16_to_f32(unsigned short h) { return weft_u32_to_f32((unsigned int)h << 16); }
WEFT_DEVICE unsigned short weft_f32_to_bf16(float f) {
    unsigned int x = weft_f32_to_u32(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Round half to even without a math library: adding and removing 2^52 leaves the nearest
// integer under the default rounding mode (|x| < 2^52; larger values are integers already).
WEFT_DEVICE double weft_rint(double x) {
    const double big = 4503599627370496.0;
    double ax = x < 0 ? -x : x;
    if (!(ax < big)) return x;
    volatile double t = ax + big;
    double r = t - big;
    return x < 0 ? -r : r;
}

#define WEFT_FMIN(a, b) ((a) != (a) ? (b) : ((b) != (b) ? (a) : ((b) < (a) ? (b) : (a))))
#define WEFT_FMAX(a, b) ((a) != (a) ? (b) : ((b) != (b) ? (a) : ((b) > (a) ? (b) : (a))))

// Integer types: name, type, unsigned type of its width, type for division, limits.
#define WEFT_INT(N, T, UT, WT, LO, HI)                                                        \
    WEFT_DEVICE T weft_sum_##N(T a, T b) { return (T)((UT)a + (UT)b); }                       \
    WEFT_DEVICE T weft_prod_##N(T a, T b) { return (T)((UT)a * (UT)b); }                      \
    WEFT_DEVICE T weft_min_##N(T a, T b) { return b < a ? b : a; }                            \
    WEFT_DEVICE T weft_max_##N(T a, T b) { return b > a ? b : a; }                            \
    WEFT_DEVICE T weft_div1_##N(T a, weft_size d) { return (T)((WT)a / (WT)d); }              \
    WEFT_DEVICE T weft_scale1_##N(T a, double f) {                                            \
        double r = weft_rint((double)a * f);                                                  \
        if (r != r) return (T)0;                                                              \
        if (r <= (double)(LO)) return (T)(LO);                                                \
        if (r >= (double)(HI)) return (T)(HI);                                                \
        return (T)r;                                                                          \
    }

// Native floating-point types (computation type = storage type).
#define WEFT_FLOAT(N, T)                                                                      \
    WEFT_DEVICE T weft_sum_##N(T a, T b) { return a + b; }                                    \
    WEFT_DEVICE T weft_prod_##N(T a, T b) { return a * b; }                                   \
    WEFT_DEVICE T weft_min_##N(T a, T b) { return WEFT_FMIN(a, b); }                          \
    WEFT_DEVICE T weft_max_##N(T a, T b) { return WEFT_FMAX(a, b); }                          \
    WEFT_DEVICE T weft_div1_##N(T a, weft_size d) { return a / (T)d; }                        \
    WEFT_DEVICE T weft_scale1_##N(T a, double f) { return a * (T)f; }

// 16-bit floats stored as bits, computed in float.
#define WEFT_HALF(N, TO_F, FROM_F)                                                            \
    WEFT_DEVICE unsigned short weft_sum_##N(unsigned short a, unsigned short b) {             \
        return FROM_F(TO_F(a) + TO_F(b)); }                                                   \
    WEFT_DEVICE unsigned short weft_prod_##N(unsigned short a, unsigned short b) {            \
        return FROM_F(TO_F(a) * TO_F(b)); }                                                   \
    WEFT_DEVICE unsigned short weft_min_##N(unsigned short a, unsigned short b) {             \
        float x = TO_F(a), y = TO_F(b); return FROM_F(WEFT_FMIN(x, y)); }                     \
    WEFT_DEVICE unsigned short weft_max_##N(unsigned short a, unsigned short b) {             \
        float x = TO_F(a), y = TO_F(b); return FROM_F(WEFT_FMAX(x, y)); }                     \
    WEFT_DEVICE unsigned short weft_div1_##N(unsigned short a, weft_size d) {                 \
        return FROM_F(TO_F(a) / (float)d); }                                                  \
    WEFT_DEVICE unsigned short weft_scale1_##N(unsigned short a, double f) {                  \
        return FROM_F(TO_F(a) * (float)f); }

WEFT_INT(i8, weft_i8_t, unsigned char, long long, -128, 127)
WEFT_INT(u8, weft_u8_t, unsigned char, unsigned long long, 0, 255)
WEFT_INT(i32, weft_i32_t, unsigned int, long long, -2147483647 - 1, 2147483647)
WEFT_INT(u32, weft_u32_t, unsigned int, unsigned long long, 0, 4294967295u)
WEFT_INT(i64, weft_i64_t, unsigned long long, long long, -9223372036854775807LL - 1, 9223372036854775807LL)
WEFT_INT(u64, weft_u64_t, unsigned long long, unsigned long long, 0, 18446744073709551615ULL)
WEFT_FLOAT(f32, weft_f32_t)
WEFT_FLOAT(f64, weft_f64_t)
WEFT_HALF(f16, weft_f16_to_f32, weft_f32_to_f16)
WEFT_HALF(bf16, weft_bf16_to_f32, weft_f32_to_bf16)

// dst = a (op) b over n elements: 16-byte vectors when all three pointers are 16-byte aligned,
// then the tail element by element; grid-stride loops, so any launch shape covers n.
#define WEFT_REDUCE_KERNEL(OP, N, T)                                                          \
    WEFT_GLOBAL void weft_reduce_##OP##_##N(T* dst, const T* a, const T* b, weft_size n) {    \
        weft_size i = (weft_size)blockIdx.x * blockDim.x + threadIdx.x;                       \
        weft_size stride = (weft_size)gridDim.x * blockDim.x;                                 \
        weft_size start = 0;                                                                  \
        if ((((weft_size)dst | (weft_size)a | (weft_size)b) & 15u) == 0) {                    \
            union lanes { struct weft_vec16 v; T e[16 / sizeof(T)]; };                        \
            weft_size nv = n / (16 / sizeof(T));                                              \
            for (weft_size v = i; v < nv; v += stride) {                                      \
                union lanes x, y, z;                                                          \
                x.v = ((const struct weft_vec16*)a)[v];                                       \
                y.v = ((const struct weft_vec16*)b)[v];                                       \
                for (unsigned int k = 0; k < 16 / sizeof(T); k++)                             \
                    z.e[k] = weft_##OP##_##N(x.e[k], y.e[k]);                                 \
                ((struct weft_vec16*)dst)[v] = z.v;                                           \
            }                                                                                 \
            start = nv * (16 / sizeof(T));                                                    \
        }                                                                                     \
        for (weft_size j = start + i; j < n; j += stride) dst[j] = weft_##OP##_##N(a[j], b[j]); \
    }

#define WEFT_KERNELS(N, T)                                                                    \
    WEFT_REDUCE_KERNEL(sum, N, T)                                                             \
    WEFT_REDUCE_KERNEL(prod, N, T)                                                            \
    WEFT_REDUCE_KERNEL(min, N, T)                                                             \
    WEFT_REDUCE_KERNEL(max, N, T)                                                             \
    WEFT_GLOBAL void weft_scale_##N(T* dst, const T* src, double f, weft_size n) {            \
        weft_size stride = (weft_size)gridDim.x * blockDim.x;                                 \
        for (weft_size j = (weft_size)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) \
            dst[j] = weft_scale1_##N(src[j], f);                                              \
    }                                                                                         \
    WEFT_GLOBAL void weft_divide_##N(T* buf, weft_size d, weft_size n) {                      \
        weft_size stride = (weft_size)gridDim.x * blockDim.x;                                 \
        for (weft_size j = (weft_size)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) \
            buf[j] = weft_div1_##N(buf[j], d);                                                \
    }

WEFT_KERNELS(i8, weft_i8_t)
WEFT_KERNELS(u8, weft_u8_t)
WEFT_KERNELS(i32, weft_i32_t)
WEFT_KERNELS(u32, weft_u32_t)
WEFT_KERNELS(i64, weft_i64_t)
WEFT_KERNELS(u64, weft_u64_t)
WEFT_KERNELS(f16, weft_f16_t)
WEFT_KERNELS(f32, weft_f32_t)
WEFT_KERNELS(f64, weft_f64_t)
WEFT_KERNELS(bf16, weft_bf16_t)
