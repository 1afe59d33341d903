/* CPU kernels of the resharding bridge: blockwise FP8 and 4-bit (NVFP4, MXFP4) quantization and a copy that checks
 * finiteness, the FP8 quantizer and the copy adding up the checksum sums of what they write (sums that add up over
 * any pieces of a tensor, so TP ranks checksum their own pieces in the same pass). Each does in one pass over memory
 * what takes the torch reference several; each has a torch/NumPy reference (kernels/fp8/reference.py,
 * kernels/fp4/quantize.py, kernels/integrity.py) and is tested against it bit for bit. Loaded with ctypes
 * (kernels/cpu_library.py; no torch headers), so building takes well under a second. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { DT_BF16 = 0, DT_FP32 = 1, DT_FP16 = 2 };

/* Software prefetch this far ahead of a streaming read: one core's hardware prefetchers alone left the 16-bit sums
 * at 8 GB/s from memory, 11 GB/s with it (2 KB measured best among 0.5-8 KB on a 2-core Xeon VM). */
#define PREFETCH_BYTES 2048

/* Which vector paths this build has: bit 0 AVX2 (16-bit and byte sums, the 16-bit checked copy, FP8 and 4-bit
 * quantization 8 lanes wide where AVX-512 is absent), bit 1 AVX-512 (FP8 and 4-bit quantization 16 lanes wide); 0:
 * the portable scalar paths only. */
int bridge_simd(void) {
    int bits = 0;
#if defined(__AVX2__)
    bits |= 1;
#endif
#if defined(__AVX512F__)
    bits |= 2;
#endif
    return bits;
}

/* The float whose IEEE bits are `bits`. */
static inline float f32_of_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return f32_of_bits((uint32_t)h << 16); }

/* c10's round-to-nearest-even fp32 -> float8_e4m3fn for |f| <= 448 (callers clamp first). */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    float a;
    memcpy(&a, &bits, 4);
    float d = a + 16384.0f; /* 2^14: aligns the subnormal grid to the low bits */
    uint32_t dbits;
    memcpy(&dbits, &d, 4);
    uint8_t sub = (uint8_t)(dbits - (141u << 23));
    uint32_t odd = (bits >> 20) & 1u;
    uint8_t norm = (uint8_t)((bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd) >> 20);
    uint8_t r = bits < (121u << 23) ? sub : norm;
    return r | (uint8_t)(sign >> 24);
}

#if defined(__AVX512F__)
/* f32_to_e4m3 of clamp(v, -448, 448), 16 lanes at once, each code in its 32-bit lane's low byte; the subnormal
 * path only when a lane needs it (values below 2^-6 of 448 x their block's amax are rare in weights). */
static inline __m512i e4m3_lanes(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    /* |v| clamped to 448 on its bits: non-negative floats order as unsigned integers */
    const __m512i mag = _mm512_min_epu32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                         _mm512_set1_epi32(0x43E00000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu))), odd),
        20);
    const __mmask16 small = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32((int)(121u << 23)));
    if (small) {
        const __m512 d = _mm512_add_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(16384.0f));
        r = _mm512_mask_sub_epi32(r, small, _mm512_castps_si512(d), _mm512_set1_epi32((int)(141u << 23)));
    }
    /* r | (the sign bit moved to bit 7), in one ternary-logic op */
    return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
}

#if defined(__AVX512VBMI__)
/* Where output byte e of 32 BF16 codes lies in the two code vectors of `quantize_segment_avx512` (byte 4k of the
 * first for dword k of the low unpack, 64 + 4k of the second for the high one): the unpacks hold, per 128-bit
 * lane L, elements 8L..8L+3 (low) and 8L+4..8L+7 (high). */
static const uint8_t BF16_CODE_ORDER[64] = {0,  4,  8,  12, 64, 68, 72,  76,  16, 20, 24, 28, 80,  84,  88,  92,
                                            32, 36, 40, 44, 96, 100, 104, 108, 48, 52, 56, 60, 112, 116, 120, 124};
#endif

/* Quantize row[c0, c1) times the block's factor into q[c0, ...) 16 (BF16 with AVX-512 VBMI: 32) elements at a
 * time; return where the scalar tail starts. */
static inline int64_t quantize_segment_avx512(const char *row, int dtype, int64_t c0, int64_t c1, float factor,
                                              uint8_t *q) {
    const __m512 f = _mm512_set1_ps(factor);
    int64_t c = c0;
#if defined(__AVX512VBMI__)
    if (dtype != DT_FP32) {
        /* unpacking 32 BF16 elements with zeros puts each in the high half of a 32-bit lane (its FP32 bits) in two
         * vectors at once, cheaper than widening and shifting 16; one byte permute restores the order */
        const __m512i zero = _mm512_setzero_si512(), order = _mm512_loadu_si512(BF16_CODE_ORDER);
        for (; c + 32 <= c1; c += 32) {
            const __m512i x = _mm512_loadu_si512((const uint16_t *)row + c);
            const __m512i low = e4m3_lanes(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x)), f));
            const __m512i high = e4m3_lanes(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x)), f));
            _mm256_storeu_si256((__m256i *)(q + c),
                                _mm512_castsi512_si256(_mm512_permutex2var_epi8(low, order, high)));
        }
    }
#endif
    for (; c + 16 <= c1; c += 16) {
        __m512 x;
        if (dtype == DT_FP32)
            x = _mm512_loadu_ps((const float *)row + c);
        else
            x = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c))), 16));
        /* keeps each lane's low byte, as the scalar path's uint8_t casts do */
        _mm_storeu_si128((__m128i *)(q + c), _mm512_cvtepi32_epi8(e4m3_lanes(_mm512_mul_ps(x, f))));
    }
    return c;
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* f32_to_e4m3 of clamp(v, -448, 448), 8 lanes at once (AVX2 CPUs without AVX-512: AMD Zen 2/3, Intel client
 * cores), each code in its 32-bit lane's low byte; `e4m3_lanes` with AVX2's operations (a blend instead of a mask,
 * an OR of the shifted sign instead of ternary logic). */
static inline __m256i e4m3_lanes_avx2(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i mag = _mm256_min_epu32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x43E00000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu))), odd),
        20);
    /* magnitudes are below 2^31: a signed compare orders them */
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(121u << 23)), mag);
    if (_mm256_movemask_epi8(small)) {
        const __m256 d = _mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(16384.0f));
        r = _mm256_blendv_epi8(r, _mm256_sub_epi32(_mm256_castps_si256(d), _mm256_set1_epi32((int)(141u << 23))),
                               small);
    }
    return _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80)));
}

/* Quantize row[c0, c1) times the block's factor into q[c0, ...) 16 elements at a time: two 8-lane conversions, their
 * codes narrowed by two in-lane packs (codes are at most 0xFF, so the saturating packs keep them) and put in order by
 * one dword permute; BF16 is widened in-lane too (interleaved with zeros: elements 0-3 and 8-11 in one vector, 4-7
 * and 12-15 in the other), which needs another order than FP32's plain loads. Lane-crossing shuffles cost two
 * micro-ops on AMD Zen 1-2, whose AVX2 this path is for. Returns where the scalar tail starts. */
