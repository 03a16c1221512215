// Internal to the packed-weight kernels, next to packed_blocks.h: the 5-bit formats Q5_0 and
// Q5_1 (32-value blocks) and the K-quants Q2_K-Q6_K (256-value super-blocks, widened
// 32 values at a time), in ggml's layouts. Each gives exactly gguf's dequantized floats:
// every scale is an fp16 times a small integer and every quant a small integer, so
// d * sc * q is exact in fp32 (Q6_K's widest product, 11 + 7 + 5 bits, still fits 24), and
// the one rounding left, the K-quants' "- dmin * m" and Q5_1's "+ m", happens once as in
// gguf (a fused multiply-add rounds the same exact product the same way).
//
// A K-quant super-block's scales are decoded once (prepare, into a State of fp32 multipliers)
// and then used by its eight pieces: decoding the packed 6-bit scales again in every piece
// cost more than the widening itself at one input row.
#pragma once

#include <cstdint>

#include "packed_blocks.h"

namespace deepinfer {
namespace packed_detail {

// The 6-bit scale and min of piece j (0-7) of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4).
inline void kquant_scale_min(const uint8_t *q, int j, int *sc, int *m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

#ifdef DEEPINFER_PACKED_AVX2

DEEPINFER_AVX2_FN float half_at(const uint8_t *p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A Q4_K/Q5_K super-block's multipliers d * sc and subtrahends, negated, -(dmin * m), per piece.
struct KScales {
  alignas(32) float d[8], m[8];
};

// A Q6_K super-block's multipliers d * sc, per 16 values.
struct K6Scales {
  alignas(32) float d[16];
};

// kquant_scale_min for all eight pieces at once, four bytes to a word (llama.cpp's trick): the
// low six bits of words A and B are pieces 0-3's scales and mins; pieces 4-7 take word C's
// nibbles and A's and B's top two bits.
DEEPINFER_AVX2_FN void prepare_k(const uint8_t *b, KScales &st) {
  uint32_t w[3];
  std::memcpy(w, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3f, nib = 0x0f0f0f0f, top2 = 0x30303030;
  const uint64_t sc = (w[0] & low6) | static_cast<uint64_t>((w[2] & nib) | ((w[0] >> 2) & top2)) << 32;
  const uint64_t m = (w[1] & low6) | static_cast<uint64_t>(((w[2] >> 4) & nib) | ((w[1] >> 2) & top2)) << 32;
  const __m256 d = _mm256_set1_ps(half_at(b)), dmin = _mm256_set1_ps(-half_at(b + 2));
  _mm256_store_ps(st.d, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc)))));
  _mm256_store_ps(st.m, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m)))));
}

DEEPINFER_AVX2_FN void prepare_k6(const uint8_t *b, K6Scales &st) {
  const __m256 d = _mm256_set1_ps(half_at(b + 208));
  for (int h = 0; h < 2; ++h) {
    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 192 + 8 * h)));
    _mm256_store_ps(st.d + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
  }
}

// ---- AVX2: one row ----

// 32 int8 bytes, value j in byte j, as four vectors of eight 32-bit lanes: values 8i..8i+7 in
// q[i]. Q6_K and Q5 do their bit work on a block's 32 value bytes at once and widen last (in
// 32-bit lanes it took more instructions for every 8 values). The bytes go through a stack
// copy: each group is then one sign-extending load, where taking it out of the register took
// a shuffle more; the empty asm keeps the compiler from turning the copy back into shuffles.
DEEPINFER_AVX2_FN void byte_values(__m256i bytes, __m256i q[4]) {
  alignas(32) int8_t v[32];
  _mm256_store_si256(reinterpret_cast<__m256i *>(v), bytes);
  asm volatile("" : : "r"(v) : "memory");
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(v + 8 * i)));
}