static inline int64_t quantize_segment_avx2(const char *row, int dtype, int64_t c0, int64_t c1, float factor,
                                            uint8_t *q) {
    const __m256 f = _mm256_set1_ps(factor);
    const __m256i zero = _mm256_setzero_si256();
    const __m256i order = dtype == DT_FP32 ? _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)
                                           : _mm256_setr_epi32(0, 1, 4, 5, 0, 0, 0, 0);
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
        __m256 lo, hi;
        if (dtype == DT_FP32) {
            lo = _mm256_loadu_ps((const float *)row + c);
            hi = _mm256_loadu_ps((const float *)row + c + 8);
        } else {
            const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c));
            lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
            hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
        }
        const __m256i words = _mm256_packus_epi32(e4m3_lanes_avx2(_mm256_mul_ps(lo, f)),
                                                  e4m3_lanes_avx2(_mm256_mul_ps(hi, f)));
        const __m256i codes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words, words), order);
        _mm_storeu_si128((__m128i *)(q + c), _mm256_castsi256_si128(codes));
    }
    return c;
}
#endif

/* Largest |x| of a row segment as raw magnitude bits (order-preserving for IEEE floats); a value at or above
 * the infinity pattern means NaN/Inf. BF16 with AVX-512: 32 words per max, prefetched (the first read of a strip
 * comes from memory). */
static inline uint32_t seg_amax_bits(const void *row, int dtype, int64_t c0, int64_t c1) {
    uint32_t m = 0;
    if (dtype == DT_FP32) {
        const uint32_t *p = (const uint32_t *)row;
        for (int64_t c = c0; c < c1; ++c) { uint32_t v = p[c] & 0x7FFFFFFFu; m = v > m ? v : m; }
    } else {
        const uint16_t *p = (const uint16_t *)row;
        int64_t c = c0;
#if defined(__AVX512BW__)
        __m512i vm = _mm512_setzero_si512();
        const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
        for (; c + 32 <= c1; c += 32) {
            _mm_prefetch((const char *)(p + c) + PREFETCH_BYTES, _MM_HINT_T0);
            vm = _mm512_max_epu16(vm, _mm512_and_si512(_mm512_loadu_si512(p + c), magnitude));
        }
        __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(vm), _mm512_extracti64x4_epi64(vm, 1));
        __m128i q = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        /* the largest of 8 unsigned words: minpos of their complements */
        m = 0xFFFFu - (uint32_t)_mm_extract_epi16(_mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi16(-1))), 0);
#elif defined(__AVX2__)
        __m256i vm = _mm256_setzero_si256();
        const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
        for (; c + 16 <= c1; c += 16) {
            _mm_prefetch((const char *)(p + c) + PREFETCH_BYTES, _MM_HINT_T0);
            vm = _mm256_max_epu16(vm, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + c)), magnitude));
        }
        __m128i q = _mm_max_epu16(_mm256_castsi256_si128(vm), _mm256_extracti128_si256(vm, 1));
        m = 0xFFFFu - (uint32_t)_mm_extract_epi16(_mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi16(-1))), 0);
#endif
        for (; c < c1; ++c) { uint32_t v = p[c] & 0x7FFFu; m = v > m ? v : m; }
    }
    return m;
}

static inline float magnitude_bits_to_f32(uint32_t m, int dtype) {
    return dtype == DT_FP32 ? f32_of_bits(m) : bf16_to_f32((uint16_t)m);
}

/* Position-weighted sums of a run of n unsigned elements: *S += sum v_c, *T += sum c * v_c (c from 0, mod 2^64).
 * In blocks small enough that the within-block sums fit the accumulator type ACC, which for 8- and 16-bit
 * elements is 32 bits wide so that the loop vectorises over 16 lanes: sum_{j<256} j * 65535 < 2^32 and
 * sum_{j<4096} j * 255 < 2^32. */
#define DEFINE_RUN_SUMS(NAME, TYPE, ACC, BLOCK)                                                        \
    static inline void NAME(const TYPE *v, int64_t n, uint64_t *S, uint64_t *T) {                      \
        uint64_t s = 0, t = 0;                                                                         \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                                    \
            const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                       \
            const TYPE *p = v + b0;                                                                    \
            ACC bs = 0, bt = 0;                                                                        \
            for (int64_t j = 0; j < len; ++j) { bs += (ACC)p[j]; bt += (ACC)j * (ACC)p[j]; }           \
            s += (uint64_t)bs;                                                                         \
            t += (uint64_t)b0 * (uint64_t)bs + (uint64_t)bt;                                           \
        }                                                                                              \
        *S += s;                                                                                       \
        *T += t;                                                                                       \
    }
DEFINE_RUN_SUMS(run_sums_u8_scalar, uint8_t, uint32_t, 4096)

#if defined(__AVX2__)
/* Bytes are the FP8 codes: widening each to 32 bits for the position-weighted sum costs 4 vectors per 32 bytes.
 * Instead (as in zlib's Adler-32): per 32-byte chunk c, vpsadbw gives its byte sum S_c and vpmaddubsw/vpmaddwd
 * its sum sum_{j<32} j * v_j; then T = sum_c (sum_j j v_j + 32 c S_c). Exactly the scalar sums mod 2^64. */
static inline void run_sums_u8(const uint8_t *v, int64_t n, uint64_t *S, uint64_t *T) {
    const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi16(1);
    const __m256i weights = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                             21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    const int64_t chunks = n / 32;
    uint64_t s = 0, t = 0;
    for (int64_t c0 = 0; c0 < chunks;) {
        /* per 32-bit lane a chunk adds at most 4 * 31 * 255: 2^16 chunks cannot overflow it */
        const int64_t c1 = chunks - c0 < 65536 ? chunks : c0 + 65536;
        __m256i sum64 = zero, weighted64 = zero, local32 = zero, index = _mm256_set1_epi64x(c0);
        const __m256i step = _mm256_set1_epi64x(1);
        for (int64_t c = c0; c < c1; ++c) {
            _mm_prefetch((const char *)(v + 32 * c) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m256i x = _mm256_loadu_si256((const __m256i *)(v + 32 * c));
            const __m256i sad = _mm256_sad_epu8(x, zero);
            sum64 = _mm256_add_epi64(sum64, sad);
            weighted64 = _mm256_add_epi64(weighted64, _mm256_mul_epu32(sad, index));
            local32 = _mm256_add_epi32(local32, _mm256_madd_epi16(_mm256_maddubs_epi16(x, weights), ones));
            index = _mm256_add_epi64(index, step);
        }
        uint64_t a[4], b[4];
        uint32_t l[8];
        _mm256_storeu_si256((__m256i *)a, sum64);
        _mm256_storeu_si256((__m256i *)b, weighted64);
        _mm256_storeu_si256((__m256i *)l, local32);
        for (int i = 0; i < 4; ++i) { s += a[i]; t += 32 * b[i]; }
        for (int i = 0; i < 8; ++i) t += l[i];
        c0 = c1;
    }
    uint64_t ts = 0, tt = 0;
    run_sums_u8_scalar(v + 32 * chunks, n - 32 * chunks, &ts, &tt);
    *S += s + ts;
    *T += t + tt + (uint64_t)(32 * chunks) * ts;
}
#else
#define run_sums_u8 run_sums_u8_scalar
#endif
DEFINE_RUN_SUMS(run_sums_u16_scalar, uint16_t, uint32_t, 256)

#if defined(__AVX2__)
static inline int64_t hsum_epi32(__m256i v) {
    int32_t l[8];
    _mm256_storeu_si256((__m256i *)l, v);
    int64_t s = 0;
    for (int i = 0; i < 8; ++i) s += l[i];
    return s;
}

/* Sums of a run of n 16-bit elements (n a multiple of 16), 16 per vector: S += sum v, T += sum c * v (c from 0,
 * mod 2^64) — on the way copied to `out` (NULL: not copied; `stream`: non-temporal stores, `out` 32-byte
 * aligned) and, where `emask` is not 0, checked for elements whose exponent bits (`emask`) are all set: *any_bad
 * becomes 1 then. Made signed (v - 2^15), vpmaddwd multiplies elements by their place in the vector and adds
 * pairs into 32-bit lanes; each vector's own offset comes from a running prefix sum P (Adler-32's trick: over K
 * vectors, sum_c c S_c = K sum_c S_c - sum_c P_c). Flushed to 64 bits every 128 vectors: every lane stays below
 * 2^30 in magnitude. One pass: each element is loaded once, the check, the sums and the store use the register. */
static inline void run16_avx2(const uint16_t *in, uint16_t *out, int64_t n, int stream, uint16_t emask,
                              uint64_t *S, uint64_t *T, int *any_bad) {
    const __m256i zero = _mm256_setzero_si256(), flip = _mm256_set1_epi16((short)0x8000);
    const __m256i ones = _mm256_set1_epi16(1), exponent = _mm256_set1_epi16((short)emask);
    const __m256i weights = _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t vectors = n / 16;
    __m256i bad = zero;
    uint64_t s = 0, t = 0;
    for (int64_t c0 = 0; c0 < vectors; c0 += 128) {
        const int64_t k = vectors - c0 < 128 ? vectors - c0 : 128;
        __m256i prefix = zero, running = zero, local = zero;
        for (int64_t c = c0; c < c0 + k; ++c) {
            _mm_prefetch((const char *)(in + 16 * c) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m256i x = _mm256_loadu_si256((const __m256i *)(in + 16 * c));
            if (out != NULL) {
                if (stream)
                    _mm256_stream_si256((__m256i *)(out + 16 * c), x);
                else
                    _mm256_storeu_si256((__m256i *)(out + 16 * c), x);
            }
            if (emask) bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(x, exponent), exponent));
            const __m256i xs = _mm256_xor_si256(x, flip);
            prefix = _mm256_add_epi32(prefix, _mm256_madd_epi16(xs, ones));
            running = _mm256_add_epi32(running, prefix);
            local = _mm256_add_epi32(local, _mm256_madd_epi16(xs, weights));
        }
        const int64_t m = 16 * k, sb = hsum_epi32(prefix);
        /* back from signed: each element was v - 2^15 */
        const uint64_t block_s = (uint64_t)sb + 32768u * (uint64_t)m;
        const uint64_t block_t = (uint64_t)(16 * (k * sb - hsum_epi32(running)) + hsum_epi32(local)) +
                                 32768u * (uint64_t)(m * (m - 1) / 2);
        t += (uint64_t)(16 * c0) * block_s + block_t;
        s += block_s;
    }
    if (!_mm256_testz_si256(bad, bad)) *any_bad = 1;
    *S += s;
    *T += t;
}

static inline void run_sums_u16(const uint16_t *v, int64_t n, uint64_t *S, uint64_t *T) {
    const int64_t body = n & ~(int64_t)15;
    int any_bad = 0;
    uint64_t ts = 0, tt = 0;
    run16_avx2(v, NULL, body, 0, 0, S, T, &any_bad);
    run_sums_u16_scalar(v + body, n - body, &ts, &tt);
    *S += ts;
    *T += tt + (uint64_t)body * ts;
}
#else
#define run_sums_u16 run_sums_u16_scalar
#endif
DEFINE_RUN_SUMS(run_sums_u32, uint32_t, uint64_t, 1024)
DEFINE_RUN_SUMS(run_sums_u64, uint64_t, uint64_t, 1024)

static inline void run_sums(const void *v, int64_t n, int esize, uint64_t *S, uint64_t *T) {
    switch (esize) {
    case 1: run_sums_u8((const uint8_t *)v, n, S, T); break;
    case 2: run_sums_u16((const uint16_t *)v, n, S, T); break;
    case 4: run_sums_u32((const uint32_t *)v, n, S, T); break;
    default: run_sums_u64((const uint64_t *)v, n, S, T); break;
    }
}

/* Add a run's contribution to a tensor's checksum sums: A += sum v, B += sum (index + 1) v, where the run's first
 * element has flat index `first` in its tensor. */
static inline void add_run(const void *v, int64_t n, int esize, int64_t first, uint64_t *sums) {
    uint64_t S = 0, T = 0;
    run_sums(v, n, esize, &S, &T);
    sums[0] += S;
    sums[1] += ((uint64_t)first + 1) * S + T;
}

/* Checksum sums of a rows x cols block (row stride in bytes) of elements of esize bytes whose element (r, c)
 * has flat index (row0 + r) * ncols + col0 + c in its tensor. */
void bridge_block_sums(const void *p, int64_t rows, int64_t cols, int64_t stride, int esize, int64_t row0,
                       int64_t ncols, int64_t col0, uint64_t *sums) {
    for (int64_t r = 0; r < rows; ++r)
        add_run((const char *)p + r * stride, cols, esize, (row0 + r) * ncols + col0, sums);
}

/* Copies of at least this many bytes bypass the caches: a store that misses the cache first reads the line it
 * overwrites (read-for-ownership), so a cached copy of data that does not fit the caches moves its bytes three
 * times, a streaming one twice (glibc's memcpy does the same above a similar threshold). A piece this small still
 * streams because the bridge writes buckets of many pieces that together exceed the caches (MoE experts of a few
 * hundred KB: the EP2 benchmark's BF16 sync 0.068 s with 1 MiB here, 0.063 s with 64 KiB). */
#define STREAM_COPY_BYTES (1 << 16)
#define QUANTIZE_ROW_BUFFER 65536