// A Q5 block's 32 values as bytes, value j in byte j: nibble j % 16 of byte j of qs (low for
// j < 16, high after) and bit j of qh, spread to bytes by a shuffle and a compare for all 32
// values at once. Q5_0 (`centered`) gets q - 16 as int8 (the nibble with 0xf0 where the bit
// is clear), Q5_1 q itself.
DEEPINFER_AVX2_FN __m256i q5_bytes(const uint8_t *qh_bytes, const uint8_t *qs, bool centered) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                                              2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return centered ? _mm256_or_si256(nib, _mm256_andnot_si256(set, _mm256_set1_epi8(static_cast<char>(0xf0))))
                  : _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

// A Q5 block's values as floats: q[i] = values 8i..8i+7.
DEEPINFER_AVX2_FN void q5_values(__m256i bytes, __m256 q[4]) {
  __m256i v[4];
  byte_values(bytes, v);
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtepi32_ps(v[i]);
}

DEEPINFER_AVX2_FN void widen_q5_0(const uint8_t *b, int, const NoState &, __m256 w[4]) {
  const __m256 d = scale_vec(b);
  q5_values(q5_bytes(b + 2, b + 6, true), w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, w[i]);
}

DEEPINFER_AVX2_FN void widen_q5_1(const uint8_t *b, int, const NoState &, __m256 w[4]) {
  const __m256 d = scale_vec(b), m = scale_vec(b + 2);
  q5_values(q5_bytes(b + 4, b + 8, false), w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, w[i], m);
}

// Piece s of a Q4_K super-block (d, dmin, 12 scale bytes, 128 quant bytes): the low nibbles
// of quant bytes 32(s/2)..+31 for even s, the high ones for odd s.
DEEPINFER_AVX2_FN void widen_q4_k(const uint8_t *b, int s, const KScales &st, __m256 w[4]) {
  const __m256 d = _mm256_broadcast_ss(st.d + s), m = _mm256_broadcast_ss(st.m + s);
  const uint8_t *qs = b + 16 + 32 * (s >> 1);
  const __m128i shift = _mm_cvtsi32_si128(4 * (s & 1));
  const __m256i mask = _mm256_set1_epi32(0x0f);
  for (int i = 0; i < 4; ++i) {
    const __m256i q = _mm256_and_si256(_mm256_srl_epi32(bytes8(qs + 8 * i), shift), mask);
    w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
  }
}

// Piece s of a Q5_K super-block (d, dmin, 12 scale bytes, 32 bytes of fifth bits, 128 quant
// bytes): Q4_K's nibbles plus bit s of fifth-bit byte l for value l.
DEEPINFER_AVX2_FN void widen_q5_k(const uint8_t *b, int s, const KScales &st, __m256 w[4]) {
  const __m256 d = _mm256_broadcast_ss(st.d + s), m = _mm256_broadcast_ss(st.m + s);
  const uint8_t *qh = b + 16, *qs = b + 48 + 32 * (s >> 1);
  const __m128i shift = _mm_cvtsi32_si128(4 * (s & 1)), hshift = _mm_cvtsi32_si128(s);
  const __m256i mask = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
  for (int i = 0; i < 4; ++i) {
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(bytes8(qs + 8 * i), shift), mask);
    const __m256i hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(bytes8(qh + 8 * i), hshift), one), 4);
    w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_or_si256(lo, hi)), m);
  }
}

// Piece s of a Q6_K super-block (128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales
// of 16 values each, d): in half h = s / 4, piece c = s % 4 takes nibble c / 2 of low bytes
// 64h + 32(c % 2)..+31 and bits 2c, 2c+1 of high bytes 32h..+31, minus 32.
DEEPINFER_AVX2_FN void widen_q6_k(const uint8_t *b, int s, const K6Scales &st, __m256 w[4]) {
  const int h = s >> 2, c = s & 3;
  const uint8_t *ql = b + 64 * h + 32 * (c & 1), *qh = b + 128 + 32 * h;
  const __m256 d0 = _mm256_broadcast_ss(st.d + 2 * s), d1 = _mm256_broadcast_ss(st.d + 2 * s + 1);
  const __m128i lshift = _mm_cvtsi32_si128(4 * (c >> 1)), hshift = _mm_cvtsi32_si128(2 * c);
  // Shifts in 16-bit lanes, then a byte mask: each byte keeps only its own bits.
  const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(ql)), lshift),
                                      _mm256_set1_epi8(0x0f));
  const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(qh)), hshift),
                                      _mm256_set1_epi8(3));
  __m256i q[4];
  byte_values(_mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32)), q);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(i < 2 ? d0 : d1, _mm256_cvtepi32_ps(q[i]));
}