/* memcpy with non-temporal stores where the target is 16-byte aligned (x86-64), plain memcpy elsewhere. */
static inline void stream_copy(char *out, const char *in, int64_t len) {
#if defined(__x86_64__)
    int64_t head = (int64_t)((16 - ((uintptr_t)out & 15)) & 15);
    if (head > len) head = len;
    memcpy(out, in, (size_t)head);
    int64_t c = head;
    for (; c + 64 <= len; c += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(in + c)), b = _mm_loadu_si128((const __m128i *)(in + c + 16));
        __m128i d = _mm_loadu_si128((const __m128i *)(in + c + 32)), e = _mm_loadu_si128((const __m128i *)(in + c + 48));
        _mm_stream_si128((__m128i *)(out + c), a);
        _mm_stream_si128((__m128i *)(out + c + 16), b);
        _mm_stream_si128((__m128i *)(out + c + 32), d);
        _mm_stream_si128((__m128i *)(out + c + 48), e);
    }
    memcpy(out + c, in + c, (size_t)(len - c));
#else
    memcpy(out, in, (size_t)len);
#endif
}

/* w [m, n] (row stride w_stride elements, bf16 or fp32) -> q [m, n] e4m3 (row stride q_stride) and
 * s [ceil(m/bs), ceil(n/bs)] fp32 (row stride s_stride) with s = max(amax, 1e-10) / 448 (rounded up to a power
 * of two if pow2) and q = clamp(w * f, -448, 448), f = 448 / max(amax, 1e-10) (1 / s, exact, if pow2). Adds
 * q's checksum sums to q_sums, q's element (r, c) having flat index (q_row0 + r) * q_ncols + q_col0 + c in its tensor. Returns 0, or -1 if a value is NaN/Inf. */
int bridge_fp8_blockwise_quantize(const void *w, int dtype, int64_t m, int64_t n, int64_t w_stride, uint8_t *q,
                                  int64_t q_stride, float *s, int64_t s_stride, int64_t bs, int pow2,
                                  int64_t q_row0, int64_t q_ncols, int64_t q_col0, uint64_t *q_sums) {
    const uint32_t inf_bits = dtype == DT_FP32 ? 0x7F800000u : 0x7F80u;
    const int64_t esize = dtype == DT_FP32 ? 4 : 2;
    const int64_t nb = (n + bs - 1) / bs;
    float factor[nb > 0 ? nb : 1];
    uint32_t amax[nb > 0 ? nb : 1];
    float xs[bs];
    /* large outputs are converted row by row in L1 and streamed out (see STREAM_COPY_BYTES) */
    const int stream = m * n >= STREAM_COPY_BYTES && n <= QUANTIZE_ROW_BUFFER;
    uint8_t qbuf[stream ? n : 1];
    for (int64_t r0 = 0; r0 < m; r0 += bs) {
        int64_t r1 = r0 + bs < m ? r0 + bs : m;
        for (int64_t j = 0; j < nb; ++j) amax[j] = 0;
        for (int64_t r = r0; r < r1; ++r) {
            const char *row = (const char *)w + r * w_stride * esize;
            for (int64_t j = 0; j < nb; ++j) {
                int64_t c1 = (j + 1) * bs < n ? (j + 1) * bs : n;
                uint32_t v = seg_amax_bits(row, dtype, j * bs, c1);
                amax[j] = v > amax[j] ? v : amax[j];
            }
        }
        for (int64_t j = 0; j < nb; ++j) {
            if (amax[j] >= inf_bits) return -1;
            float a = magnitude_bits_to_f32(amax[j], dtype);
            a = a > 1e-10f ? a : 1e-10f;
            float sc = a / 448.0f;
            factor[j] = 448.0f / a;
            if (pow2) { /* round up to a power of two: clear the mantissa, bump the exponent if it was not 0 */
                uint32_t b;
                memcpy(&b, &sc, 4);
                if (b & 0x7FFFFFu) b = (b & 0xFF800000u) + 0x800000u;
                memcpy(&sc, &b, 4);
                factor[j] = 1.0f / sc;
            }
            s[(r0 / bs) * s_stride + j] = sc;
        }
        for (int64_t r = r0; r < r1; ++r) {
            const char *row = (const char *)w + r * w_stride * esize;
            uint8_t *qrow = stream ? qbuf : q + r * q_stride;
            for (int64_t j = 0; j < nb; ++j) {
                int64_t c0 = j * bs, c1 = (j + 1) * bs < n ? (j + 1) * bs : n;
                const float f = factor[j];
                int64_t c = c0;
#if defined(__AVX512F__)
                c = quantize_segment_avx512(row, dtype, c0, c1, f, qrow);
#elif defined(__AVX2__)
                c = quantize_segment_avx2(row, dtype, c0, c1, f, qrow);
#endif
                if (dtype == DT_FP32) {
                    const float *p = (const float *)row;
                    for (int64_t k = c; k < c1; ++k) xs[k - c] = p[k] * f;
                } else {
                    const uint16_t *p = (const uint16_t *)row;
                    for (int64_t k = c; k < c1; ++k) xs[k - c] = bf16_to_f32(p[k]) * f;
                }
                for (int64_t k = c; k < c1; ++k) {
                    float x = xs[k - c] > 448.0f ? 448.0f : (xs[k - c] < -448.0f ? -448.0f : xs[k - c]);
                    qrow[k] = f32_to_e4m3(x);
                }
            }
            add_run(qrow, n, 1, (q_row0 + r) * q_ncols + q_col0, q_sums);
            if (stream) stream_copy((char *)q + r * q_stride, (const char *)qbuf, n);
        }
    }
#if defined(__x86_64__)
    if (stream) _mm_sfence();
#endif
    return 0;
}

/* NaN/Inf count of a piece: an OR-reduction first (vectorises), the exact count only if it found one. */
static inline int64_t count_nonfinite(const char *p, int64_t nbytes, int dtype) {
    int64_t bad = 0;
    if (dtype == DT_FP32) {
        const uint32_t *v = (const uint32_t *)p;
        uint32_t any = 0;
        for (int64_t c = 0; c < nbytes / 4; ++c) any |= (v[c] & 0x7F800000u) == 0x7F800000u;
        if (any)
            for (int64_t c = 0; c < nbytes / 4; ++c) bad += (v[c] & 0x7F800000u) == 0x7F800000u;
    } else if (dtype == DT_BF16 || dtype == DT_FP16) {
        const uint16_t mask = dtype == DT_BF16 ? 0x7F80u : 0x7C00u;
        const uint16_t *v = (const uint16_t *)p;
        uint16_t any = 0;
        for (int64_t c = 0; c < nbytes / 2; ++c) any |= (uint16_t)((v[c] & mask) == mask);
        if (any)
            for (int64_t c = 0; c < nbytes / 2; ++c) bad += (v[c] & mask) == mask;
    }
    return bad;
}

#if defined(__AVX2__)
/* One row of 16-bit elements (flat index of its first: `first`): a scalar head up to the first 32-byte aligned
 * store (streaming stores need it), the vector body in one pass (`run16_avx2`), a scalar tail; returns the
 * NaN/Inf count (counted exactly only where the body's check found one). */
static inline int64_t copy_row16_check_finite(const uint16_t *in, uint16_t *out, int64_t n, int stream, int dtype,
                                              int64_t first, uint64_t *sums) {
    const uint16_t emask = dtype == DT_BF16 ? 0x7F80u : (dtype == DT_FP16 ? 0x7C00u : 0);
    int64_t head = 0;
    if (stream && ((uintptr_t)out & 1) == 0) {
        head = (int64_t)(((32 - ((uintptr_t)out & 31)) & 31) / 2);
        head = head < n ? head : n;
    } else {
        stream = 0;
    }
    const int64_t body = (n - head) & ~(int64_t)15, rest = head + body;
    uint64_t S = 0, T = 0;
    int any_bad = 0;
    memcpy(out, in, (size_t)head * 2);
    add_run(in, head, 2, first, sums);
    run16_avx2(in + head, out + head, body, stream, emask, &S, &T, &any_bad);
    sums[0] += S;
    sums[1] += ((uint64_t)(first + head) + 1) * S + T;
    memcpy(out + rest, in + rest, (size_t)(n - rest) * 2);
    add_run(in + rest, n - rest, 2, first + rest, sums);
    int64_t bad = count_nonfinite((const char *)in, head * 2, dtype) +
                  count_nonfinite((const char *)(in + rest), (n - rest) * 2, dtype);
    if (any_bad) bad += count_nonfinite((const char *)(in + head), body * 2, dtype);
    return bad;
}
#endif

/* Copy `rows` rows of `row_bytes` (strides in bytes), count the NaN/Inf elements copied (dtype < 0: no check)
 * and add the copy's checksum sums (elements of esize bytes; dst element (r, c) has flat index
 * (row0 + r) * ncols + col0 + c in its tensor). 16-bit elements (BF16, the bulk of a sync) with AVX2 take one
 * vector pass (`copy_row16_check_finite`); others work in 16 KiB pieces: the check and the sums read each piece of
 * the source while it is in L1 (the same bytes the copy writes). Large copies stream past the caches. */
int64_t bridge_copy_rows_check_finite(const void *src, int64_t src_stride, void *dst, int64_t dst_stride,
                                      int64_t rows, int64_t row_bytes, int dtype, int esize, int64_t row0,
                                      int64_t ncols, int64_t col0, uint64_t *sums) {
    const int64_t piece = 16384;
    const int stream = rows * row_bytes >= STREAM_COPY_BYTES;
    int64_t bad = 0;
#if defined(__AVX2__)
    if (esize == 2) {
        for (int64_t r = 0; r < rows; ++r)
            bad += copy_row16_check_finite((const uint16_t *)((const char *)src + r * src_stride),
                                           (uint16_t *)((char *)dst + r * dst_stride), row_bytes / 2, stream, dtype,
                                           (row0 + r) * ncols + col0, sums);
        if (stream) _mm_sfence();
        return bad;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
        const char *in = (const char *)src + r * src_stride;
        char *out = (char *)dst + r * dst_stride;
        for (int64_t off = 0; off < row_bytes; off += piece) {
            int64_t len = row_bytes - off < piece ? row_bytes - off : piece;
            bad += count_nonfinite(in + off, len, dtype);
            add_run(in + off, len / esize, esize, (row0 + r) * ncols + col0 + off / esize, sums);
            if (stream)
                stream_copy(out + off, in + off, len);
            else
                memcpy(out + off, in + off, (size_t)len);
        }
    }
#if defined(__x86_64__)
    if (stream) _mm_sfence(); /* streaming stores are weakly ordered: make them visible before the caller signals */
#endif
    return bad;
}

/* float8_e4m3fn code -> its value (exact), from its bits: no libm call per group. */
static inline float e4m3_to_f32(uint8_t c) {
    const uint32_t e = (c >> 3) & 0xF, m = c & 7;
    /* 2^(e - 7) x 1.m, or subnormal: m x 2^-9 */
    const float v = e ? f32_of_bits(((e + 120u) << 23) | (m << 20)) : (float)m * (1.0f / 512.0f);
    return (c & 0x80) ? -v : v;
}

/* 2^k for -126 <= k <= 127, exactly, from its bits. */
static inline float pow2f(int k) { return f32_of_bits((uint32_t)(k + 127) << 23); }

/* e2m1 code (sign << 3 | magnitude index) of x: |x| saturated at 6 and rounded to the nearest of 0, 0.5, 1, 1.5, 2,
 * 3, 4, 6, ties to the even index. The grid's step is 0.5 below 2, 1 below 4 and 2 above: rint (half to even) of
 * |x| / step is the index's part, as in kernels/fp4/format.py. Branch-free and without rintf, so that the group
 * loops vectorise. */
static inline float round_half_even(float y) { /* 0 <= y < 2^22: adding 1.5 * 2^23 rounds to an integer, RNE */
    return (y + 12582912.0f) - 12582912.0f;
}

static inline uint8_t f32_to_e2m1(float x) {
    const float a = fminf(fabsf(x), 6.0f);
    const float low = round_half_even(a * 2.0f), mid = round_half_even(a) + 2.0f,
                high = round_half_even(a * 0.5f) + 4.0f;
    const float index = low + (float)(a >= 2.0f) * (mid - low) + (float)(a >= 4.0f) * (high - mid);
    return (uint8_t)((int)index | ((int)(x < 0.0f) << 3));
}

/* A 4-bit group's 16 consecutive elements of a row (bf16 or fp32) as fp32 values, whole in registers: one AVX-512
 * vector, two AVX2 vectors, or an array. Each group is read once: its amax and its codes come from the same lanes. */
#if defined(__AVX512F__)
typedef struct { __m512 v; } lanes16;

static inline lanes16 lanes16_load(const char *row, int dtype, int64_t c) {
    if (dtype == DT_FP32) return (lanes16){_mm512_loadu_ps((const float *)row + c)};
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c));
    return (lanes16){_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}

/* The lanes' raw fp32 magnitude bits (order-preserving), in one vector. */
static inline __m512i magnitude_bits16(lanes16 x) {
    return _mm512_and_si512(_mm512_castps_si512(x.v), _mm512_set1_epi32(0x7FFFFFFF));
}

/* The largest |x| of the lanes as raw fp32 magnitude bits (>= 0x7F800000: a NaN/Inf among them). */
static inline uint32_t lanes16_amax_bits(lanes16 x) { return _mm512_reduce_max_epu32(magnitude_bits16(x)); }