// ---- AVX-512: the same piece of two rows, one per 256-bit half ----

// The same multiplier of rows a and b, one per half.
DEEPINFER_AVX512_FN __m512 floats_pair(const float *a, const float *b) {
  return _mm512_insertf32x8(_mm512_set1_ps(*a), _mm256_broadcast_ss(b), 1);
}

// 32 bytes of a piece in each row (a K-quant's piece takes one byte per value), each byte
// already reduced to its value: q[i] holds values 8i..8i+7 of row a, then of row b, widened
// to 32 bits (Signed: as int8).
template <bool Signed>
DEEPINFER_AVX512_FN void piece_bytes_pair(__m256i va, __m256i vb, __m512i q[4]) {
  const __m256i lo = _mm256_unpacklo_epi64(va, vb);  // bytes 0-7 of a, of b | 16-23 of a, of b
  const __m256i hi = _mm256_unpackhi_epi64(va, vb);  // bytes 8-15 | 24-31
  const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi), _mm256_extracti128_si256(lo, 1),
                            _mm256_extracti128_si256(hi, 1)};
  for (int i = 0; i < 4; ++i) q[i] = Signed ? _mm512_cvtepi8_epi32(parts[i]) : _mm512_cvtepu8_epi32(parts[i]);
}

DEEPINFER_AVX512_FN __m256i load32(const uint8_t *p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
}

// The 4-bit fields at bit `shift` of each of 32 bytes (shifts in 16-bit lanes, then a byte mask).
DEEPINFER_AVX512_FN __m256i byte_field(__m256i v, __m128i shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, shift), _mm256_set1_epi8(static_cast<char>(mask)));
}

// A Q5 block's 32 values of one row as bytes, in order: its 16 bytes' low nibbles (values
// 0-15) then high ones (16-31), bit j of the fifth-bit word setting 16 in byte j (a mask
// register does the spreading).
DEEPINFER_AVX512_FN __m256i q5_bytes(const uint8_t *qh_bytes, const uint8_t *qs) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs)), mask = _mm_set1_epi8(0x0f);
  const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
  return _mm256_or_si256(nibbles, _mm256_maskz_set1_epi8(qh, 16));
}

DEEPINFER_AVX512_FN void widen_pair_q5_0(const uint8_t *a, const uint8_t *b, int, const NoState &, const NoState &,
                                         __m512 w[4]) {
  __m512 d;
  scales_pair<1>(a, b, &d);
  const __m256i sixteen = _mm256_set1_epi8(16);
  __m512i q[4];
  piece_bytes_pair<true>(_mm256_sub_epi8(q5_bytes(a + 2, a + 6), sixteen), _mm256_sub_epi8(q5_bytes(b + 2, b + 6), sixteen),
                         q);
  for (int i = 0; i < 4; ++i) w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q[i]));
}

DEEPINFER_AVX512_FN void widen_pair_q5_1(const uint8_t *a, const uint8_t *b, int, const NoState &, const NoState &,
                                         __m512 w[4]) {
  __m512 dm[2];
  scales_pair<2>(a, b, dm);
  __m512i q[4];
  piece_bytes_pair<false>(q5_bytes(a + 4, a + 8), q5_bytes(b + 4, b + 8), q);
  for (int i = 0; i < 4; ++i) w[i] = _mm512_fmadd_ps(dm[0], _mm512_cvtepi32_ps(q[i]), dm[1]);
}