/* f32_to_e2m1 of x * factor, lane for lane, packed two per byte into out[0..8). */
static inline void lanes16_pack(lanes16 x, float factor, uint8_t *out) {
    const __m512 y = _mm512_mul_ps(x.v, _mm512_set1_ps(factor)), magic = _mm512_set1_ps(12582912.0f);
    /* min returns its second operand where a lane is NaN: 6, as fminf does */
    const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(y),
                                                                        _mm512_set1_epi32(0x7FFFFFFF))),
                                   _mm512_set1_ps(6.0f));
    const __m512 low = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(a, _mm512_set1_ps(2.0f)), magic), magic);
    const __m512 mid = _mm512_add_ps(_mm512_sub_ps(_mm512_add_ps(a, magic), magic), _mm512_set1_ps(2.0f));
    const __m512 high = _mm512_add_ps(
        _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(a, _mm512_set1_ps(0.5f)), magic), magic), _mm512_set1_ps(4.0f));
    __m512 index = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_GE_OQ), low, mid);
    index = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_GE_OQ), index, high);
    __m512i code = _mm512_cvttps_epi32(index);
    code = _mm512_mask_or_epi32(code, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ), code,
                                _mm512_set1_epi32(8));
    /* each 64-bit lane's low byte: its even code | its odd code << 4 */
    _mm_storel_epi64((__m128i *)out, _mm512_cvtepi64_epi8(_mm512_or_si512(code, _mm512_srli_epi64(code, 28))));
}
#elif defined(__AVX2__)
typedef struct { __m256 lo, hi; } lanes16;

static inline __m256 load8_ps(const char *row, int dtype, int64_t c) {
    if (dtype == DT_FP32) return _mm256_loadu_ps((const float *)row + c);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline lanes16 lanes16_load(const char *row, int dtype, int64_t c) {
    return (lanes16){load8_ps(row, dtype, c), load8_ps(row, dtype, c + 8)};
}

/* The lanes' raw fp32 magnitude bits, the two halves' larger ones in one vector. */
static inline __m256i magnitude_bits16(lanes16 x) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    return _mm256_max_epu32(_mm256_and_si256(_mm256_castps_si256(x.lo), magnitude),
                            _mm256_and_si256(_mm256_castps_si256(x.hi), magnitude));
}

static inline uint32_t lanes16_amax_bits(lanes16 x) {
    const __m256i m = magnitude_bits16(x);
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(h);
}

/* lanes16_pack's eight lanes: their four bytes. */
static inline uint32_t e2m1_pack8(__m256 x, __m256 factor) {
    const __m256 y = _mm256_mul_ps(x, factor), magic = _mm256_set1_ps(12582912.0f);
    const __m256 a = _mm256_min_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(y),
                                                                        _mm256_set1_epi32(0x7FFFFFFF))),
                                   _mm256_set1_ps(6.0f));
    const __m256 low = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(a, _mm256_set1_ps(2.0f)), magic), magic);
    const __m256 mid = _mm256_add_ps(_mm256_sub_ps(_mm256_add_ps(a, magic), magic), _mm256_set1_ps(2.0f));
    const __m256 high = _mm256_add_ps(
        _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(a, _mm256_set1_ps(0.5f)), magic), magic), _mm256_set1_ps(4.0f));
    __m256 index = _mm256_blendv_ps(low, mid, _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_GE_OQ));
    index = _mm256_blendv_ps(index, high, _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_GE_OQ));
    const __m256i negative = _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ));
    const __m256i code = _mm256_or_si256(_mm256_cvttps_epi32(index),
                                         _mm256_and_si256(negative, _mm256_set1_epi32(8)));
    /* each 64-bit lane's low byte (its pair), then the two pairs of each 128-bit half side by side */
    const __m256i pairs = _mm256_shuffle_epi8(_mm256_or_si256(code, _mm256_srli_epi64(code, 28)),
                                              _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                               -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                               -1, -1, -1, -1));
    return (uint32_t)(uint16_t)_mm256_extract_epi16(pairs, 0) |
           (uint32_t)(uint16_t)_mm256_extract_epi16(pairs, 8) << 16;
}

static inline void lanes16_pack(lanes16 x, float factor, uint8_t *out) {
    const __m256 f = _mm256_set1_ps(factor);
    const uint32_t lo = e2m1_pack8(x.lo, f), hi = e2m1_pack8(x.hi, f);
    memcpy(out, &lo, 4);
    memcpy(out + 4, &hi, 4);
}
#else
typedef struct { float x[16]; } lanes16;

static inline lanes16 lanes16_load(const char *row, int dtype, int64_t c) {
    lanes16 l;
    if (dtype == DT_FP32) {
        memcpy(l.x, (const float *)row + c, sizeof l.x);
    } else {
        const uint16_t *p = (const uint16_t *)row + c;
        for (int k = 0; k < 16; ++k) l.x[k] = bf16_to_f32(p[k]);
    }
    return l;
}

static inline uint32_t lanes16_amax_bits(lanes16 x) {
    uint32_t m = 0;
    for (int k = 0; k < 16; ++k) {
        uint32_t v;
        memcpy(&v, &x.x[k], 4);
        v &= 0x7FFFFFFFu;
        m = v > m ? v : m;
    }
    return m;
}

static inline void lanes16_pack(lanes16 x, float factor, uint8_t *out) {
    for (int k = 0; k < 8; ++k)
        out[k] = (uint8_t)(f32_to_e2m1(x.x[2 * k] * factor) | (f32_to_e2m1(x.x[2 * k + 1] * factor) << 4));
}
#endif

/* 1/6 rounded to fp32: vLLM's reference multiplies a group's amax by it (e2m1's largest value is 6). */
#define ONE_SIXTH ((float)(1.0 / 6.0))

/* One NVFP4 group (16 elements from column 16j of a row): its e4m3 scale into *s, its packed codes into q[8j..);
 * -1 if it holds a NaN/Inf. */
static inline int nvfp4_group(const char *row, int dtype, int64_t j, float g, float inv_g, uint8_t *q, uint8_t *s) {
    const lanes16 x = lanes16_load(row, dtype, j * 16);
    const uint32_t amax_bits = lanes16_amax_bits(x);
    if (amax_bits >= 0x7F800000u) return -1;
    float scale = g * (f32_of_bits(amax_bits) * ONE_SIXTH);
    scale = scale > 448.0f ? 448.0f : (scale < -448.0f ? -448.0f : scale);
    const uint8_t code = f32_to_e4m3(scale);
    *s = code;
    const float restored = e4m3_to_f32(code) * inv_g;
    lanes16_pack(x, 1.0f / (restored == 0.0f ? 1e8f : restored), q + j * 8);
    return 0;
}

/* The e8m0 exponent of an MXFP4 group whose amax has magnitude bits `bits`. */
static inline int mx_shared_exponent(uint32_t bits) {
    int shared;
    if (bits >> 23) { /* normal: floor(log2 amax) = E - 127; round up where the mantissa is >= 1.75 */
        shared = (int)(bits >> 23) - 127 + ((bits >> 21 & 3u) == 3u) - 2;
    } else { /* zero or subnormal */
        int exponent;
        const float mantissa = frexpf(f32_of_bits(bits), &exponent); /* amax = mantissa * 2^exponent, [0.5, 1) */
        shared = exponent - 1 + (mantissa >= 0.875f) - 2;
    }
    return shared < -127 ? -127 : (shared > 127 ? 127 : shared);
}

/* One MXFP4 group (32 elements from column 32j): its e8m0 scale into *s, its packed codes into q[16j..); -1 if it
 * holds a NaN/Inf. */
static inline int mxfp4_group(const char *row, int dtype, int64_t j, uint8_t *q, uint8_t *s) {
    const lanes16 x0 = lanes16_load(row, dtype, j * 32), x1 = lanes16_load(row, dtype, j * 32 + 16);
    const uint32_t bits0 = lanes16_amax_bits(x0), bits1 = lanes16_amax_bits(x1);
    const uint32_t bits = bits0 > bits1 ? bits0 : bits1;
    if (bits >= 0x7F800000u) return -1;
    const int shared = mx_shared_exponent(bits);
    *s = (uint8_t)(shared + 127);
    const float factor = shared < 127 ? pow2f(-shared) : ldexpf(1.0f, -shared); /* 2^-127: subnormal */
    lanes16_pack(x0, factor, q + j * 16);
    lanes16_pack(x1, factor, q + j * 16 + 8);
    return 0;
}

/* GROUP_BATCH groups' scales at once: their amaxes gathered into one vector by a transposed reduction (instead of
 * one horizontal reduction each) and their scales and factors computed lane-parallel, with the per-group paths'
 * operations. Per group, that scalar work cost more than quantizing its 16 elements. */
#if defined(__AVX512F__)
#define GROUP_BATCH 16
typedef __m512i group_bits;

/* Lane k: the largest magnitude bits of m[k] (16 vectors of partial maxima), in group order. */
static inline group_bits batch_amax_bits(const __m512i *m) {
    __m512i b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) /* 256-bit halves: groups 2i, 2i+1 */
        b[i] = _mm512_max_epu32(_mm512_shuffle_i32x4(m[2 * i], m[2 * i + 1], 0x44),
                                _mm512_shuffle_i32x4(m[2 * i], m[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i) /* 128-bit lanes: groups 4i..4i+3 */
        c[i] = _mm512_max_epu32(_mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i) /* lane L: group 8i + L at dwords 0 and 2, 8i + 4 + L at 1 and 3 */
        d[i] = _mm512_max_epu32(_mm512_unpacklo_epi32(c[2 * i], c[2 * i + 1]),
                                _mm512_unpackhi_epi32(c[2 * i], c[2 * i + 1]));
    /* lane L: groups L, 8 + L, 4 + L, 12 + L */
    const __m512i e = _mm512_max_epu32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15), e);
}

static inline __m512i max_bits16(__m512i a, __m512i b) { return _mm512_max_epu32(a, b); }

static inline int batch_any_nonfinite(group_bits bits) {
    return _mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32(0x7F800000)) != 0;
}

/* NVFP4 scales of the batch (e4m3 codes into s[0..16)) and their codes' factors. */
static inline void nvfp4_batch_scales(group_bits bits, float g, float inv_g, uint8_t *s, float *factors) {
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(g),
                                       _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(ONE_SIXTH)));
    const __m512i code = e4m3_lanes(scale); /* clamped to +-448 on the way, as the per-group path clamps */
    _mm_storeu_si128((__m128i *)s, _mm512_cvtepi32_epi8(code));
    /* e4m3_to_f32: normal codes from their bits, subnormal ones as m x 2^-9 (no sign: g > 0, so scales are >= 0) */
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(code, 3), _mm512_set1_epi32(0xF));
    const __m512i m = _mm512_and_si512(code, _mm512_set1_epi32(7));
    const __m512 normal = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(m, 20)));
    const __m512 tiny = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(1.0f / 512.0f));
    const __m512 restored = _mm512_mul_ps(
        _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), normal, tiny),
        _mm512_set1_ps(inv_g));
    const __m512 safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(restored, _mm512_setzero_ps(), _CMP_EQ_OQ),
                                             restored, _mm512_set1_ps(1e8f));
    _mm512_storeu_ps(factors, _mm512_div_ps(_mm512_set1_ps(1.0f), safe));
}

/* MXFP4 scales of the batch (e8m0 bytes into s[0..16)) and their factors; 0, or -1 (nothing written) where an amax
 * is zero or subnormal: the per-group path takes those batches. */
static inline int mxfp4_batch_scales(group_bits bits, uint8_t *s, float *factors) {
    const __m512i exponent = _mm512_srli_epi32(bits, 23);
    if (_mm512_cmpeq_epi32_mask(exponent, _mm512_setzero_si512())) return -1;
    const __m512i top = _mm512_srli_epi32(bits, 21); /* round up where mantissa bits 22 and 21 are both set */
    const __m512i round_up = _mm512_and_si512(_mm512_srli_epi32(top, 1), _mm512_and_si512(top, _mm512_set1_epi32(1)));
    __m512i shared = _mm512_add_epi32(_mm512_sub_epi32(exponent, _mm512_set1_epi32(129)), round_up);
    shared = _mm512_max_epi32(shared, _mm512_set1_epi32(-127)); /* normal amaxes never reach 127 */
    _mm_storeu_si128((__m128i *)s, _mm512_cvtepi32_epi8(_mm512_add_epi32(shared, _mm512_set1_epi32(127))));
    _mm512_storeu_ps(factors, _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_sub_epi32(_mm512_set1_epi32(127), shared), 23)));
    return 0;
}
#elif defined(__AVX2__)
#define GROUP_BATCH 8
typedef __m256i group_bits;

static inline group_bits batch_amax_bits(const __m256i *m) {
    __m256i b[4], d[2];
    for (int i = 0; i < 4; ++i) /* 128-bit halves: groups 2i, 2i+1 */
        b[i] = _mm256_max_epu32(_mm256_permute2x128_si256(m[2 * i], m[2 * i + 1], 0x20),
                                _mm256_permute2x128_si256(m[2 * i], m[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i) /* half H: group 4i + H at dwords 0 and 2, 4i + 2 + H at 1 and 3 */
        d[i] = _mm256_max_epu32(_mm256_unpacklo_epi32(b[2 * i], b[2 * i + 1]),
                                _mm256_unpackhi_epi32(b[2 * i], b[2 * i + 1]));
    /* half H: groups H, 4 + H, 2 + H, 6 + H */
    const __m256i e = _mm256_max_epu32(_mm256_unpacklo_epi32(d[0], d[1]), _mm256_unpackhi_epi32(d[0], d[1]));
    return _mm256_permutevar8x32_epi32(e, _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7));
}

static inline __m256i max_bits16(__m256i a, __m256i b) { return _mm256_max_epu32(a, b); }

static inline int batch_any_nonfinite(group_bits bits) { /* magnitudes are below 2^31: signed compares order them */
    return _mm256_movemask_epi8(_mm256_cmpgt_epi32(bits, _mm256_set1_epi32(0x7F7FFFFF))) != 0;
}

/* the batch's eight 32-bit lanes' low bytes into out[0..8) */
static inline void store_low_bytes8(__m256i v, uint8_t *out) {
    const __m256i words = _mm256_packus_epi32(v, v), bytes = _mm256_packus_epi16(words, words);
    const uint32_t lo = (uint32_t)_mm256_extract_epi32(bytes, 0), hi = (uint32_t)_mm256_extract_epi32(bytes, 4);
    memcpy(out, &lo, 4);
    memcpy(out + 4, &hi, 4);
}

static inline void nvfp4_batch_scales(group_bits bits, float g, float inv_g, uint8_t *s, float *factors) {
    const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(g),
                                       _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(ONE_SIXTH)));
    const __m256i code = e4m3_lanes_avx2(scale);
    store_low_bytes8(code, s);
    const __m256i e = _mm256_and_si256(_mm256_srli_epi32(code, 3), _mm256_set1_epi32(0xF));
    const __m256i m = _mm256_and_si256(code, _mm256_set1_epi32(7));
    const __m256 normal = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23), _mm256_slli_epi32(m, 20)));
    const __m256 tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(1.0f / 512.0f));
    const __m256 restored = _mm256_mul_ps(
        _mm256_blendv_ps(normal, tiny, _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()))),
        _mm256_set1_ps(inv_g));
    const __m256 safe = _mm256_blendv_ps(restored, _mm256_set1_ps(1e8f),
                                         _mm256_cmp_ps(restored, _mm256_setzero_ps(), _CMP_EQ_OQ));
    _mm256_storeu_ps(factors, _mm256_div_ps(_mm256_set1_ps(1.0f), safe));
}