// A Q5_K piece's 32 values of one row as bytes: nibble | fifth bit << 4.
DEEPINFER_AVX512_FN __m256i q5_k_bytes(const uint8_t *r, size_t off, __m128i shift, __m128i hshift) {
  return _mm256_or_si256(byte_field(load32(r + off), shift, 0x0f),
                         _mm256_slli_epi16(byte_field(load32(r + 16), hshift, 1), 4));
}

// A Q6_K piece's 32 values of one row as int8: (nibble | two high bits << 4) - 32.
DEEPINFER_AVX512_FN __m256i q6_k_bytes(const uint8_t *r, size_t lo_off, size_t hi_off, __m128i lshift,
                                       __m128i hshift) {
  const __m256i q = _mm256_or_si256(byte_field(load32(r + lo_off), lshift, 0x0f),
                                    _mm256_slli_epi16(byte_field(load32(r + hi_off), hshift, 3), 4));
  return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
}

DEEPINFER_AVX512_FN void widen_pair_q4_k(const uint8_t *a, const uint8_t *b, int s, const KScales &sa,
                                         const KScales &sb, __m512 w[4]) {
  const __m512 d = floats_pair(sa.d + s, sb.d + s), m = floats_pair(sa.m + s, sb.m + s);
  const size_t off = 16 + 32 * (s >> 1);
  const __m128i shift = _mm_cvtsi32_si128(4 * (s & 1));
  __m512i q[4];
  piece_bytes_pair<false>(byte_field(load32(a + off), shift, 0x0f), byte_field(load32(b + off), shift, 0x0f), q);
  for (int i = 0; i < 4; ++i) w[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q[i]), m);
}

DEEPINFER_AVX512_FN void widen_pair_q5_k(const uint8_t *a, const uint8_t *b, int s, const KScales &sa,
                                         const KScales &sb, __m512 w[4]) {
  const __m512 d = floats_pair(sa.d + s, sb.d + s), m = floats_pair(sa.m + s, sb.m + s);
  const size_t off = 48 + 32 * (s >> 1);
  const __m128i shift = _mm_cvtsi32_si128(4 * (s & 1)), hshift = _mm_cvtsi32_si128(s);
  __m512i q[4];
  piece_bytes_pair<false>(q5_k_bytes(a, off, shift, hshift), q5_k_bytes(b, off, shift, hshift), q);
  for (int i = 0; i < 4; ++i) w[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q[i]), m);
}

DEEPINFER_AVX512_FN void widen_pair_q6_k(const uint8_t *a, const uint8_t *b, int s, const K6Scales &sa,
                                         const K6Scales &sb, __m512 w[4]) {
  const int h = s >> 2, c = s & 3;
  const size_t lo_off = 64 * h + 32 * (c & 1), hi_off = 128 + 32 * h;
  const __m512 d0 = floats_pair(sa.d + 2 * s, sb.d + 2 * s), d1 = floats_pair(sa.d + 2 * s + 1, sb.d + 2 * s + 1);
  const __m128i lshift = _mm_cvtsi32_si128(4 * (c >> 1)), hshift = _mm_cvtsi32_si128(2 * c);
  __m512i q[4];
  piece_bytes_pair<true>(q6_k_bytes(a, lo_off, hi_off, lshift, hshift), q6_k_bytes(b, lo_off, hi_off, lshift, hshift),
                         q);
  for (int i = 0; i < 4; ++i) w[i] = _mm512_mul_ps(i < 2 ? d0 : d1, _mm512_cvtepi32_ps(q[i]));
}

// ---- Q2_K and Q3_K: 16 scales of 16 values each, 2-bit quants (Q3_K: plus a third bit) ----
// Q2_K: 16 scale bytes (scale in the low nibble, min in the high), 64 quant bytes, d, dmin.
// Q3_K: 32 bytes of third bits, 64 quant bytes, 12 bytes of 6-bit scales (minus 32), d.
// Piece s takes bits 2t, 2t+1 (t = s % 4) of quant bytes 32(s / 4)..+31; Q3_K's third bit of
// value l is bit s of byte l, and a clear bit subtracts 4.

// Q2_K: multipliers d * sc and subtrahends -(dmin * m) per 16 values.
struct K2Scales {
  alignas(32) float d[16], m[16];
};

DEEPINFER_AVX2_FN void prepare_k2(const uint8_t *b, K2Scales &st) {
  const __m256 d = _mm256_set1_ps(half_at(b + 80)), dmin = _mm256_set1_ps(-half_at(b + 82));
  for (int h = 0; h < 2; ++h) {
    const __m256i sc = bytes8(b + 8 * h);
    _mm256_store_ps(st.d + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sc, _mm256_set1_epi32(15)))));
    _mm256_store_ps(st.m + 8 * h, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4))));
  }
}

// Q3_K: d * (sc - 32) per 16 values. Scale i's low four bits are nibble i / 8 of byte i % 8,
// its top two bits 2(i / 4) of byte 8 + i % 4: eight bytes to a word, as prepare_k does.
DEEPINFER_AVX2_FN void prepare_k3(const uint8_t *b, K6Scales &st) {
  uint64_t low;
  uint32_t high;
  std::memcpy(&low, b + 96, 8);
  std::memcpy(&high, b + 104, 4);
  const uint64_t nib = 0x0f0f0f0f0f0f0f0full;
  const uint32_t two = 0x03030303;
  const uint64_t top[2] = {(high & two) | static_cast<uint64_t>((high >> 2) & two) << 32,
                           ((high >> 4) & two) | static_cast<uint64_t>((high >> 6) & two) << 32};
  const uint64_t words[2] = {(low & nib) | top[0] << 4, ((low >> 4) & nib) | top[1] << 4};
  const __m256 d = _mm256_set1_ps(half_at(b + 108));
  for (int h = 0; h < 2; ++h) {
    const __m256i sc = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(words[h]))),
                                        _mm256_set1_epi32(32));
    _mm256_store_ps(st.d + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
  }
}

DEEPINFER_AVX2_FN void widen_q2_k(const uint8_t *b, int s, const K2Scales &st, __m256 w[4]) {
  const uint8_t *qs = b + 16 + 32 * (s >> 2);
  const __m128i shift = _mm_cvtsi32_si128(2 * (s & 3));
  for (int i = 0; i < 4; ++i) {
    const int k = 2 * s + i / 2;
    const __m256i q = _mm256_and_si256(_mm256_srl_epi32(bytes8(qs + 8 * i), shift), _mm256_set1_epi32(3));
    w[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(st.d + k), _mm256_cvtepi32_ps(q), _mm256_broadcast_ss(st.m + k));
  }
}

DEEPINFER_AVX2_FN void widen_q3_k(const uint8_t *b, int s, const K6Scales &st, __m256 w[4]) {
  const uint8_t *qs = b + 32 + 32 * (s >> 2);
  const __m128i shift = _mm_cvtsi32_si128(2 * (s & 3)), hshift = _mm_cvtsi32_si128(s);
  for (int i = 0; i < 4; ++i) {
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(bytes8(qs + 8 * i), shift), _mm256_set1_epi32(3));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(bytes8(b + 8 * i), hshift), _mm256_set1_epi32(1));
    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 2)), _mm256_set1_epi32(4));
    w[i] = _mm256_mul_ps(_mm256_broadcast_ss(st.d + 2 * s + i / 2), _mm256_cvtepi32_ps(q));
  }
}