static inline int mxfp4_batch_scales(group_bits bits, uint8_t *s, float *factors) {
    const __m256i exponent = _mm256_srli_epi32(bits, 23);
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()))) return -1;
    const __m256i top = _mm256_srli_epi32(bits, 21);
    const __m256i round_up = _mm256_and_si256(_mm256_srli_epi32(top, 1), _mm256_and_si256(top, _mm256_set1_epi32(1)));
    __m256i shared = _mm256_add_epi32(_mm256_sub_epi32(exponent, _mm256_set1_epi32(129)), round_up);
    shared = _mm256_max_epi32(shared, _mm256_set1_epi32(-127));
    store_low_bytes8(_mm256_add_epi32(shared, _mm256_set1_epi32(127)), s);
    _mm256_storeu_ps(factors, _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_sub_epi32(_mm256_set1_epi32(127), shared), 23)));
    return 0;
}
#endif

/* NVFP4: w [m, n] (row stride w_stride elements, bf16 or fp32, n a multiple of 16) -> packed e2m1 codes q [m, n/2]
 * (row stride q_stride bytes, element 2i in the low nibble of byte i) and e4m3 scales s [m, n/16] (row stride
 * s_stride), operation for operation vLLM's ref_nvfp4_quant with global scale g: s = e4m3(clamp(g * (amax * (1/6)),
 * +-448)), codes = e2m1(clamp(w * 1 / (s * (1 / g)), +-6)). Returns 0, or -1 if a value is NaN/Inf. */
int bridge_nvfp4_quantize(const void *w, int dtype, int64_t m, int64_t n, int64_t w_stride, float g, uint8_t *q,
                          int64_t q_stride, uint8_t *s, int64_t s_stride) {
    const int64_t esize = dtype == DT_FP32 ? 4 : 2, groups = n / 16;
    const float inv_g = 1.0f / (g == 0.0f ? 1e8f : g);
    for (int64_t r = 0; r < m; ++r) {
        const char *row = (const char *)w + r * w_stride * esize;
        uint8_t *q_row = q + r * q_stride, *s_row = s + r * s_stride;
        int64_t j = 0;
#if defined(GROUP_BATCH)
        for (; j + GROUP_BATCH <= groups; j += GROUP_BATCH) {
            lanes16 x[GROUP_BATCH];
            group_bits partial[GROUP_BATCH];
            float factors[GROUP_BATCH];
            for (int k = 0; k < GROUP_BATCH; ++k) {
                x[k] = lanes16_load(row, dtype, (j + k) * 16);
                partial[k] = magnitude_bits16(x[k]);
            }
            const group_bits bits = batch_amax_bits(partial);
            if (batch_any_nonfinite(bits)) return -1;
            nvfp4_batch_scales(bits, g, inv_g, s_row + j, factors);
            for (int k = 0; k < GROUP_BATCH; ++k) lanes16_pack(x[k], factors[k], q_row + (j + k) * 8);
        }
#endif
        for (; j < groups; ++j)
            if (nvfp4_group(row, dtype, j, g, inv_g, q_row, s_row + j)) return -1;
    }
    return 0;
}

/* MXFP4 (OCP MX, e2m1 elements): w [m, n] (bf16 or fp32, n a multiple of 32) -> packed e2m1 codes q [m, n/2] and
 * e8m0 scales s [m, n/32] = 127 + e, e = floor(log2 amax) - 2, one higher where amax's mantissa is >= 1.75 (as
 * compressed-tensors' generate_mx_scales), clamped to +-127; codes = e2m1(w * 2^-e). Returns 0, or -1 if a value is
 * NaN/Inf. */
int bridge_mxfp4_quantize(const void *w, int dtype, int64_t m, int64_t n, int64_t w_stride, uint8_t *q,
                          int64_t q_stride, uint8_t *s, int64_t s_stride) {
    const int64_t esize = dtype == DT_FP32 ? 4 : 2, groups = n / 32;
    for (int64_t r = 0; r < m; ++r) {
        const char *row = (const char *)w + r * w_stride * esize;
        uint8_t *q_row = q + r * q_stride, *s_row = s + r * s_stride;
        int64_t j = 0;
#if defined(GROUP_BATCH)
        for (; j + GROUP_BATCH <= groups; j += GROUP_BATCH) {
            lanes16 x[2 * GROUP_BATCH];
            group_bits partial[GROUP_BATCH];
            float factors[GROUP_BATCH];
            for (int k = 0; k < GROUP_BATCH; ++k) {
                x[2 * k] = lanes16_load(row, dtype, (j + k) * 32);
                x[2 * k + 1] = lanes16_load(row, dtype, (j + k) * 32 + 16);
                partial[k] = max_bits16(magnitude_bits16(x[2 * k]), magnitude_bits16(x[2 * k + 1]));
            }
            const group_bits bits = batch_amax_bits(partial);
            if (batch_any_nonfinite(bits)) return -1;
            if (mxfp4_batch_scales(bits, s_row + j, factors)) {
                for (int k = 0; k < GROUP_BATCH; ++k) mxfp4_group(row, dtype, j + k, q_row, s_row + j + k);
                continue;
            }
            for (int k = 0; k < GROUP_BATCH; ++k) {
                lanes16_pack(x[2 * k], factors[k], q_row + (j + k) * 16);
                lanes16_pack(x[2 * k + 1], factors[k], q_row + (j + k) * 16 + 8);
            }
        }
#endif
        for (; j < groups; ++j)
            if (mxfp4_group(row, dtype, j, q_row, s_row + j)) return -1;
    }
    return 0;
}