DEEPINFER_AVX512_FN void widen_pair_q2_k(const uint8_t *a, const uint8_t *b, int s, const K2Scales &sa,
                                         const K2Scales &sb, __m512 w[4]) {
  const size_t off = 16 + 32 * (s >> 2);
  const __m128i shift = _mm_cvtsi32_si128(2 * (s & 3));
  __m512i q[4];
  piece_bytes_pair<false>(byte_field(load32(a + off), shift, 3), byte_field(load32(b + off), shift, 3), q);
  for (int i = 0; i < 4; ++i) {
    const int k = 2 * s + i / 2;
    w[i] = _mm512_fmadd_ps(floats_pair(sa.d + k, sb.d + k), _mm512_cvtepi32_ps(q[i]), floats_pair(sa.m + k, sb.m + k));
  }
}

// A Q3_K piece's 32 values of one row as int8: (two bits | third bit << 2) - 4.
DEEPINFER_AVX512_FN __m256i q3_k_bytes(const uint8_t *r, size_t off, __m128i shift, __m128i hshift) {
  const __m256i q = _mm256_or_si256(byte_field(load32(r + off), shift, 3),
                                    _mm256_slli_epi16(byte_field(load32(r), hshift, 1), 2));
  return _mm256_sub_epi8(q, _mm256_set1_epi8(4));
}

DEEPINFER_AVX512_FN void widen_pair_q3_k(const uint8_t *a, const uint8_t *b, int s, const K6Scales &sa,
                                         const K6Scales &sb, __m512 w[4]) {
  const size_t off = 32 + 32 * (s >> 2);
  const __m128i shift = _mm_cvtsi32_si128(2 * (s & 3)), hshift = _mm_cvtsi32_si128(s);
  __m512i q[4];
  piece_bytes_pair<true>(q3_k_bytes(a, off, shift, hshift), q3_k_bytes(b, off, shift, hshift), q);
  for (int i = 0; i < 4; ++i) {
    const int k = 2 * s + i / 2;
    w[i] = _mm512_mul_ps(floats_pair(sa.d + k, sb.d + k), _mm512_cvtepi32_ps(q[i]));
  }
}

// The formats as types (see packed_blocks.h's Q4_1), with the state their pieces share.
#define DEEPINFER_BLOCK_TYPE(Name, Bytes, Values, fn, StateType, prepare_fn)                           \
  struct Name {                                                                                      \
    static constexpr size_t kBytes = Bytes;                                                          \
    static constexpr int kValues = Values, kSubs = Values / 32;                                      \
    using State = StateType;                                                                         \
    DEEPINFER_AVX2_FN static void prepare(const uint8_t *b, State &st) { prepare_fn; }               \
    DEEPINFER_AVX2_FN static void widen(const uint8_t *b, int s, const State &st, __m256 w[4]) {     \
      widen_##fn(b, s, st, w);                                                                       \
    }                                                                                                \
    DEEPINFER_AVX512_FN static void widen_pair(const uint8_t *a, const uint8_t *b, int s, const State &sa, \
                                               const State &sb, __m512 w[4]) {                        \
      widen_pair_##fn(a, b, s, sa, sb, w);                                                           \
    }                                                                                                \
  };
DEEPINFER_BLOCK_TYPE(Q5_0, 22, 32, q5_0, NoState, (void)b; (void)st)
DEEPINFER_BLOCK_TYPE(Q5_1, 24, 32, q5_1, NoState, (void)b; (void)st)
DEEPINFER_BLOCK_TYPE(Q4_K, 144, 256, q4_k, KScales, prepare_k(b, st))
DEEPINFER_BLOCK_TYPE(Q5_K, 176, 256, q5_k, KScales, prepare_k(b, st))
DEEPINFER_BLOCK_TYPE(Q6_K, 210, 256, q6_k, K6Scales, prepare_k6(b, st))
DEEPINFER_BLOCK_TYPE(Q2_K, 84, 256, q2_k, K2Scales, prepare_k2(b, st))
DEEPINFER_BLOCK_TYPE(Q3_K, 110, 256, q3_k, K6Scales, prepare_k3(b, st))
#undef DEEPINFER_BLOCK_TYPE
#endif

}  // namespace packed_detail
}  // namespace deepinfer
