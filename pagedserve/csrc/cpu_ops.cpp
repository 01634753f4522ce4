// CPU kernels: the quantized matmul on GGUF codes, paged attention (decode and flash-style
// prefill), the elementwise ops around them, and the decoder layers as one call for small steps.
// Built at install by setup.py and loaded by pagedserve/kernels/cpu_ops.py; every op has a
// plain-torch reference in the Python layers, and tests/kernels/ and tests/attention/ compare them.
//
// On CPUs with AMX the int8 matmul and the bf16 flash prefill run their products on tiles
// (amx_tiles.h, amx_int8.h, amx_flash.h) where set_tiles (amx_checks.h) turned them on.
//
// Statistics, scores and accumulators are fp32: bf16 inputs widen exactly, results round once when
// stored. The quantized matmul's own numerics are described at quant_linear. The attention kernels
// and write_kv also take a quantized KV cache (int8 / fp8 e4m3 codes, one fp16 scale per head and
// token; pagedserve/attention/kv_cache.py), dequantizing each row as they load it.

#include <torch/extension.h>

#include "build_info.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_AVX512 1
#if defined(__AVX512VNNI__)
#define PAGEDSERVE_VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// CPUs without AVX-512 (AMD EPYC Zen 2 and 3, older Xeons): the exact matmul, the integer one
// and RMSNorm in 8-wide registers; the other kernels run their portable loops, vectorized by the
// compiler.
#include <immintrin.h>
#define PAGEDSERVE_AVX2 1
#endif
#if !defined(PAGEDSERVE_VNNI) && defined(__AVX2__) && defined(__F16C__)
// The integer matmul without VNNI: AVX2's forms of its dot products (also on AVX-512 CPUs that
// lack VNNI, such as Skylake-SP, whose builds include AVX2).
#define PAGEDSERVE_AVX2_INTEGER 1
#endif

namespace {

constexpr int64_t kGroup = 32;

// The compute dtypes the kernels serve: fp32 and bf16 (the callers keep their torch path for
// any other).
#define DISPATCH_FLOAT_OR_BF16(TYPE, NAME, ...)                                          \
  [&] {                                                                                \
    if ((TYPE) == at::kFloat) {                                                        \
      using scalar_t = float;                                                          \
      return __VA_ARGS__();                                                            \
    }                                                                                  \
    TORCH_CHECK((TYPE) == at::kBFloat16, NAME ": only float32 and bfloat16 are served"); \
    using scalar_t = c10::BFloat16;                                                    \
    return __VA_ARGS__();                                                              \
  }()

// ---------------------------------------------------------------------------------------------
// Loads and stores of fp32 / bf16 rows as fp32.

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(c10::Float8_e4m3fn v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

// Copy `n` values of a row to fp32.
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

#ifdef PAGEDSERVE_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// KV cache codes, exactly (their scale is applied by the caller).
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// e4m3 (s eeee mmm, bias 7) placed in an fp16 (s eeeee mmmmmmmmmm, bias 15) as s 0eeee mmm0000000
// is the same number times 2^-8, subnormals included (AVX-512 has no fp8 conversion). The byte,
// sign-extended to 16 bits and shifted left by 7, has s in bit 15 and eeeemmm in bits 13..7; bit
// 14 (a copy of s) is cleared.
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half_bits = _mm256_and_si256(_mm256_slli_epi16(words, 7), _mm256_set1_epi16(-0x4080));
  return _mm512_mul_ps(_mm512_cvtph_ps(half_bits), _mm512_set1_ps(256.f));
}
inline __m512 load16(const c10::Half* p) {  // fp16 codes (--kv-cache-dtype fp16)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// bf16 bits of 16 floats, rounded to nearest even (as c10::BFloat16 converts).
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
}
// v rounded to the dtype T and widened back: where the torch ops would round.
inline __m512 round_as(__m512 v, const float*) { return v; }
inline __m512 round_as(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// exp(x) within ~2 ulp: 2^n * p(r), r in [-ln2/2, ln2/2], p the degree-6 Taylor polynomial.
// 0 below -87, inf above 88.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 2^t for t <= 0 (finite): 2^n * p(f), n = round(t), f in [-1/2, 1/2], p a degree-5 polynomial
// fitted to 2^f (relative error 2.3e-7, as fp32 rounds). Lanes off `keep` are 0, whatever t.
// Softmax weights that are then rounded to bf16 need no more; t below -150 underflows to 0.
inline __m512 exp2_512(__mmask16 keep, __m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.001326697994954884f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009675469249486923f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550742521882057f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022121727466583f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931469440460205f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

#endif

#ifdef PAGEDSERVE_AVX2
// The 8-wide counterparts of the loads and stores above (fp32 and bf16 rows).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// KV cache codes, exactly, as load16 reads them.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {  // load16's fp16 placement, 8 wide
  const __m128i words = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half_bits = _mm_and_si128(_mm_slli_epi16(words, 7), _mm_set1_epi16(-0x4080));
  return _mm256_mul_ps(_mm256_cvtph_ps(half_bits), _mm256_set1_ps(256.f));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i bf16_bits8(__m256 v) {  // round to nearest even, as c10::BFloat16 converts
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
}
inline __m256 round_as8(__m256 v, const float*) { return v; }
inline __m256 round_as8(__m256 v, const c10::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i words = _mm256_packus_epi32(bf16_bits8(v), _mm256_setzero_si256());  // per lane
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(words, 0x08)));
}
// Lane i = the sum of v[i]'s 8 lanes (two rounds of pairwise adds, then the halves).
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
// The sum of 8 floats in the order torch's AVX2 reductions take (halves, then pairs, then
// neighbours), so that a norm's statistics are torch's bit for bit.
inline float reduce_add8(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x1));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}
// The largest of 8 floats (exact in any order).
inline float reduce_max8(__m256 v) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Also in AVX-512 builds: the fp32 prefill attention runs on 8-wide registers there too.
// exp(x) as exp512 computes it (degree-6 Taylor polynomial of r, times 2^n), 8 wide; 2^n is
// built in the exponent bits (x >= -87 keeps n >= -126, a normal float). For x <= 88.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
#endif

// ---------------------------------------------------------------------------------------------
// Quantized linear, weights kept in the GGUF group form (per 32 elements along K:
// w = scale * code + min) and multiplied by integer dot products (AVX-512 VNNI):
// the activations are quantized on the fly per 32-element group, xq = round(x / dx), to int16
// (dx = absmax / 32767: within ~1e-5 of the activations) or to int8 (dx = absmax / 127, as
// llama.cpp does: faster, less accurate; the default, with outlier channels, see below and
// layers/quantized.py). Each group's sum of code * xq is exact in int32 (vpdpwssd: pairs of
// int16; vpdpbusd: quads of u8 x s8):
//   y[m, n] = sum_g ( scale[n, g] * dx[m, g] * sum_k code * xq  +  min[n, g] * xsum[m, g] )
// xsum is dx * sum(xq), the group's sum of the quantized activations, so y is exactly the
// dequantized weights times the quantized activations:
//   sum_k (scale * code + min) * dx * xq = scale * dx * sum(code * xq) + min * dx * sum(xq).
// Taking the exact sum of x in the min term instead leaves an error of
// sum_k (w - min) * (dx * xq - x): the rounding errors weighted by the codes' offset from the
// group's min (0..15 scales for 4-bit) rather than by the weights (centred on zero). With int8
// activations on SmolLM2-135M's layers that made each matmul's error 2-3x larger (measured
// 0.0193 against 0.0077 relative to exact on layer 5's QKV). For Q8_0 (code + 128 stored as an
// unsigned byte, min = -128 * scale) the same sum also cancels the +128 shift exactly.
//
// Weight layout, 16 output columns ("a column block") at a time so that each 32-bit lane of a
// register belongs to one column and a broadcast of activations feeds all 16:
//   codes[block][group][chunk][column 0..15][4 bytes]     (64 bytes per chunk)
//   4-bit: 4 chunks per group; chunk i's byte e holds element 4i + e in its low nibble and
//          element 16 + 4i + e in its high one. 8-bit: 8 chunks, chunk j byte e = element 4j + e.
//   5-bit: the 4-bit chunks of the codes' low 4 bits, then a fifth chunk of their fifth bits as
//          8 little-endian 64-bit words: word j's bit 4 * column + e is element 4j + e's, one
//          bit per byte of the register that holds elements 4j..4j+3 (a mask for it). A group
//          is kBits chunks whatever the width.
//   scales, mins: [block][group][column], fp32 or (where exact) fp16.
// pagedserve/layers/quantized.py (`vnni_layout`) builds it; N is padded to a multiple of 16.

// ---------------------------------------------------------------------------------------------
// Work shares that idle threads take over. at::parallel_for gives each thread one fixed share, so
// a thread the OS takes away for a while (the server's event loop runs while a kernel holds no
// GIL; a benchmark client shares the cores) holds every other thread at the region's end.
//
// parallel_pieces(outer, inner, size, piece) runs piece(o, begin, end) over every o < outer and
// every index of [0, inner), in ranges [begin, end) of at most `size` indices. Thread t owns the
// indices [inner * t / T, inner * (t + 1) / T) and walks their ranges for o = 0, 1, ... in turn,
// as a static split would (a quantized matmul's thread keeps its columns' weights in its L2 over
// all chunks of rows). A thread done with its own share then takes ranges from the end of the
// others'. Which thread computes a range changes no result bit.
struct alignas(64) PieceShare {
  std::atomic<uint64_t> range;  // the next and the end position of the share's walk, 32 bits each
};

// Claims the share's next position (from_front) or its last one; false once it is empty.
inline bool take_piece(PieceShare& share, bool from_front, int64_t* position) {
  uint64_t range = share.range.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t next = range >> 32, end = range & 0xFFFFFFFFu;
    if (next >= end) return false;
    const uint64_t taken = from_front ? ((next + 1) << 32) | end : (next << 32) | (end - 1);
    if (share.range.compare_exchange_weak(range, taken, std::memory_order_relaxed)) {
      *position = static_cast<int64_t>(from_front ? next : end - 1);
      return true;
    }
  }
}

template <typename F>
void parallel_pieces(int64_t outer, int64_t inner, int64_t size, const F& piece) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), outer * inner);
  if (threads <= 0) return;
  auto first_index = [&](int64_t t) { return inner * t / threads; };
  auto ranges = [&](int64_t t) { return (first_index(t + 1) - first_index(t) + size - 1) / size; };
  TORCH_CHECK(outer * (inner + size - 1) / size < (int64_t{1} << 31),
              "parallel_pieces: too many pieces");
  if (outer == 1 && (inner + threads - 1) / threads <= size) {
    // one range per share, nothing to hand over: a static split without the shared counters
    // (a decode step's small products, measured 5% slower with them at 1 row, Zen 4)
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) piece(0, first_index(t), first_index(t + 1));
    });
    return;
  }
  std::vector<PieceShare> shares(threads);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].range.store(static_cast<uint64_t>(outer * ranges(t)));
  auto run = [&](int64_t t, int64_t position) {  // position in share t's walk
    const int64_t o = position / ranges(t), begin = first_index(t) + position % ranges(t) * size;
    piece(o, begin, std::min(first_index(t + 1), begin + size));
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    int64_t position;
    for (int64_t t = begin; t < end; ++t)
      while (take_piece(shares[t], true, &position)) run(t, position);
    for (int64_t other = 1; other < threads; ++other) {
      const int64_t victim = (begin + other) % threads;
      while (take_piece(shares[victim], false, &position)) run(victim, position);
    }
  });
}

// f(begin, end) over [0, count) as parallel_pieces' shares, in ranges of at least min_size
// indices and about 4 per thread, for work spread evenly enough over the indices.
template <typename F>
void parallel_ranges(int64_t count, int64_t min_size, const F& f) {
  const int64_t size = std::max<int64_t>({int64_t{1}, min_size, count / (4 * at::get_num_threads())});
  parallel_pieces(1, count, size, [&](int64_t, int64_t begin, int64_t end) { f(begin, end); });
}

// Work items per piece, for items that each cost `item_work` (a unit of work: one 32-element
// group of one row times 16 columns): about kPieceWork units, tens of microseconds at 8 rows and
// more. A smaller product (a decode step's few rows) stays one piece per thread: its pieces would
// cost more to hand out than the imbalance they could save (measured at 1 row, Zen 4).
constexpr int64_t kPieceWork = 8192;
inline int64_t items_per_piece(int64_t items, int64_t item_work) {
  const int64_t share = (items + at::get_num_threads() - 1) / at::get_num_threads();
  return std::clamp<int64_t>(kPieceWork / std::max<int64_t>(1, item_work), 1, std::max<int64_t>(1, share));
}

// An array left uninitialized: every element is written before it is read, and std::vector's
// zero fill was a memset as long as the quantization itself on a prefill's rows (perf, Zen 4).
template <typename T>
class RawArray {
 public:
  explicit RawArray(int64_t n) : values_(n > 0 ? new T[n] : nullptr) {}
  T* data() { return values_.get(); }
  const T* data() const { return values_.get(); }
  T& operator[](int64_t i) { return values_[i]; }

 private:
  std::unique_ptr<T[]> values_;
};

// The rows' layout. With VNNI the integer kernel (vnni_block) takes the rows kActivationTile at a
// time, and each tile's rows are interleaved group by group: q [tile][group][row][32],
// scale/sum/qsum [tile][group][row] (the last tile's `count` rows likewise), so that its loads
// are one moving pointer plus constants. Row-major, 8 rows' pointers and their scales' did not
// fit the 15 general registers and the compiler spilled them, two dozen stack loads and stores
// per group in the innermost loop. Without VNNI ([rows][K] and [rows][G]) a tile is any rows.
// The AMX kernel (amx_int8.h) takes tiles of 16 rows, the rows padded to whole tiles with zeros.
#ifdef PAGEDSERVE_VNNI
constexpr int64_t kActivationTile = 8;  // = kRowTile (quant_linear_impl's tiles of rows)
#else
constexpr int64_t kActivationTile = 1;  // row-major
#endif

// Where row r's groups go in the layout above (tiles of `tile` rows): its first group's codes at
// q_offset (later groups q_stride elements apart), its first scale at scale_offset (later ones
// scale_stride).
struct ActivationPlace {
  int64_t q_offset, q_stride, scale_offset, scale_stride;
};
inline ActivationPlace activation_place(int64_t r, int64_t rows, int64_t k, int64_t tile) {
  const int64_t first = r - r % tile;
  const int64_t count = std::min(tile, rows - first), i = r - first;
  return {first * k + i * kGroup, count * kGroup, first * (k / kGroup) + i, count};
}

template <typename Q>
struct QuantizedRows {
  int64_t tile;           // rows per tile of the layout (kActivationTile, or the AMX kernel's 16)
  RawArray<Q> q;          // rows x K: the codes xq
  RawArray<float> scale;  // rows x G: dx
  RawArray<float> sum;    // rows x G: xsum (see above)
  RawArray<int32_t> qsum;  // rows x G: sum(xq), for the AVX2 form of 8-bit weights
  RawArray<float> outlier_x;  // [rows, outliers]: the outlier channels' activations (see below)
};

#ifdef PAGEDSERVE_AVX512
// Lane j of the result: v[j]'s 16 lanes reduced by `op` (max or add, on the bits as float or
// int32): a tree of 45 shuffles and ops for 16 registers, where reducing each one alone costs 8.
template <typename Op>
inline __m512 reduce_16_registers(const __m512* v, Op op) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // w[i]: v[2i] in 128-bit lanes 0-1, v[2i+1] in 2-3
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // x[i]: v[4i + L] in 128-bit lane L
    x[i] = op(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // y[i], lane L: v[8i + L], v[8i + 4 + L], twice
    y[i] = op(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  // 128-bit lane L, element e: v[4e + L]
  const __m512 z = op(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}
#endif

// One row's groups quantized: q = round(x / dx) (to nearest even), dx = absmax / kMax. The
// AVX-512 form computes the same bits as the loop (the same product x * (kMax / absmax), rounded
// by the same mode), 16 groups at a time: their maxima and sums reduced together and their
// divisions in one instruction (prefill quantizes every activation of every layer; a group at a
// time, the reductions' shuffles and a scalar division per group dominated).
template <typename Q>
inline void quantize_row(const float* x, int64_t k, Q* q, float* scale, float* sum,
                         int32_t* qsums, int64_t q_stride, int64_t scale_stride) {
  constexpr int32_t kMax = std::is_same_v<Q, int8_t> ? 127 : 32767;
#ifdef PAGEDSERVE_AVX512
  static_assert(kGroup == 32, "a group is two 16-lane registers");
  const __m512i high = _mm512_set1_epi32(kMax), low = _mm512_set1_epi32(-kMax);
  const __m512 max_code = _mm512_set1_ps(static_cast<float>(kMax));
  auto max_op = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  auto add_op = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  const int64_t groups = k / kGroup;
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, groups - g0));
    const float* xg = x + g0 * kGroup;
    __m512 parts[16];  // per group: its |x| maxima, then its codes' sums (groups past n: 0)
    for (int j = 0; j < 16; ++j) parts[j] = _mm512_setzero_ps();
    for (int j = 0; j < n; ++j)
      parts[j] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xg + j * kGroup)),
                               _mm512_abs_ps(_mm512_loadu_ps(xg + j * kGroup + 16)));
    const __m512 amax = reduce_16_registers(parts, max_op);
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                           max_code, amax);
    for (int j = 0; j < n; ++j) {
      const __m512 inv_j = _mm512_permutexvar_ps(_mm512_set1_epi32(j), inv);
      // cvtps rounds by MXCSR's mode, nearest even, as nearbyint does
      const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + j * kGroup), inv_j)), low), high);
      const __m512i qb = _mm512_min_epi32(_mm512_max_epi32(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + j * kGroup + 16), inv_j)), low), high);
      Q* qg = q + (g0 + j) * q_stride;
      if constexpr (std::is_same_v<Q, int8_t>) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + 16), _mm512_cvtepi32_epi8(qb));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg), _mm512_cvtepi32_epi16(qa));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg + 16), _mm512_cvtepi32_epi16(qb));
      }
      parts[j] = _mm512_castsi512_ps(_mm512_add_epi32(qa, qb));
    }
    const __m512i qsum = _mm512_castps_si512(reduce_16_registers(parts, add_op));
    const __m512 dx = _mm512_div_ps(amax, max_code);
    alignas(64) float dxs[16], sums[16];
    alignas(64) int32_t qs[16];
    _mm512_store_ps(dxs, dx);
    _mm512_store_ps(sums, _mm512_mul_ps(dx, _mm512_cvtepi32_ps(qsum)));
    _mm512_store_si512(qs, qsum);
    for (int j = 0; j < n; ++j) {  // scale_stride apart (the activation tiles' layout)
      scale[(g0 + j) * scale_stride] = dxs[j];
      sum[(g0 + j) * scale_stride] = sums[j];
      qsums[(g0 + j) * scale_stride] = qs[j];
    }
  }
#elif defined(PAGEDSERVE_AVX2)
  // The loop below's operations, 8 lanes at a time: the same product x * inv, rounded to
  // nearest even by cvtps (MXCSR's mode, as nearbyint), clamped, then packed (no saturation
  // left to apply); max and integer sums are exact in any order.
  static_assert(kGroup == 32, "a group is four 8-lane registers");
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i high = _mm256_set1_epi32(kMax), low = _mm256_set1_epi32(-kMax);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xg + 8 * j);
    const float amax = reduce_max8(
        _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
    const float d = amax / kMax, inv = amax > 0.f ? kMax / amax : 0.f;
    const __m256 inv_v = _mm256_set1_ps(inv);
    __m256i codes[4];
    for (int j = 0; j < 4; ++j)
      codes[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv_v)), low), high);
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]),
                                           _mm256_add_epi32(codes[2], codes[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t qsum = _mm_cvtsi128_si32(t);
    Q* qg = q + g * q_stride;
    const __m256i words01 = _mm256_packs_epi32(codes[0], codes[1]);  // lanes interleaved by 128 bits
    const __m256i words23 = _mm256_packs_epi32(codes[2], codes[3]);
    if constexpr (std::is_same_v<Q, int8_t>) {
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words01, words23),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg), bytes);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg), _mm256_permute4x64_epi64(words01, 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg + 16), _mm256_permute4x64_epi64(words23, 0xD8));
    }
    scale[g * scale_stride] = d;
    sum[g * scale_stride] = d * static_cast<float>(qsum);
    qsums[g * scale_stride] = qsum;
  }
#else
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float amax = 0.f;
    for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xg[j]));
    const float d = amax / kMax, inv = amax > 0.f ? kMax / amax : 0.f;
    int32_t qsum = 0;
    for (int j = 0; j < kGroup; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xg[j] * inv));
      q[g * q_stride + j] = static_cast<Q>(std::clamp(v, -kMax, kMax));
      qsum += q[g * q_stride + j];
    }
    scale[g * scale_stride] = d;
    sum[g * scale_stride] = d * static_cast<float>(qsum);
    qsums[g * scale_stride] = qsum;
  }
#endif
}

// Outlier channels: a few input channels (OutlierChannels, chosen per layer at load from the
// activations of a calibration text, pagedserve/layers/outliers.py) whose values are much larger
// than their group's others. They are taken out of the quantized rows (set to 0 before the group
// scales are found, so the rest of their groups keep their resolution) and multiplied exactly
// instead: y[r][n] += sum_j x[r][channel j] * w_j[n], by fp32 FMAs, j in order, w_j the
// dequantized weights of channel j rounded to fp16 (16 channels in fp16 already add a tenth to
// the bytes a 576-wide 4-bit layer reads per row), after the integer sums and before the bias.
struct OutlierChannels {
  const int64_t* channels = nullptr;      // [count], ascending
  const c10::Half* weights = nullptr;     // [count, N padded to 16]: w_j[n]
  int64_t count = 0, stride = 0;
};

// x's rows quantized into the layout above, in tiles of `tile` rows; with tile > kActivationTile
// (the AMX kernel's) the rows are padded to whole tiles by rows of zeros (codes, scales and sums
// 0: they add nothing, and nobody reads their results).
template <typename Q, typename T>
QuantizedRows<Q> quantize_rows(const T* x, int64_t rows, int64_t k,
                               const OutlierChannels& outliers = {},
                               int64_t tile = kActivationTile) {
  const int64_t groups = k / kGroup;
  const int64_t stored = tile > kActivationTile ? (rows + tile - 1) / tile * tile : rows;
  QuantizedRows<Q> out{tile, RawArray<Q>(stored * k), RawArray<float>(stored * groups),
                       RawArray<float>(stored * groups), RawArray<int32_t>(stored * groups),
                       RawArray<float>(stored * outliers.count)};
  parallel_ranges(stored, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    for (int64_t r = begin; r < end; ++r) {
      if (r < rows) {
        widen_row(x + r * k, row.data(), k);
      } else {
        std::fill(row.begin(), row.end(), 0.f);
      }
      for (int64_t j = 0; j < outliers.count; ++j) {
        out.outlier_x[r * outliers.count + j] = row[outliers.channels[j]];
        row[outliers.channels[j]] = 0.f;
      }
      const ActivationPlace place = activation_place(r, stored, k, tile);
      quantize_row(row.data(), k, out.q.data() + place.q_offset,
                   out.scale.data() + place.scale_offset, out.sum.data() + place.scale_offset,
                   out.qsum.data() + place.scale_offset, place.q_stride, place.scale_stride);
    }
  });
  return out;
}

// The code of element `e` (0..31) of column `col` in one group of a column block.
template <int kBits>
inline int32_t code_at(const uint8_t* group_codes, int col, int e) {
  if constexpr (kBits == 8) {
    return group_codes[(e / 4) * 64 + col * 4 + e % 4];
  } else {
    const int half = e / 16, i = (e % 16) / 4;
    const uint8_t byte = group_codes[i * 64 + col * 4 + e % 4];
    const int32_t low = half ? (byte >> 4) : (byte & 0x0F);
    if constexpr (kBits == 4) return low;
    const int bit = 4 * col + e % 4;  // of word e / 4 of the fifth chunk
    return low | (((group_codes[4 * 64 + 8 * (e / 4) + bit / 8] >> (bit % 8)) & 1) << 4);
  }
}

#ifdef PAGEDSERVE_VNNI
// One group of a column block as registers for the dot products. int8 activations: 8 registers,
// register j = elements 4j..4j+3 (u8). int16: 16 registers, register p = elements 2p, 2p+1
// (zero-extended int16 words).
template <int kBits, typename Q>
inline void unpack_group(const uint8_t* cg, __m512i* w) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i quads[8];  // quads[j]: elements 4j..4j+3 as bytes
  if constexpr (kBits == 8) {
    for (int j = 0; j < 8; ++j) quads[j] = _mm512_loadu_si512(cg + j * 64);
  } else {
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = _mm512_loadu_si512(cg + i * 64);
      quads[i] = _mm512_and_si512(raw, nibble);
      quads[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    }
    if constexpr (kBits == 5) {  // word j of the fifth chunk: a mask of quads[j]'s bytes
      const __m512i bit4 = _mm512_set1_epi8(0x10);
      for (int j = 0; j < 8; ++j) {
        uint64_t fifth;
        std::memcpy(&fifth, cg + 4 * 64 + 8 * j, sizeof(fifth));
        quads[j] = _mm512_mask_add_epi8(quads[j], _cvtu64_mask64(fifth), quads[j], bit4);
      }
    }
  }
  if constexpr (std::is_same_v<Q, int8_t>) {
    for (int j = 0; j < 8; ++j) w[j] = quads[j];
  } else {
    // bytes 0,1 (then 2,3) of each 32-bit lane -> two zero-extended words
    const __m512i first = _mm512_set4_epi32(0x800D800C, 0x80098008, 0x80058004, 0x80018000);
    const __m512i second = _mm512_set4_epi32(0x800F800E, 0x800B800A, 0x80078006, 0x80038002);
    for (int j = 0; j < 8; ++j) {
      w[2 * j] = _mm512_shuffle_epi8(quads[j], first);
      w[2 * j + 1] = _mm512_shuffle_epi8(quads[j], second);
    }
  }
}

template <typename Q>
inline __m512i group_dot(const __m512i* w, const Q* xg) {
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xg);  // 4 int8 or 2 int16 per lane
  // Four independent chains: one chain of 8-16 dependent dot instructions would wait on their
  // latency, not their throughput.
  __m512i dot[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                    _mm512_setzero_si512()};
  if constexpr (std::is_same_v<Q, int8_t>) {
    for (int j = 0; j < 8; ++j)
      dot[j % 4] = _mm512_dpbusd_epi32(dot[j % 4], w[j], _mm512_set1_epi32(x32[j]));
  } else {
    for (int p = 0; p < 16; ++p)
      dot[p % 4] = _mm512_dpwssd_epi32(dot[p % 4], w[p], _mm512_set1_epi32(x32[p]));
  }
  return _mm512_add_epi32(_mm512_add_epi32(dot[0], dot[1]), _mm512_add_epi32(dot[2], dot[3]));
}
#endif

#if defined(PAGEDSERVE_AVX2_INTEGER)
// The same integer sums without VNNI (AVX2: vpmaddubsw, u8 x s8 -> pairs summed into saturating
// int16, and vpmaddwd, int16 x int16 -> pairs summed into int32), 8 columns of a block at a
// time. No sum saturates, so they equal the VNNI ones exactly:
// - int8 x 4-bit codes: a pair is at most 2 * 15 * 127 = 3810 and all 16 of a group's pairs
//   sum to at most 30480 < 32767, so they are added in int16 and widened once;
// - int8 x 5-bit codes: a pair is at most 2 * 31 * 127 = 7874; each of the two int16 sums adds
//   four pairs, at most 31496, and the two are widened before they are added;
// - int8 x 8-bit codes (0..255 would saturate a pair): llama.cpp's sign trick on q = code - 128,
//   |q| * (x * sign q) pairs are at most 2 * 128 * 127 = 32512; widened per chunk, and
//   sum(code * x) = sum(q * x) + 128 * sum(x) restores the stored codes' sum;
// - int16: codes zero-extended to words; a group's sum is at most 32 * 255 * 32767 < 2^31.

// Byte b of the result: 0xFF where bit b of `bits` is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i byte_of_bit = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                 0x0303030303030303);
  const __m256i bit_in_byte = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i spread =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), byte_of_bit);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit_in_byte), bit_in_byte);
}

// quads[j] (j = 0..7): elements 4j..4j+3 of the 8 columns 8h..8h+7 (one 32-bit lane each), as
// bytes. cg: the group's codes.
template <int kBits>
inline void unpack_group_avx2(const uint8_t* cg, int h, __m256i* quads) {
  const uint8_t* half = cg + 32 * h;  // the half's 32 bytes of each 64-byte chunk
  if constexpr (kBits == 8) {
    for (int j = 0; j < 8; ++j)
      quads[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + j * 64));
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + i * 64));
      quads[i] = _mm256_and_si256(raw, nibble);
      quads[i + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    }
    if constexpr (kBits == 5) {  // the half's 32 bits of word j of the fifth chunk
      const __m256i bit4 = _mm256_set1_epi8(0x10);
      for (int j = 0; j < 8; ++j) {
        uint32_t fifth;
        std::memcpy(&fifth, cg + 4 * 64 + 8 * j + 4 * h, sizeof(fifth));
        quads[j] = _mm256_or_si256(quads[j], _mm256_and_si256(bits_to_bytes(fifth), bit4));
      }
    }
  }
}

// A quad of bytes per 32-bit lane (elements 4j..4j+3 of a column) -> pairs[0]: elements 4j and
// 4j + 1 as two zero-extended words per lane, pairs[1]: 4j + 2 and 4j + 3 (the int16 form).
inline void widen_quad(__m256i quad, __m256i* pairs) {
  const __m256i first = _mm256_setr_epi32(0x80018000, 0x80058004, 0x80098008, 0x800D800C,
                                          0x80018000, 0x80058004, 0x80098008, 0x800D800C);
  const __m256i second = _mm256_setr_epi32(0x80038002, 0x80078006, 0x800B800A, 0x800F800E,
                                           0x80038002, 0x80078006, 0x800B800A, 0x800F800E);
  pairs[0] = _mm256_shuffle_epi8(quad, first);
  pairs[1] = _mm256_shuffle_epi8(quad, second);
}

template <int kBits, typename Q>
inline __m256i group_dot_avx2(const __m256i* quads, const Q* xg, int32_t qsum) {
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xg);  // 4 int8 or 2 int16 per lane
  const __m256i ones16 = _mm256_set1_epi16(1);
  if constexpr (std::is_same_v<Q, int8_t>) {
    if constexpr (kBits != 8) {
      __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int j = 0; j < 8; ++j)
        pairs[j % 2] = _mm256_add_epi16(
            pairs[j % 2], _mm256_maddubs_epi16(quads[j], _mm256_set1_epi32(x32[j])));
      if constexpr (kBits == 5)  // each of the two int16 sums fits, not their sum
        return _mm256_add_epi32(_mm256_madd_epi16(pairs[0], ones16),
                                _mm256_madd_epi16(pairs[1], ones16));
      return _mm256_madd_epi16(_mm256_add_epi16(pairs[0], pairs[1]), ones16);
    } else {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int j = 0; j < 8; ++j) {
        const __m256i q = _mm256_xor_si256(quads[j], flip);  // code - 128 as int8
        const __m256i pair = _mm256_maddubs_epi16(
            _mm256_abs_epi8(q), _mm256_sign_epi8(_mm256_set1_epi32(x32[j]), q));
        dot[j % 2] = _mm256_add_epi32(dot[j % 2], _mm256_madd_epi16(pair, ones16));
      }
      return _mm256_add_epi32(_mm256_add_epi32(dot[0], dot[1]), _mm256_set1_epi32(128 * qsum));
    }
  } else {
    __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 8; ++j) {
      __m256i pairs[2];
      widen_quad(quads[j], pairs);
      dot[0] = _mm256_add_epi32(dot[0], _mm256_madd_epi16(pairs[0], _mm256_set1_epi32(x32[2 * j])));
      dot[1] = _mm256_add_epi32(dot[1],
                                _mm256_madd_epi16(pairs[1], _mm256_set1_epi32(x32[2 * j + 1])));
    }
    return _mm256_add_epi32(dot[0], dot[1]);
  }
}
#endif

// Scales and mins are fp32, or fp16 where every value is exact in fp16 (Q4_0, Q4_1 and Q8_0
// store fp16 themselves): a sixth fewer bytes to stream per weight.
inline float scale_at(const float* p, int64_t i) { return p[i]; }
inline float scale_at(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }
#if defined(PAGEDSERVE_AVX2) || defined(PAGEDSERVE_AVX2_INTEGER)
inline __m256 load8_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_scales(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
#ifdef PAGEDSERVE_AVX512
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if defined(PAGEDSERVE_AVX2_INTEGER)
// AVX2 kernels sum a run of groups in integers first and store the sums (dots[row][group][column],
// the run's groups from g0), then add them up in floats here with each row's accumulators in
// registers. Summed and scaled in one pass, the accumulators of a tile of rows did not fit the
// 16 registers and each group's two FMAs waited on a store to the stack and its reload (the
// two passes ran 1.05-1.10x faster, Zen 3). The epilogue of vnni_block's AVX-512 form, in its
// order: out[r] += cvt(dot) * (scale * dx), then += min * xsum, group by group.
constexpr int64_t kDotGroups = 16;
constexpr int kTwoPassMinRows = 5;  // up to 4 rows one pass ran as fast or faster (Zen 3)

template <int kRows, typename S>
inline void add_group_sums(const int32_t (*dots)[kDotGroups][16], int64_t g0, int64_t run,
                           const S* scales, const S* mins, int64_t groups, const float* dx,
                           const float* xsum, float* out /* [kRows][16] */) {
  constexpr int kPair = kRows >= 2 ? 2 : 1;  // two rows at a time: four independent FMA chains
  for (int r0 = 0; r0 < kRows; r0 += kPair) {
    const int pair = std::min(kPair, kRows - r0);
    __m256 acc[kPair][2];
    for (int p = 0; p < pair; ++p)
      for (int h = 0; h < 2; ++h) acc[p][h] = _mm256_loadu_ps(out + (r0 + p) * 16 + 8 * h);
    for (int64_t i = 0; i < run; ++i) {
      const int64_t g = g0 + i;
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = load8_scales(scales + g * 16 + 8 * h);
        const __m256 minimum = load8_scales(mins + g * 16 + 8 * h);
        for (int p = 0; p < pair; ++p) {
          const int r = r0 + p;
          const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(dx[r * groups + g]));
          const __m256i dot = _mm256_load_si256(reinterpret_cast<const __m256i*>(dots[r][i] + 8 * h));
          acc[p][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[p][h]);
          acc[p][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(xsum[r * groups + g]), acc[p][h]);
        }
      }
    }
    for (int p = 0; p < pair; ++p)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (r0 + p) * 16 + 8 * h, acc[p][h]);
  }
}
#endif

constexpr int64_t kPrefetchGroups = 8;

// One column block times kRows activation rows: out[r][0..15] (fp32). kBits: the codes' range
// (the AVX2 sums' form depends on it); kLayoutBits: their layout, 8 for codes widened to bytes
// (widen_to_bytes).
template <int kBits, typename Q, int kRows, typename S, int kLayoutBits = kBits>
inline void vnni_block(const uint8_t* codes, const S* scales, const S* mins,
                       int64_t groups, const Q* xq, const float* dx, const float* xsum,
                       const int32_t* qsum, int64_t k, float* out /* [kRows][16] */) {
  constexpr int kChunks = kLayoutBits;  // 64-byte chunks per group
#ifdef PAGEDSERVE_VNNI
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // The hardware prefetcher restarts at every matrix; ask for the codes a few groups ahead.
    const char* ahead = reinterpret_cast<const char*>(codes + (g + kPrefetchGroups) * kChunks * 64);
    for (int line = 0; line < kChunks; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
    __m512i w[16];
    unpack_group<kLayoutBits, Q>(codes + g * kChunks * 64, w);
    const __m512 scale = load_scales(scales + g * 16);
    const __m512 minimum = load_scales(mins + g * 16);
    // the tile's rows interleaved (kActivationTile): group g's rows one after another
    const Q* xg = xq + g * kRows * kGroup;
    const float* dxg = dx + g * kRows;
    const float* xsumg = xsum + g * kRows;
    for (int r = 0; r < kRows; ++r) {
      const __m512i dot = group_dot<Q>(w, xg + r * kGroup);
      const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(dxg[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
      acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsumg[r]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(out + r * 16, acc[r]);
#elif defined(PAGEDSERVE_AVX2_INTEGER)
  if constexpr (kRows >= kTwoPassMinRows) {
    // A run of groups' integer sums, then their float epilogue (add_group_sums).
    alignas(32) int32_t dots[kRows][kDotGroups][16];
    for (int r = 0; r < kRows; ++r)
      for (int col = 0; col < 16; ++col) out[r * 16 + col] = 0.f;
    for (int64_t g0 = 0; g0 < groups; g0 += kDotGroups) {
      const int64_t run = std::min(kDotGroups, groups - g0);
      // The block as two halves of 8 columns (a 256-bit register holds 8 lanes): one half's codes
      // come from L1 the second time.
      for (int h = 0; h < 2; ++h) {
        for (int64_t i = 0; i < run; ++i) {
          const int64_t g = g0 + i;
          if (h == 0) {
            const char* ahead =
                reinterpret_cast<const char*>(codes + (g + kPrefetchGroups) * kChunks * 64);
            for (int line = 0; line < kChunks; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
          }
          __m256i quads[8];
          unpack_group_avx2<kLayoutBits>(codes + g * kChunks * 64, h, quads);
          for (int r = 0; r < kRows; ++r)
            _mm256_store_si256(reinterpret_cast<__m256i*>(dots[r][i] + 8 * h),
                               group_dot_avx2<kBits, Q>(quads, xq + r * k + g * kGroup,
                                                        qsum[r * groups + g]));
        }
      }
      add_group_sums<kRows>(dots, g0, run, scales, mins, groups, dx, xsum, out);
    }
  } else {  // a row's accumulators fit the registers: one pass
    // (its prefetch and unpack are the two-pass branch's lines: a shared inline helper for them
    // made the product 0.86-0.98x, Zen 3, so each branch keeps its own)
    // The block as two halves of 8 columns (a 256-bit register holds 8 lanes), each over all the
    // groups: one half's codes come from L1 the second time.
    for (int h = 0; h < 2; ++h) {
      __m256 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        if (h == 0) {
          const char* ahead =
              reinterpret_cast<const char*>(codes + (g + kPrefetchGroups) * kChunks * 64);
          for (int line = 0; line < kChunks; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        }
        __m256i quads[8];
        unpack_group_avx2<kLayoutBits>(codes + g * kChunks * 64, h, quads);
        const __m256 scale = load8_scales(scales + g * 16 + 8 * h);
        const __m256 minimum = load8_scales(mins + g * 16 + 8 * h);
        for (int r = 0; r < kRows; ++r) {
          const __m256i dot =
              group_dot_avx2<kBits, Q>(quads, xq + r * k + g * kGroup, qsum[r * groups + g]);
          const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(dx[r * groups + g]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
          acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(xsum[r * groups + g]), acc[r]);
        }
      }
      for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(out + r * 16 + 8 * h, acc[r]);
    }
  }
#else
  for (int r = 0; r < kRows; ++r)
    for (int col = 0; col < 16; ++col) out[r * 16 + col] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* cg = codes + g * kChunks * 64;
    for (int r = 0; r < kRows; ++r) {
      const Q* xr = xq + r * k + g * kGroup;
      for (int col = 0; col < 16; ++col) {
        int32_t dot = 0;
        for (int e = 0; e < kGroup; ++e) dot += code_at<kLayoutBits>(cg, col, e) * xr[e];
        out[r * 16 + col] +=
            static_cast<float>(dot) * (scale_at(scales, g * 16 + col) * dx[r * groups + g]);
        out[r * 16 + col] += scale_at(mins, g * 16 + col) * xsum[r * groups + g];
      }
    }
  }
#endif
}

template <int kBits, typename Q, typename S, int kLayoutBits = kBits>
void vnni_rows(int rows, const uint8_t* codes, const S* scales, const S* mins,
               int64_t groups, const Q* xq, const float* dx, const float* xsum,
               const int32_t* qsum, int64_t k, float* out) {
#define PAGEDSERVE_ROWS_CASE(R)                                                                 \
  case R:                                                                                       \
    return vnni_block<kBits, Q, R, S, kLayoutBits>(codes, scales, mins, groups, xq, dx, xsum, \
                                                   qsum, k, out);
  switch (rows) {
    PAGEDSERVE_ROWS_CASE(8)
    PAGEDSERVE_ROWS_CASE(7)
    PAGEDSERVE_ROWS_CASE(6)
    PAGEDSERVE_ROWS_CASE(5)
    PAGEDSERVE_ROWS_CASE(4)
    PAGEDSERVE_ROWS_CASE(3)
    PAGEDSERVE_ROWS_CASE(2)
    default:
      return vnni_block<kBits, Q, 1, S, kLayoutBits>(codes, scales, mins, groups, xq, dx, xsum,
                                                     qsum, k, out);
  }
#undef PAGEDSERVE_ROWS_CASE
}

constexpr int64_t kRowTile = 8;
constexpr int64_t kTileRowsMax = 16;  // the most rows any kernel below takes at a time
static_assert(kActivationTile == 1 || kActivationTile == kRowTile, "vnni_block's tiles");
constexpr int64_t kRowChunk = 128;  // rows whose quantized activations stay in L2 across blocks

// A column block's 5-bit codes widened into the 8-bit layout (8 chunks per group, chunk j the
// register of elements 4j..4j+3): a chunk of many rows then runs the 8-bit kernel, each group's
// fifth bits merged once per block rather than once per tile of rows: at 128 and 512 rows,
// 1.05-1.06x faster than merging per tile (Zen 4, `bench matmul --qtype int5`), about the 8-bit
// codes' speed; at 16-64 rows a large matrix ran slower this way (the codes' stream no longer
// overlaps the sums). The codes are the same bytes, so the integer sums and every output bit
// are the 5-bit kernel's. The AMX kernel (amx_int8.h) widens 4- and 5-bit codes this way too:
// its tiles load bytes.
// On AVX2 the bytes keep the 5-bit codes' form of the sums (vnni_block's kLayoutBits = 8 with
// kBits = 5: int16 partial sums, not the sign trick that codes up to 255 need): int8 1.56-1.71x
// at 128 and 512 rows (`bench matmul --qtype int5`, AMD EPYC Zen 3). 4-bit codes on bytes
// measured 0.87-1.01x there: their unpacking is two operations per register, so they keep theirs.
constexpr int64_t kBytePanelMinRows = kRowChunk;

template <int kBits>
inline void widen_to_bytes(const uint8_t* codes, int64_t groups, uint8_t* panel) {
  static_assert(kBits == 4 || kBits == 5, "8-bit codes are bytes already");
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* cg = codes + g * kBits * 64;
    uint8_t* out = panel + g * 8 * 64;
#ifdef PAGEDSERVE_VNNI
    __m512i w[16];  // the int8 form fills 8
    unpack_group<kBits, int8_t>(cg, w);
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(out + j * 64, w[j]);
#elif defined(PAGEDSERVE_AVX2_INTEGER)
    for (int h = 0; h < 2; ++h) {
      __m256i quads[8];
      unpack_group_avx2<kBits>(cg, h, quads);
      for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 64 + 32 * h), quads[j]);
    }
#else
    for (int col = 0; col < 16; ++col)
      for (int e = 0; e < kGroup; ++e)
        out[(e / 4) * 64 + col * 4 + e % 4] = static_cast<uint8_t>(code_at<kBits>(cg, col, e));
#endif
  }
}

#include "amx_tiles.h"
#include "amx_int8.h"
static_assert(kTileRows <= kTileRowsMax, "quant_linear_impl's tile buffer");

// Store up to 16 fp32 values in the output dtype (bf16: round to nearest even).
inline void store_row(const float* src, float* dst, int64_t count) {
  std::copy(src, src + count, dst);
}
inline void store_row(const float* src, c10::BFloat16* dst, int64_t count) {
#ifdef PAGEDSERVE_AVX512
  if (count == 16) return store16(dst, _mm512_loadu_ps(src));
#endif
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}

#ifdef PAGEDSERVE_AVX2_INTEGER
// int16 activations on many rows (prefill, big decode batches) without VNNI. vnni_block widens
// the codes to words by two shuffles per row and pair of elements; here a column block's codes
// are widened once into a panel that every row of the chunk reads:
//   panel[group][pair j = 0..15][half h = 0..1]: 8 lanes, lane c = the codes of elements 2j and
//   2j + 1 of column 8h + c as two words.
// The integer sums are exact and their float epilogue runs in vnni_block's order, so a row's
// result is the same bits by either kernel (tests/kernels compare them).
constexpr bool kIntegerPanels = true;
constexpr int64_t kPanelMinRows = 8;  // fewer rows: vnni_block, the panel does not pay (measured)
constexpr int64_t kPanelTile = 4;     // rows per pass over the panel

template <int kBits>
void widen_panel(const uint8_t* codes, int64_t groups, __m256i* panel) {
  constexpr int kChunks = kBits;  // 64-byte chunks per group
  for (int64_t g = 0; g < groups; ++g) {
    for (int h = 0; h < 2; ++h) {
      __m256i quads[8];
      unpack_group_avx2<kBits>(codes + g * kChunks * 64, h, quads);
      __m256i* pg = panel + g * 2 * kGroup;
      for (int j = 0; j < 8; ++j) {
        __m256i pairs[2];
        widen_quad(quads[j], pairs);
        pg[(2 * j) * 2 + h] = pairs[0];
        pg[(2 * j + 1) * 2 + h] = pairs[1];
      }
    }
  }
}

// kRows rows times the panel's column block: out[r][0..15] (fp32), as vnni_block computes them.
template <int kRows, typename S>
inline void panel_rows(const __m256i* panel, const S* scales, const S* mins, int64_t groups,
                       const int16_t* xq, const float* dx, const float* xsum, int64_t k,
                       float* out /* [kRows][16] */) {
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i* pg = panel + g * 2 * kGroup;
    __m256i dot[kRows][2];
    for (int r = 0; r < kRows; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < kGroup / 2; ++j) {
      const __m256i w0 = _mm256_load_si256(pg + 2 * j), w1 = _mm256_load_si256(pg + 2 * j + 1);
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq + r * k + g * kGroup + 2 * j, sizeof(pair));
        const __m256i xb = _mm256_set1_epi32(pair);
        dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(w0, xb));
        dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(w1, xb));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = load8_scales(scales + g * 16 + 8 * h);
      const __m256 minimum = load8_scales(mins + g * 16 + 8 * h);
      for (int r = 0; r < kRows; ++r) {
        const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(dx[r * groups + g]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), s, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(xsum[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(out + r * 16, acc[r][0]);
    _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]);
  }
}

template <typename S>
void panel_tile(int rows, const __m256i* panel, const S* scales, const S* mins, int64_t groups,
                const int16_t* xq, const float* dx, const float* xsum, int64_t k, float* out) {
  switch (rows) {
    case 4: return panel_rows<4, S>(panel, scales, mins, groups, xq, dx, xsum, k, out);
    case 3: return panel_rows<3, S>(panel, scales, mins, groups, xq, dx, xsum, k, out);
    case 2: return panel_rows<2, S>(panel, scales, mins, groups, xq, dx, xsum, k, out);
    default: return panel_rows<1, S>(panel, scales, mins, groups, xq, dx, xsum, k, out);
  }
}
#else
constexpr bool kIntegerPanels = false;
constexpr int64_t kPanelMinRows = 0, kPanelTile = 1;
#endif

// tile[i][0..15] += row i's outlier products for the columns col0..col0 + 15, for the `rows`
// rows of a tile (x: their outlier activations, [rows][count]): one FMA per channel and column,
// channels in order, in every form. Each channel's 16 weights are widened once for all rows.
#if defined(PAGEDSERVE_AVX512)
// A fixed row count keeps the accumulators in registers: with the count known only at run time
// they lived on the stack (gate/up ran 1.08x faster at 2,000 rows with this, Zen 4).
template <int kRows>
inline void outlier_rows(const c10::Half* w, int64_t count, int64_t stride, const float* x,
                         float* tile) {
  __m512 acc[kRows];
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_loadu_ps(tile + i * 16);
  for (int64_t j = 0; j < count; ++j, w += stride) {
    const __m512 wj = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    for (int i = 0; i < kRows; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * count + j]), wj, acc[i]);
  }
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(tile + i * 16, acc[i]);
}
#endif

#if !defined(PAGEDSERVE_AVX512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// tile[i][0..15] += sum_j x[i * x_stride + j] * wide[j][0..15] for kRows rows and `chunk`
// channels in order (widened weights, add_outliers).
template <int kRows>
inline void outlier_rows_avx2(const float* wide, int64_t chunk, const float* x, int64_t x_stride,
                              float* tile) {
  __m256 lo[kRows], hi[kRows];
  for (int i = 0; i < kRows; ++i) {
    lo[i] = _mm256_loadu_ps(tile + i * 16);
    hi[i] = _mm256_loadu_ps(tile + i * 16 + 8);
  }
  for (int64_t j = 0; j < chunk; ++j) {
    const __m256 w_lo = _mm256_load_ps(wide + j * 16), w_hi = _mm256_load_ps(wide + j * 16 + 8);
    for (int i = 0; i < kRows; ++i) {
      const __m256 xj = _mm256_set1_ps(x[i * x_stride + j]);
      lo[i] = _mm256_fmadd_ps(xj, w_lo, lo[i]);
      hi[i] = _mm256_fmadd_ps(xj, w_hi, hi[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm256_storeu_ps(tile + i * 16, lo[i]);
    _mm256_storeu_ps(tile + i * 16 + 8, hi[i]);
  }
}
#endif

// Without AVX-512 not inlined: inlined, it changed how the compiler laid out quant_linear_impl's
// tile loop, and the int8 product ran 2-7% slower even without outlier channels (`bench matmul
// --baseline-kernels`, Zen 3).
#ifdef PAGEDSERVE_AVX512
inline
#else
__attribute__((noinline))
#endif
void add_outliers(const OutlierChannels& outliers, const float* x, int rows, int64_t col0,
                  float* tile) {
  const c10::Half* w = outliers.weights + col0;
  const int64_t count = outliers.count;
#if defined(PAGEDSERVE_AVX512)
  static_assert(kRowTile == 8, "outlier_rows is dispatched for 1..8 rows");
  switch (rows) {
    case 8: return outlier_rows<8>(w, count, outliers.stride, x, tile);
    case 7: return outlier_rows<7>(w, count, outliers.stride, x, tile);
    case 6: return outlier_rows<6>(w, count, outliers.stride, x, tile);
    case 5: return outlier_rows<5>(w, count, outliers.stride, x, tile);
    case 4: return outlier_rows<4>(w, count, outliers.stride, x, tile);
    case 3: return outlier_rows<3>(w, count, outliers.stride, x, tile);
    case 2: return outlier_rows<2>(w, count, outliers.stride, x, tile);
    default: return outlier_rows<1>(w, count, outliers.stride, x, tile);
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // 16 channels' weights at a time widened once for every row of the tile (widened per row,
  // they cost two conversions per channel and row), then 4 rows at a time: 8 independent FMA
  // chains, where one row's 2 waited on the FMA latency. Each row still takes its channels in
  // order, one FMA each: the same bits.
  alignas(32) float wide[16 * 16];
  for (int64_t j0 = 0; j0 < count; j0 += 16) {
    const int64_t chunk = std::min<int64_t>(16, count - j0);
    for (int64_t j = 0; j < chunk; ++j) {
      const c10::Half* wj = w + (j0 + j) * outliers.stride;
      _mm256_store_ps(wide + j * 16,
                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj))));
      _mm256_store_ps(wide + j * 16 + 8,
                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 8))));
    }
    int i = 0;
    for (; i + 4 <= rows; i += 4)
      outlier_rows_avx2<4>(wide, chunk, x + i * count + j0, count, tile + i * 16);
    for (; i < rows; ++i)
      outlier_rows_avx2<1>(wide, chunk, x + i * count + j0, count, tile + i * 16);
  }
#else
  for (int i = 0; i < rows; ++i)
    for (int64_t j = 0; j < count; ++j)
      for (int col = 0; col < 16; ++col)
        tile[i * 16 + col] = std::fma(x[i * count + j],
                                      static_cast<float>(w[j * outliers.stride + col]),
                                      tile[i * 16 + col]);
#endif
}

// ---------------------------------------------------------------------------------------------
// The gated activations of a merged gate_up projection, act(gate) * up:
//   SiLU (Llama):       gate / (1 + exp(-gate));
//   GELU-tanh (Gemma):  torch's form, (0.5 gate) (1 + tanh(u)), u = b (gate + k gate^3), with the
//                       same constants and steps, tanh(u) = 1 - 2 / (exp(2u) + 1) (odd-extended):
//                       like torch's, within an ulp or two, so that 1 + tanh(u) keeps its bits
//                       where it cancels (a strongly negative gate).
enum class Gate { kNone, kSilu, kGeluTanh };

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi): torch's M_SQRT2 * M_2_SQRTPI / 2
constexpr float kGeluKappa = 0.044715f;

inline float gelu_tanh(float g) {
  const float u = kGeluBeta * (g + kGeluKappa * (g * g * g));
  const float t = 1.f - 2.f / (std::exp(2.f * std::fabs(u)) + 1.f);
  return (0.5f * g) * (1.f + std::copysign(t, u));
}

#ifdef PAGEDSERVE_AVX512
inline __m512 gelu_tanh16(__m512 g) {
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(kGeluBeta),
                                 _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(kGeluKappa), cube)));
  const __m512 two_abs_u = _mm512_add_ps(_mm512_abs_ps(u), _mm512_abs_ps(u));
  const __m512 one = _mm512_set1_ps(1.f);
  // exp512 is inf above 88: t = 1 there, as tanh
  const __m512 t = _mm512_sub_ps(
      one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp512(two_abs_u), one)));
  const __m512 signed_t = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(t),
      _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(INT32_MIN))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, signed_t));
}
#elif defined(PAGEDSERVE_AVX2)
inline __m256 gelu_tanh8(__m256 g) {
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(kGeluBeta),
                                 _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), cube)));
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 abs_u = _mm256_andnot_ps(sign, u);
  const __m256 one = _mm256_set1_ps(1.f);
  // exp256 takes x <= 88; beyond, tanh is 1 in fp32
  const __m256 big = _mm256_set1_ps(44.f);
  const __m256 e = exp256(_mm256_add_ps(_mm256_min_ps(abs_u, big), _mm256_min_ps(abs_u, big)));
  const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
  const __m256 signed_t = _mm256_or_ps(t, _mm256_and_ps(sign, u));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, signed_t));
}
#endif

// act(gate) * up of one row of f values, rounded where torch's F.silu(gate) * up (or
// F.gelu(gate, approximate="tanh") * up) rounds: after the activation, after the product. The
// rows of silu_and_mul and gelu_tanh_and_mul, and of the gated product (quant_linear_gated).
template <Gate kGate, typename T>
void gate_mul_row(const T* gate, const T* up, T* out, int64_t f) {
  static_assert(kGate != Gate::kNone, "a gated activation");
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  for (; i + 16 <= f; i += 16) {
    const __m512 g = load16(gate + i);
    __m512 act;
    if constexpr (kGate == Gate::kSilu) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
      act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    } else {
      act = gelu_tanh16(g);
    }
    store16(out + i, _mm512_mul_ps(round_as(act, gate), load16(up + i)));
  }
#elif defined(PAGEDSERVE_AVX2)
  for (; i + 8 <= f; i += 8) {
    const __m256 g = load8(gate + i);
    __m256 act;
    if constexpr (kGate == Gate::kSilu) {
      // exp256 takes x <= 88; beyond, exp(-g) is inf, as exp512's is: silu(g) = -0
      const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), g);
      const __m256 big = _mm256_set1_ps(88.f);
      const __m256 e = _mm256_blendv_ps(exp256(_mm256_min_ps(neg, big)),
                                        _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                                        _mm256_cmp_ps(neg, big, _CMP_GT_OQ));
      act = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    } else {
      act = gelu_tanh8(g);
    }
    store8(out + i, _mm256_mul_ps(round_as8(act, gate), load8(up + i)));
  }
#endif
  for (; i < f; ++i) {
    const float g = to_float(gate[i]);
    const float act = kGate == Gate::kSilu ? g / (1.f + std::exp(-g)) : gelu_tanh(g);
    out[i] = from_float<T>(to_float(from_float<T>(act)) * to_float(up[i]));
  }
}

template <typename T>
void gate_mul_row(Gate gating, const T* gate, const T* up, T* out, int64_t f) {
  if (gating == Gate::kSilu) return gate_mul_row<Gate::kSilu>(gate, up, out, f);
  TORCH_CHECK(gating == Gate::kGeluTanh, "a gated activation");
  gate_mul_row<Gate::kGeluTanh>(gate, up, out, f);
}

// y = x W^T (+ bias) for the rows of xr, or with a `gating` the gated form: W's first n / 2 rows
// are a gate projection and the rest an up projection (a merged gate_up layer, n / 2 a multiple
// of 16), and y (rows, n / 2) = act(gate) * up. Each gate and up value is rounded to T as the
// plain product stores it and gate_mul_row then runs as silu_and_mul (gelu_tanh_and_mul) does,
// so the gated form is bitwise that activation of the plain product; but the (rows, n) product
// is never written out and read back (at a 2,000-token prefill, 12 MB per layer for SmolLM2),
// and the work is one pass.
template <int kBits, typename Q, typename S, typename T>
void quant_linear_impl(const QuantizedRows<Q>& xr, int64_t rows, int64_t k, const uint8_t* codes,
                       const S* scales, const S* mins, const T* bias, int64_t n, T* y,
                       const OutlierChannels& outliers, Gate gating, TileMode tiles) {
  // tiles: the AMX kernel (or its model) takes every tile of rows, quantized in its layout
  TORCH_CHECK((tiles == TileMode::kOff) == (xr.tile == kActivationTile),
              "quant_linear: the rows' layout does not match the kernel");
  const int64_t groups = k / kGroup;
  const int64_t blocks = (n + 15) / 16;
  const int64_t block_code_bytes = groups * kBits * 64;
  // gated: work item b is gate block b and up block b + half, whose rows meet in gate_mul_row
  const bool gated = gating != Gate::kNone;
  const int64_t half = blocks / 2, items = gated ? half : blocks;
  // Work pieces: a chunk of rows times a run of work items. Each thread walks the chunks over its
  // own share of the items (their weights stay in its L2, the chunk's quantized activations in
  // both threads' caches).
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
  const int64_t piece_items = items_per_piece(items, std::min(rows, kRowChunk) * groups);
  parallel_pieces(chunks, items, piece_items, [&](int64_t chunk_index, int64_t item_begin,
                                                  int64_t item_end) {
    const int64_t chunk = chunk_index * kRowChunk;
    const int64_t chunk_end = std::min(rows, chunk + kRowChunk);
    const bool panels = kIntegerPanels && std::is_same_v<Q, int16_t> &&
                        chunk_end - chunk >= kPanelMinRows;
    const bool on_tiles = tiles != TileMode::kOff;
    const int64_t row_tile = on_tiles ? kTileRows : panels ? kPanelTile : kRowTile;
    // tiles: 4- and 5-bit codes widened to bytes once per block (the tiles load bytes)
    const bool byte_panel =
        on_tiles ? kBits != 8 : kBits == 5 && !panels && chunk_end - chunk >= kBytePanelMinRows;
    alignas(64) float tile[kTileRowsMax * 16];
    RawArray<uint8_t> byte_codes(byte_panel ? groups * 8 * 64 : 0);
#ifdef PAGEDSERVE_AMX_INT8
    const TileSession tile_session(tiles, int8_tile_config());
#endif
    // gated: the chunk's gate values of the item, rounded to T, until its up block comes
    RawArray<T> gates(gated ? kRowChunk * 16 : 0);
    T up[16];
#ifdef PAGEDSERVE_AVX2_INTEGER
    // 32-byte aligned by hand: new[] does not promise __m256i's alignment
    RawArray<uint8_t> panel_bytes(panels ? groups * 2 * kGroup * 32 + 32 : 0);
    auto* panel = reinterpret_cast<__m256i*>(
        (reinterpret_cast<uintptr_t>(panel_bytes.data()) + 31) & ~uintptr_t{31});
#endif
    // Column block b over the chunk's rows: emit(row, values) for each row's 16 fp32 values.
    auto run_block = [&](int64_t b, auto&& emit) {
      const int64_t col0 = b * 16;
      const S* block_scales = scales + b * groups * 16;
      const S* block_mins = mins + b * groups * 16;
#ifdef PAGEDSERVE_AVX2_INTEGER
      if (panels) widen_panel<kBits>(codes + b * block_code_bytes, groups, panel);
#endif
      if constexpr (kBits != 8) {
        if (byte_panel)
          widen_to_bytes<kBits>(codes + b * block_code_bytes, groups, byte_codes.data());
      }
      for (int64_t r = chunk; r < chunk_end; r += row_tile) {
        const int tile_rows = static_cast<int>(std::min(row_tile, chunk_end - r));
        if (on_tiles) {
#ifdef PAGEDSERVE_AMX_INT8
          if constexpr (std::is_same_v<Q, int8_t>) {
            const uint8_t* weights = byte_panel ? byte_codes.data() : codes + b * block_code_bytes;
            const auto run = tiles == TileMode::kHardware ? amx_block<HardwareTiles, S>
                                                          : amx_block<TileModel, S>;
            run(weights, block_scales, block_mins, groups, xr.q.data() + r * k,
                xr.scale.data() + r * groups, xr.sum.data() + r * groups, tile);
          }
#endif
        } else if (panels) {
#ifdef PAGEDSERVE_AVX2_INTEGER
          if constexpr (std::is_same_v<Q, int16_t>)
            panel_tile<S>(tile_rows, panel, block_scales, block_mins, groups,
                          xr.q.data() + r * k, xr.scale.data() + r * groups,
                          xr.sum.data() + r * groups, k, tile);
#endif
        } else if (byte_panel) {
          vnni_rows<kBits, Q, S, 8>(tile_rows, byte_codes.data(), block_scales, block_mins, groups,
                             xr.q.data() + r * k, xr.scale.data() + r * groups,
                             xr.sum.data() + r * groups, xr.qsum.data() + r * groups, k, tile);
        } else {
          vnni_rows<kBits, Q, S>(tile_rows, codes + b * block_code_bytes, block_scales,
                                 block_mins, groups, xr.q.data() + r * k,
                                 xr.scale.data() + r * groups, xr.sum.data() + r * groups,
                                 xr.qsum.data() + r * groups, k, tile);
        }
        for (int h = 0; outliers.count && h < tile_rows; h += kRowTile)  // 8 rows at a time
          add_outliers(outliers, xr.outlier_x.data() + (r + h) * outliers.count,
                       std::min<int>(kRowTile, tile_rows - h), col0, tile + h * 16);
        for (int i = 0; i < tile_rows; ++i) emit(r + i, tile + i * 16);
      }
    };
    for (int64_t b = item_begin; b < item_end; ++b) {
      if (gated) {
        run_block(b, [&](int64_t row, float* values) {
          store_row(values, gates.data() + (row - chunk) * 16, 16);
        });
        run_block(b + half, [&](int64_t row, float* values) {
          store_row(values, up, 16);
          gate_mul_row(gating, gates.data() + (row - chunk) * 16, up,
                       y + row * (n / 2) + b * 16, int64_t{16});
        });
        continue;
      }
      const int64_t col0 = b * 16, cols = std::min<int64_t>(16, n - col0);
      run_block(b, [&](int64_t row, float* values) {
        if (bias) {
          for (int64_t col = 0; col < cols; ++col) values[col] += to_float(bias[col0 + col]);
        }
        store_row(values, y + row * n + col0, cols);
      });
    }
  });
}

// Calls run(kBits, scales, mins) with the layout's bit width as a constant and its scales typed.
template <typename Run>
void with_layout_types(int64_t bits, const torch::Tensor& scales, const torch::Tensor& mins,
                       Run run) {
  auto typed = [&](auto* s, auto* m) {
    if (bits == 4) {
      run(std::integral_constant<int, 4>{}, s, m);
    } else if (bits == 5) {
      run(std::integral_constant<int, 5>{}, s, m);
    } else {
      run(std::integral_constant<int, 8>{}, s, m);
    }
  };
  if (scales.scalar_type() == torch::kFloat32) {
    typed(scales.data_ptr<float>(), mins.data_ptr<float>());
  } else {
    typed(scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>());
  }
}

// Without VNNI, int8 activations times 8-bit codes take llama.cpp's sign trick (above
// group_dot_avx2) at every row count. From 16 rows they were once widened to int16 and run on
// the int16 kernel's panels instead (the same integers and epilogue, so the same bits); with
// `bench matmul`'s calls in a fixed order that had measured faster, but taken in a new order each
// round the sign trick is as fast or faster: SmolLM2's tied head 49152 x 576 0.67-0.94x the
// panels' time at 16-128 rows, 960 x 576 and 896 x 4864 0.77-1.13x at 64-2,048 (AMD EPYC Zen 3,
// 2 threads, `--baseline-kernels`); in the model the batch-32 step's head took 11.1 / 12.0 ms
// against 13.7 / 14.0 (`bench throughput --profile`, alternated).

// tiles_mode: the int8 tiles' kernel where they apply (int8 rows, whole tiles of them).
template <typename Q, typename T>
void quant_linear_dispatch(const T* x, int64_t rows, int64_t k, int64_t bits,
                           const uint8_t* codes, const torch::Tensor& scales,
                           const torch::Tensor& mins, const T* bias, int64_t n, T* y,
                           const OutlierChannels& outliers, Gate gating,
                           TileMode tiles_mode = tile_mode.load(std::memory_order_relaxed)) {
  TileMode tiles = TileMode::kOff;
#ifdef PAGEDSERVE_AMX_INT8
  if (std::is_same_v<Q, int8_t> && rows >= kTileMinRows) tiles = tiles_mode;
#endif
  if (tiles != TileMode::kOff) int8_tile_products.fetch_add(1, std::memory_order_relaxed);
  QuantizedRows<Q> xr = quantize_rows<Q>(
      x, rows, k, outliers, tiles != TileMode::kOff ? kTileRows : kActivationTile);
  with_layout_types(bits, scales, mins, [&](auto width, auto* s, auto* m) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    quant_linear_impl<decltype(width)::value, Q, S, T>(xr, rows, k, codes, s, m, bias, n, y,
                                                       outliers, gating, tiles);
  });
}

// ---------------------------------------------------------------------------------------------
// The same GGUF-form weights multiplied exactly in fp32 (activation_bits = 32: the fp32 compute
// path). Each weight is dequantized as gguf does, w = fma(scale, code, min): scale * code is
// exact in fp32 (an fp16, or Q4_K's exact d * sc, times a code of at most 8 bits), so there is
// one rounding, as in `GGUFQuantWeight.dequantize`, and the weights are the dense model's bit for
// bit. Products are summed in fp32 by FMAs in an order fixed per output element: two partial
// sums, each walking its elements group after group (`exact_element`, `exact_part`), then added.
// No other row or column changes that order, so a row's result is the same bits in any batch.
//
// kExactBlocks column blocks at a time are dequantized, a slice of groups at a time, into a
// scratch panel ([group][vector][block][16 columns] fp32, vectors in the order the sums walk
// them, 64-byte aligned) and then multiplied by all the rows, kExactTile at a time: with AVX-512
// 24 accumulators (4 rows x 3 blocks x 2 parts; 6 rows x 2 blocks ran no faster, measured), one
// broadcast activation feeding three FMAs. The tile's shape changes which sums a pass computes,
// never the order within a sum. The activations are first interleaved per tile ([K][rows]), so
// that every broadcast is one base pointer plus a constant.

// The first 64-byte boundary at or after p (p's buffer holds 16 floats more than it needs): a
// 64-byte vector load that crosses a cache line costs two.
inline float* aligned64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

constexpr int kExactTile = 4;
constexpr int kExactParts = 2;
constexpr int kExactVectors = 32;  // weight vectors per group and block: one per element
constexpr int64_t kExactRowChunk = 32 * kExactTile;  // whole tiles: kRowChunk rows
#ifdef PAGEDSERVE_AVX512
constexpr int kExactBlocks = 3;  // 24 accumulators: 7 loads feed 12 FMAs (2 blocks: 6 feed 8)
constexpr int64_t kExactSliceGroups = 5;  // groups dequantized at a time: a 30 KB panel
#else
constexpr int kExactBlocks = 2;  // AVX2's 16 registers hold no more (exact_piece_avx2)
constexpr int64_t kExactSliceGroups = 8;  // a 32 KB panel
#endif

// Element (within its group) of the j-th weight vector of a dequantized group.
template <int kBits>
constexpr int exact_element(int j) {
  // chunk j / 8: its byte e = (j % 8) / 2, low then high nibble (5-bit: the same order)
  if constexpr (kBits != 8) {
    const int i = j / 8, e = (j % 8) / 2;
    return (j % 2) ? 16 + 4 * i + e : 4 * i + e;
  } else {
    return j;  // chunk j / 4, byte j % 4: element 4 * (j / 4) + j % 4
  }
}

// The partial sum the j-th weight vector of a group joins: consecutive vectors go to different
// sums, so that FMAs in a row do not wait on each other.
constexpr int exact_part(int j) {
  return j % kExactParts;
}

// One group of one column block into the panel: vector j (16 columns) at out + j * stride.
// A 4-bit code becomes a float by a table lookup (vpermps reads only an index's low 4 bits, so
// the shifted lane needs no mask): shifts and lookups then share the two vector ports.
template <int kBits, typename S>
inline void dequantize_group(const uint8_t* cg, const S* scales, const S* mins, float* out,
                             int64_t stride) {
  constexpr int kChunks = kBits;  // 64-byte chunks per group
  if constexpr (kBits == 5) {  // code by code (the exact mode's 5-bit layers are rare)
    for (int j = 0; j < kExactVectors; ++j) {
      const int element = exact_element<kBits>(j);
      for (int col = 0; col < 16; ++col)
        out[j * stride + col] = std::fma(scale_at(scales, col),
                                         static_cast<float>(code_at<kBits>(cg, col, element)),
                                         scale_at(mins, col));
    }
    return;
  }
#ifdef PAGEDSERVE_AVX512
  const __m512 scale = load_scales(scales), minimum = load_scales(mins);
  const __m512 code_values = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f,
                                            10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  for (int i = 0; i < kChunks; ++i) {
    const __m512i raw = _mm512_loadu_si512(cg + i * 64);
    for (int e = 0; e < 4; ++e) {
      if constexpr (kBits == 4) {
        const __m512 low = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * e), code_values);
        const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * e + 4), code_values);
        _mm512_storeu_ps(out + (i * 8 + 2 * e) * stride, _mm512_fmadd_ps(scale, low, minimum));
        _mm512_storeu_ps(out + (i * 8 + 2 * e + 1) * stride, _mm512_fmadd_ps(scale, high, minimum));
      } else {
        const __m512i byte =
            _mm512_and_si512(_mm512_srli_epi32(raw, 8 * e), _mm512_set1_epi32(0xFF));
        _mm512_storeu_ps(out + (i * 4 + e) * stride,
                         _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(byte), minimum));
      }
    }
  }
#elif defined(PAGEDSERVE_AVX2)
  // The same panel, each 16-column vector as two halves of 8 (columns 0-7, then 8-15).
  for (int h = 0; h < 2; ++h) {
    const __m256 scale = load8_scales(scales + 8 * h), minimum = load8_scales(mins + 8 * h);
    for (int i = 0; i < kChunks; ++i) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + i * 64 + 32 * h));
      for (int e = 0; e < 4; ++e) {
        if constexpr (kBits == 4) {
          const __m256i nibble = _mm256_set1_epi32(0x0F);
          const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 8 * e), nibble));
          const __m256 high =
              _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 8 * e + 4), nibble));
          _mm256_storeu_ps(out + (i * 8 + 2 * e) * stride + 8 * h, _mm256_fmadd_ps(scale, low, minimum));
          _mm256_storeu_ps(out + (i * 8 + 2 * e + 1) * stride + 8 * h,
                           _mm256_fmadd_ps(scale, high, minimum));
        } else {
          const __m256 byte = _mm256_cvtepi32_ps(
              _mm256_and_si256(_mm256_srli_epi32(raw, 8 * e), _mm256_set1_epi32(0xFF)));
          _mm256_storeu_ps(out + (i * 4 + e) * stride + 8 * h, _mm256_fmadd_ps(scale, byte, minimum));
        }
      }
    }
  }
#else
  for (int j = 0; j < kExactVectors; ++j)
    for (int col = 0; col < 16; ++col) {
      const float code = static_cast<float>(code_at<kBits>(cg, col, exact_element<kBits>(j)));
      out[j * stride + col] = std::fma(scale_at(scales, col), code, scale_at(mins, col));
    }
#endif
}

#ifdef PAGEDSERVE_AVX2
// Rows kRow0 .. kRow0 + kPieceRows - 1 of an exact tile (below), columns 8h .. 8h + 7 of each
// block.
template <int kBits, int kRows, int kBlocks, int kRow0, int kPieceRows>
inline void exact_piece_avx2(const float* panel, int64_t groups, const float* xt, float* sums,
                             bool first, int h) {
  __m256 acc[kPieceRows][kBlocks][kExactParts];
  auto at = [&](int r, int b, int p) {
    return sums + (((kRow0 + r) * kBlocks + b) * kExactParts + p) * 16 + 8 * h;
  };
  for (int r = 0; r < kPieceRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      for (int p = 0; p < kExactParts; ++p)
        acc[r][b][p] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(at(r, b, p));
  for (int64_t g = 0; g < groups; ++g) {
    const float* wg = panel + g * kExactVectors * kBlocks * 16 + 8 * h;
    const float* xg = xt + g * kGroup * kRows + kRow0;
#pragma GCC unroll 32
    for (int j = 0; j < kExactVectors; ++j) {
      const int part = exact_part(j);
      const int element = exact_element<kBits>(j);
      __m256 w[kBlocks];
      for (int b = 0; b < kBlocks; ++b) w[b] = _mm256_loadu_ps(wg + (j * kBlocks + b) * 16);
      for (int r = 0; r < kPieceRows; ++r) {
        const __m256 xv = _mm256_broadcast_ss(xg + element * kRows + r);
        for (int b = 0; b < kBlocks; ++b)
          acc[r][b][part] = _mm256_fmadd_ps(w[b], xv, acc[r][b][part]);
      }
    }
  }
  for (int r = 0; r < kPieceRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      for (int p = 0; p < kExactParts; ++p) _mm256_storeu_ps(at(r, b, p), acc[r][b][p]);
}
#endif

// kRows interleaved activation rows (xt[element][row]) times `groups` groups of kBlocks
// dequantized column blocks, added to the partial sums sums[r][block][part][16 columns] (each
// kept apart, as the order above wants; `first`: start them at zero).
template <int kBits, int kRows, int kBlocks>
inline void exact_tile(const float* panel, int64_t groups, const float* xt, float* sums,
                       bool first) {
#ifdef PAGEDSERVE_AVX512
  __m512 acc[kRows][kBlocks][kExactParts];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      for (int p = 0; p < kExactParts; ++p)
        acc[r][b][p] = first ? _mm512_setzero_ps()
                             : _mm512_loadu_ps(sums + ((r * kBlocks + b) * kExactParts + p) * 16);
  for (int64_t g = 0; g < groups; ++g) {
    const float* wg = panel + g * kExactVectors * kBlocks * 16;
    const float* xg = xt + g * kGroup * kRows;
#pragma GCC unroll 32
    for (int j = 0; j < kExactVectors; ++j) {
      const int part = exact_part(j);
      const int element = exact_element<kBits>(j);
      __m512 w[kBlocks];
      for (int b = 0; b < kBlocks; ++b) {
        w[b] = _mm512_loadu_ps(wg + (j * kBlocks + b) * 16);
        // Keep the weights in a register: GCC would otherwise fold this load into each of the
        // kRows FMAs, which then wait on the load ports instead of the FMA units.
        asm("" : "+v"(w[b]));
      }
      for (int r = 0; r < kRows; ++r) {
        const __m512 xv = _mm512_set1_ps(xg[element * kRows + r]);
        for (int b = 0; b < kBlocks; ++b)
          acc[r][b][part] = _mm512_fmadd_ps(w[b], xv, acc[r][b][part]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      for (int p = 0; p < kExactParts; ++p)
        _mm512_storeu_ps(sums + ((r * kBlocks + b) * kExactParts + p) * 16, acc[r][b][p]);
#elif defined(PAGEDSERVE_AVX2)
  // 16 registers cannot hold a whole tile's sums in 8-wide halves, so the tile is walked in
  // pieces (two rows, one half of each block), each over all the groups: a piece's panel reads
  // come from L1, and every sum still takes its products in the order above.
  for (int h = 0; h < 2; ++h) {
    exact_piece_avx2<kBits, kRows, kBlocks, 0, (kRows < 2 ? kRows : 2)>(panel, groups, xt, sums, first, h);
    if constexpr (kRows > 2)
      exact_piece_avx2<kBits, kRows, kBlocks, 2, kRows - 2>(panel, groups, xt, sums, first, h);
  }
#else
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      for (int col = 0; col < 16; ++col) {
        float* part = sums + (r * kBlocks + b) * kExactParts * 16 + col;  // part p at p * 16
        if (first)
          for (int p = 0; p < kExactParts; ++p) part[p * 16] = 0.f;
        for (int64_t g = 0; g < groups; ++g)
          for (int j = 0; j < kExactVectors; ++j) {
            const float w = panel[((g * kExactVectors + j) * kBlocks + b) * 16 + col];
            const float xv = xt[(g * kGroup + exact_element<kBits>(j)) * kRows + r];
            float& sum = part[exact_part(j) * 16];
            sum = std::fma(w, xv, sum);
          }
      }
#endif
}

template <int kBits, int kBlocks, int kRows = kExactTile>
void exact_rows(int rows, const float* panel, int64_t groups, const float* xt, float* sums,
                bool first) {
  if constexpr (kRows > 1) {
    if (rows < kRows) return exact_rows<kBits, kBlocks, kRows - 1>(rows, panel, groups, xt, sums, first);
  }
  exact_tile<kBits, kRows, kBlocks>(panel, groups, xt, sums, first);
}

template <int kBits, int kBlocks = kExactBlocks>
void exact_blocks(int blocks, int rows, const float* panel, int64_t groups, const float* xt,
                  float* sums, bool first) {
  if constexpr (kBlocks > 1) {
    if (blocks < kBlocks)
      return exact_blocks<kBits, kBlocks - 1>(blocks, rows, panel, groups, xt, sums, first);
  }
  exact_rows<kBits, kBlocks>(rows, panel, groups, xt, sums, first);
}

template <int kBits, typename S, typename T>
void exact_linear_impl(const float* x, int64_t rows, int64_t k, const uint8_t* codes,
                       const S* scales, const S* mins, const T* bias, int64_t n, T* y) {
  const int64_t groups = k / kGroup;
  const int64_t blocks = (n + 15) / 16;
  const int64_t group_code_bytes = kBits * 64;
  // Tile t of kExactTile rows, interleaved: element e of its row r at t * kExactTile * k +
  // e * tile_rows + r. (One row is its own interleaving.)
  std::vector<float> interleaved;
  const float* tiles = x;
  if (rows > 1) {
    interleaved.resize(rows * k);
    at::parallel_for(0, (rows + kExactTile - 1) / kExactTile, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t r0 = t * kExactTile, tile_rows = std::min<int64_t>(kExactTile, rows - r0);
        float* dst = interleaved.data() + r0 * k;
        for (int64_t r = 0; r < tile_rows; ++r)
          for (int64_t e = 0; e < k; ++e) dst[e * tile_rows + r] = x[(r0 + r) * k + e];
      }
    });
    tiles = interleaved.data();
  }
  for (int64_t chunk = 0; chunk < rows; chunk += kExactRowChunk) {
    const int64_t chunk_end = std::min(rows, chunk + kExactRowChunk);
    at::parallel_for(0, (blocks + kExactBlocks - 1) / kExactBlocks, 1, [&](int64_t begin, int64_t end) {
      // A slice of groups of kExactBlocks blocks at a time (it stays in L1 while every tile of
      // the chunk passes over it); the partial sums wait in `sums` between slices.
      static thread_local std::vector<float> panel_storage, sums;
      panel_storage.resize(kExactSliceGroups * kExactVectors * kExactBlocks * 16 + 16);
      sums.resize(kExactRowChunk * kExactBlocks * kExactParts * 16);
      float* panel = aligned64(panel_storage.data());
      for (int64_t set = begin; set < end; ++set) {
        const int64_t b0 = kExactBlocks * set;
        const int num_blocks = static_cast<int>(std::min<int64_t>(kExactBlocks, blocks - b0));
        for (int64_t g0 = 0; g0 < groups; g0 += kExactSliceGroups) {
          const int64_t slice = std::min(kExactSliceGroups, groups - g0);
          for (int64_t b = 0; b < num_blocks; ++b) {
            const int64_t block = b0 + b;
            for (int64_t g = g0; g < g0 + slice; ++g) {
              const int64_t index = block * groups + g;  // of this group in codes and scales
              dequantize_group<kBits, S>(
                  codes + index * group_code_bytes, scales + index * 16, mins + index * 16,
                  panel + ((g - g0) * kExactVectors * num_blocks + b) * 16,
                  num_blocks * 16);
            }
          }
          for (int64_t r = chunk; r < chunk_end; r += kExactTile) {
            const int tile_rows = static_cast<int>(std::min<int64_t>(kExactTile, chunk_end - r));
            const float* xt = tiles + r * k + g0 * kGroup * tile_rows;
            float* tile_sums = sums.data() + (r - chunk) * num_blocks * kExactParts * 16;
            exact_blocks<kBits>(num_blocks, tile_rows, panel, slice, xt, tile_sums, g0 == 0);
          }
        }
        for (int64_t r = chunk; r < chunk_end; r += kExactTile) {
          const int64_t tile_rows = std::min<int64_t>(kExactTile, chunk_end - r);
          const float* tile_sums = sums.data() + (r - chunk) * num_blocks * kExactParts * 16;
          for (int64_t i = 0; i < tile_rows; ++i) {
            for (int64_t b = 0; b < num_blocks; ++b) {
              const float* part = tile_sums + (i * num_blocks + b) * kExactParts * 16;
              const int64_t col0 = (b0 + b) * 16, cols = std::min<int64_t>(16, n - col0);
              alignas(64) float values[16];
              for (int col = 0; col < 16; ++col) {
                values[col] = part[col] + part[16 + col];
                if (bias && col < cols) values[col] += to_float(bias[col0 + col]);
              }
              store_row(values, y + (r + i) * n + col0, cols);
            }
          }
        }
      }
    });
  }
}

template <typename T>
void exact_linear_dispatch(const float* x, int64_t rows, int64_t k, int64_t bits,
                           const uint8_t* codes, const torch::Tensor& scales,
                           const torch::Tensor& mins, const T* bias, int64_t n, T* y) {
  with_layout_types(bits, scales, mins, [&](auto width, auto* s, auto* m) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    exact_linear_impl<decltype(width)::value, S, T>(x, rows, k, codes, s, m, bias, n, y);
  });
}

// Whether activation_bits 16 and 8 run vectorized here (VNNI, or AVX2's dot products); the scalar
// fallback is correct but slower than the exact path.
bool integer_linear_vectorized() {
#if defined(PAGEDSERVE_VNNI) || defined(PAGEDSERVE_AVX2_INTEGER)
  return true;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------
// y = x W^T (+ bias) for a few bf16 rows and a dense bf16 W (N, K): the layers whose GGUF form
// the codes' layout cannot hold (Q6_K's 16-element scales) and that keep dequantized weights.
// At one to four rows the product is a stream of W: torch's bf16 linear read it at ~16 GB/s from
// memory here (Zen 4); this one reads each row of W once for every row of x, 32 products per
// AVX512-BF16 instruction, sums in fp32, rounded once to bf16.
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
constexpr int64_t kDenseRowsMax = 4;

template <int kRows>
void dense_rows_bf16(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias,
                     int64_t n, int64_t k, c10::BFloat16* y) {
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin; col < end; ++col) {
      const c10::BFloat16* wc = w + col * k;
      __m512 acc[kRows][2];
      for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 64 <= k; i += 64) {  // two chains per row
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wc + i);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wc + i + 32);
        for (int r = 0; r < kRows; ++r) {
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, (__m512bh)_mm512_loadu_si512(x + r * k + i));
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1,
                                       (__m512bh)_mm512_loadu_si512(x + r * k + i + 32));
        }
      }
      if (i < k) {  // k % 32 == 0: one 32-element step left
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wc + i);
        for (int r = 0; r < kRows; ++r)
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, (__m512bh)_mm512_loadu_si512(x + r * k + i));
      }
      for (int r = 0; r < kRows; ++r) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        if (bias) sum += static_cast<float>(bias[col]);
        y[r * n + col] = c10::BFloat16(sum);
      }
    }
  });
}
#endif

bool dense_rows_supported() {
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x (rows <= 4, K) bf16, w (N, K) bf16 contiguous, K a multiple of 32 (dense_rows_supported()).
torch::Tensor dense_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (rows, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16,
              "bf16 only");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kDenseRowsMax && k % 32 == 0, "1 to 4 rows, K % 32 == 0");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  torch::Tensor xc = x.contiguous();
  torch::Tensor b;
  if (bias) {
    b = bias->to(torch::kBFloat16).contiguous();
    TORCH_CHECK(b.numel() == n, "bias size");
  }
  torch::Tensor y = torch::empty({rows, n}, x.options());
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bias ? b.data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  switch (rows) {
    case 1: dense_rows_bf16<1>(xp, wp, bp, n, k, yp); break;
    case 2: dense_rows_bf16<2>(xp, wp, bp, n, k, yp); break;
    case 3: dense_rows_bf16<3>(xp, wp, bp, n, k, yp); break;
    default: dense_rows_bf16<4>(xp, wp, bp, n, k, yp); break;
  }
  return y;
#else
  TORCH_CHECK(false, "built without AVX512-BF16");
#endif
}

// Whether activation_bits = 32 runs vectorized here; the scalar fallback is correct but slower
// than a dense fp32 matmul, so the layers then keep their dense weights instead.
bool exact_linear_vectorized() {
#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2)
  return true;
#else
  return false;
#endif
}

// Weights of an [n, k] matrix in the layout above, as quant_linear and dequantize_codes take them.
void check_layout(const torch::Tensor& codes, const torch::Tensor& scales,
                  const torch::Tensor& mins, int64_t n, int64_t k, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(),
              "weights must be contiguous");
  TORCH_CHECK((scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kHalf) &&
                  mins.scalar_type() == scales.scalar_type(),
              "scales and mins must both be fp32 or both fp16");
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  const int64_t blocks = (n + 15) / 16, groups = k / kGroup;
  TORCH_CHECK(codes.numel() == blocks * groups * bits * 64, "codes do not match");
  TORCH_CHECK(scales.numel() == blocks * groups * 16 && mins.numel() == blocks * groups * 16,
              "scales / mins do not match");
}

// x @ W^T for W in the layout above. activation_bits 16 / 8: the activations quantized per group
// and integer dot products (VNNI); 32: exact weights and fp32 sums (the fp32 compute path).
// outlier_channels (int64 [count], ascending) and outlier_weights (fp16 [count, N padded to 16]):
// see OutlierChannels; quantized activations only.
// gating: quant_linear_gated's gated form (no bias).
torch::Tensor quant_linear_product(const torch::Tensor& x, const torch::Tensor& codes,
                                   const torch::Tensor& scales, const torch::Tensor& mins,
                                   int64_t n, int64_t bits, int64_t activation_bits,
                                   const c10::optional<torch::Tensor>& bias,
                                   const c10::optional<torch::Tensor>& outlier_channels,
                                   const c10::optional<torch::Tensor>& outlier_weights,
                                   Gate gating) {
  TORCH_CHECK(x.dim() == 2, "x must be (rows, K)");
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16 || activation_bits == 32,
              "activation_bits must be 8, 16 or 32 (fp32, exact weights)");
  const int64_t rows = x.size(0), k = x.size(1);
  check_layout(codes, scales, mins, n, k, bits);
  OutlierChannels outliers;
  if (outlier_channels && outlier_channels->numel() > 0) {
    TORCH_CHECK(activation_bits != 32, "outlier channels are for quantized activations");
    TORCH_CHECK(outlier_weights.has_value(), "outlier channels need their weights");
    const torch::Tensor& c = *outlier_channels;
    const torch::Tensor& w = *outlier_weights;
    TORCH_CHECK(c.dim() == 1 && c.scalar_type() == torch::kInt64 && c.is_contiguous(),
                "outlier_channels: (count,) int64");
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kHalf && w.is_contiguous() &&
                    w.size(0) == c.numel() && w.size(1) == (n + 15) / 16 * 16,
                "outlier_weights: (count, N padded to 16) fp16");
    const int64_t* ch = c.data_ptr<int64_t>();
    for (int64_t j = 0; j < c.numel(); ++j)
      TORCH_CHECK(ch[j] >= 0 && ch[j] < k && (j == 0 || ch[j] > ch[j - 1]),
                  "outlier channels must be ascending and within K");
    outliers = OutlierChannels{ch, w.data_ptr<c10::Half>(), c.numel(), w.size(1)};
  }
  torch::Tensor xc = x.contiguous();
  const bool gated = gating != Gate::kNone;
  TORCH_CHECK(!gated || (activation_bits != 32 && !bias && n % 32 == 0),
              "the gated product takes quantized activations, no bias, and n / 2 a multiple of 16");
  torch::Tensor y = torch::empty({rows, gated ? n / 2 : n}, x.options());
  torch::Tensor b;
  if (bias) {
    b = bias->to(x.scalar_type()).contiguous();
    TORCH_CHECK(b.numel() == n, "bias size");
  }
  const auto* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  DISPATCH_FLOAT_OR_BF16(x.scalar_type(), "quant_linear", [&] {
    const scalar_t* bp = bias ? b.data_ptr<scalar_t>() : nullptr;
    if (activation_bits == 32) {
      const torch::Tensor xf = xc.to(torch::kFloat32);  // bf16 widens exactly; fp32: no copy
      exact_linear_dispatch<scalar_t>(xf.data_ptr<float>(), rows, k, bits, c, scales, mins, bp,
                                      n, y.data_ptr<scalar_t>());
    } else if (activation_bits == 8) {
      quant_linear_dispatch<int8_t>(xc.data_ptr<scalar_t>(), rows, k, bits, c, scales, mins, bp,
                                    n, y.data_ptr<scalar_t>(), outliers, gating);
    } else {
      quant_linear_dispatch<int16_t>(xc.data_ptr<scalar_t>(), rows, k, bits, c, scales, mins,
                                     bp, n, y.data_ptr<scalar_t>(), outliers, gating);
    }
  });
  return y;
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           torch::Tensor mins, int64_t n, int64_t bits, int64_t activation_bits,
                           c10::optional<torch::Tensor> bias,
                           c10::optional<torch::Tensor> outlier_channels,
                           c10::optional<torch::Tensor> outlier_weights) {
  return quant_linear_product(x, codes, scales, mins, n, bits, activation_bits, bias,
                              outlier_channels, outlier_weights, Gate::kNone);
}

// The gated activations by name: "silu" (silu_and_mul), "gelu_tanh" (gelu_tanh_and_mul).
Gate gate_named(const std::string& activation) {
  if (activation == "silu") return Gate::kSilu;
  TORCH_CHECK(activation == "gelu_tanh", "activation must be silu or gelu_tanh, not ", activation);
  return Gate::kGeluTanh;
}

// act(gate) * up of a merged gate_up layer (n = 2F rows, gate first), without its (rows, n)
// product: bitwise silu_and_mul (gelu_tanh_and_mul) of quant_linear(...). See quant_linear_impl.
torch::Tensor quant_linear_gated(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                 torch::Tensor mins, int64_t n, int64_t bits,
                                 int64_t activation_bits, const std::string& activation,
                                 c10::optional<torch::Tensor> outlier_channels,
                                 c10::optional<torch::Tensor> outlier_weights) {
  return quant_linear_product(x, codes, scales, mins, n, bits, activation_bits, c10::nullopt,
                              outlier_channels, outlier_weights, gate_named(activation));
}

// ---------------------------------------------------------------------------------------------
// Loading: GGUF codes into the layout above, and that layout back into dense rows (the dense
// copy a bf16 layer keeps for large batches). The Python references are vnni_layout and
// GGUFQuantWeight.dequantize (layers/quantized.py); tests/kernels compare them.

// codes: [N, K] uint8, one code per byte (0..15, 0..31, or Q8_0's codes + 128) -> the layout's
// code bytes [block][group][chunk][16 columns][4 bytes] (5-bit: and the fifth chunk's words),
// N padded to whole blocks with zero codes.
torch::Tensor pack_codes(torch::Tensor codes, int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8, "codes: (N, K) uint8");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8");
  const torch::Tensor c = codes.contiguous();
  const int64_t n = c.size(0), k = c.size(1);
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  const int64_t blocks = (n + 15) / 16, groups = k / kGroup;
  const int64_t group_bytes = bits * 64;
  torch::Tensor packed = torch::zeros({blocks * groups * group_bytes}, c.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int col = 0; col < 16 && b * 16 + col < n; ++col) {
        const uint8_t* row = src + (b * 16 + col) * k;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* codes_g = row + g * kGroup;
          uint8_t* out = dst + (b * groups + g) * group_bytes + col * 4;
          if (bits != 8) {  // chunk i, byte e: element 4i + e low, 16 + 4i + e high
            for (int i = 0; i < 4; ++i)
              for (int e = 0; e < 4; ++e)
                out[i * 64 + e] =
                    (codes_g[4 * i + e] & 0x0F) | ((codes_g[16 + 4 * i + e] & 0x0F) << 4);
            if (bits == 5) {
              // word j's bit 4 * col + e of the fifth chunk is element 4j + e's fifth bit (the
              // block's columns share its bytes: one thread writes them all)
              uint8_t* fifth = dst + (b * groups + g) * group_bytes + 4 * 64;
              for (int j = 0; j < 8; ++j)
                for (int e = 0; e < 4; ++e) {
                  const int bit = 4 * col + e;
                  fifth[8 * j + bit / 8] |= ((codes_g[4 * j + e] >> 4) & 1) << (bit % 8);
                }
            }
          } else {  // chunk j, byte e: element 4j + e
            for (int j = 0; j < 8; ++j)
              for (int e = 0; e < 4; ++e) out[j * 64 + e] = codes_g[4 * j + e];
          }
        }
      }
  });
  return packed;
}

// One column's 32 weights of one group, dequantized (scale * code + min, one rounding to T) into
// dst[0..31]. cg: the group's code bytes (the layout above), col: the column in its block.
template <int kBits, typename T>
inline void dequantize_column_group(const uint8_t* cg, int col, float scale, float minimum,
                                    T* dst) {
  // The column's 4-byte lane of each chunk, in element order (4-bit: element j in the low nibble
  // of byte j, element 16 + j in its high nibble; 8-bit: element j in byte j). 5-bit codes are
  // put together as 8-bit ones.
  constexpr bool kNibbles = kBits == 4;
  uint8_t bytes[kNibbles ? 16 : 32];
  if constexpr (kBits == 5) {
    for (int e = 0; e < kGroup; ++e) bytes[e] = static_cast<uint8_t>(code_at<kBits>(cg, col, e));
  } else {
    for (int chunk = 0; chunk < kBits; ++chunk)
      std::memcpy(bytes + chunk * 4, cg + chunk * 64 + col * 4, 4);
  }
#ifdef PAGEDSERVE_AVX512
  const __m512 s = _mm512_set1_ps(scale), m = _mm512_set1_ps(minimum);
  if constexpr (kNibbles) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    store16(dst, _mm512_fmadd_ps(s, low, m));
    store16(dst + 16, _mm512_fmadd_ps(s, high, m));
  } else {
    for (int h = 0; h < 2; ++h) {
      const __m512i b =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * h)));
      store16(dst + 16 * h, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(b), m));
    }
  }
#elif defined(PAGEDSERVE_AVX2)
  const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(minimum);
  for (int q = 0; q < (kNibbles ? 2 : 4); ++q) {  // 8 bytes at a time
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * q)));
    if constexpr (kNibbles) {
      const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
      const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
      store8(dst + 8 * q, _mm256_fmadd_ps(s, low, m));
      store8(dst + 16 + 8 * q, _mm256_fmadd_ps(s, high, m));
    } else {
      store8(dst + 8 * q, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(b), m));
    }
  }
#else
  for (int j = 0; j < (kNibbles ? 16 : 32); ++j) {
    // scale * code is exact (see the exact path above): one rounding, as in the reference.
    if constexpr (kNibbles) {
      dst[j] = static_cast<T>(std::fma(scale, static_cast<float>(bytes[j] & 0x0F), minimum));
      dst[16 + j] = static_cast<T>(std::fma(scale, static_cast<float>(bytes[j] >> 4), minimum));
    } else {
      dst[j] = static_cast<T>(std::fma(scale, static_cast<float>(bytes[j]), minimum));
    }
  }
#endif
}

// Row `row` of the matrix (a column of the layout) as k dense values.
template <int kBits, typename S, typename T>
inline void dequantize_row(const uint8_t* codes, const S* scales, const S* mins, int64_t groups,
                           int64_t row, T* dst) {
  const int64_t group_bytes = kBits * 64;
  const int64_t b = row / 16;
  const int col = static_cast<int>(row % 16);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = (b * groups + g) * 16 + col;
    dequantize_column_group<kBits, T>(codes + (b * groups + g) * group_bytes, col,
                                      scale_at(scales, at), scale_at(mins, at), dst + g * kGroup);
  }
}

template <int kBits, typename S, typename T>
void dequantize_codes_impl(const uint8_t* codes, const S* scales, const S* mins, int64_t n,
                           int64_t k, T* out) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      dequantize_row<kBits, S, T>(codes, scales, mins, groups, row, out + row * k);
  });
}

// The layout's weights as dense rows written into out ([N, K] fp32 or bf16, contiguous; bf16
// rounds once, to nearest even, as a copy from fp32 does).
void dequantize_codes(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                      torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "out: contiguous (N, K)");
  const int64_t n = out.size(0), k = out.size(1);
  check_layout(codes, scales, mins, n, k, bits);
  const auto* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  DISPATCH_FLOAT_OR_BF16(out.scalar_type(), "dequantize_codes", [&] {
    with_layout_types(bits, scales, mins, [&](auto width, auto* s, auto* m) {
      using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
      dequantize_codes_impl<decltype(width)::value, S, scalar_t>(c, s, m, n, k,
                                                                  out.data_ptr<scalar_t>());
    });
  });
}

// Rows `ids` of the matrix as dense rows (T, K) in `dtype`: an embedding table looked up on its
// codes, the values dequantize_codes writes (so the table need not be held dense).
torch::Tensor embedding_from_codes(torch::Tensor ids, torch::Tensor codes, torch::Tensor scales,
                                   torch::Tensor mins, int64_t n, int64_t k, int64_t bits,
                                   at::ScalarType dtype) {
  check_layout(codes, scales, mins, n, k, bits);
  const torch::Tensor flat = ids.reshape(-1).to(torch::kLong).contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  const int64_t count = flat.numel();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < n, "embedding id ", id[t], " is out of range [0, ", n, ")");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  torch::Tensor out = torch::empty(shape, codes.options().dtype(dtype));
  const auto* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const int64_t groups = k / kGroup;
  DISPATCH_FLOAT_OR_BF16(dtype, "embedding_from_codes", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    with_layout_types(bits, scales, mins, [&](auto width, auto* s, auto* m) {
      using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
      at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          dequantize_row<decltype(width)::value, S, scalar_t>(c, s, m, groups, id[t], o + t * k);
      });
    });
  });
  return out;
}

// The largest panel dequantize_linear dequantizes at once, in weights: 4 MiB of bf16 (a layer of
// a small model is one panel; a 49k-token head, 14).
constexpr int64_t kPanelWeights = int64_t{1} << 21;

// x @ W^T (+ bias) as torch's dense matmul computes it, W dequantized from the layout into a
// scratch panel (the exact values of the dense copy, see dequantize_codes) a panel of rows at a
// time, so a layer need not hold a dense copy for large batches. Each panel's columns of y are
// F.linear of the panel (addmm with the bias). In bf16 (oneDNN) that is bitwise what the whole
// matrix gives there (tests/kernels/test_cpu_ops.py); fp32 (MKL, not served this way) may sum a
// narrower panel in another order.
torch::Tensor dequantize_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                torch::Tensor mins, int64_t n, int64_t bits,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "x must be (rows, K)");
  const int64_t k = x.size(1);
  check_layout(codes, scales, mins, n, k, bits);
  const int64_t groups = k / kGroup, group_bytes = bits * 64;
  const int64_t panel_rows = std::max<int64_t>(16, kPanelWeights / k / 16 * 16);
  if (panel_rows >= n) {
    torch::Tensor w = torch::empty({n, k}, x.options());
    dequantize_codes(codes, scales, mins, bits, w);
    return bias ? torch::linear(x, w, *bias) : torch::linear(x, w);
  }
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
  torch::Tensor panel = torch::empty({panel_rows, k}, x.options());
  for (int64_t row = 0; row < n; row += panel_rows) {
    const int64_t rows = std::min(panel_rows, n - row), block = row / 16;
    const int64_t blocks = (rows + 15) / 16;
    torch::Tensor w = panel.narrow(0, 0, rows);
    dequantize_codes(codes.narrow(0, block * groups * group_bytes, blocks * groups * group_bytes),
                     scales.view(-1).narrow(0, block * groups * 16, blocks * groups * 16),
                     mins.view(-1).narrow(0, block * groups * 16, blocks * groups * 16), bits, w);
    torch::Tensor out = y.narrow(1, row, rows);
    if (bias) {
      torch::addmm_out(out, bias->narrow(0, row, rows), x, w.t());
    } else {
      torch::mm_out(out, x, w.t());
    }
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm, optionally after the residual add: s = x + residual (stored in the compute dtype, as
// the residual stream is), statistics in fp32, and then either Llama's weighting,
//   out = weight * round(s * rsqrt(mean(s^2) + eps)),
// or with unit_offset Gemma's (a zero-centred weight, everything in fp32, rounded once):
//   out = round(s * rsqrt(mean(s^2) + eps) * (1 + weight)).

// One row of h values; s: h floats of scratch. out may be x itself (the row is read first).
template <typename T>
void rms_norm_row(const T* x, const T* residual_in, T* residual_out, const T* weight, float eps,
                  int64_t h, bool unit_offset, float* s, T* out) {
#ifdef PAGEDSERVE_AVX512
  if (h % 16 == 0) {
    __m512 sq = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
      __m512 v = load16(x + i);
      if (residual_in) v = round_as(_mm512_add_ps(v, load16(residual_in + i)), x);
      _mm512_storeu_ps(s + i, v);
      sq = _mm512_fmadd_ps(v, v, sq);
    }
    const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(h) + eps);
    const __m512 inv_v = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < h; i += 16) {
      const __m512 v = _mm512_loadu_ps(s + i);
      if (residual_out) store16(residual_out + i, v);
      const __m512 normed = _mm512_mul_ps(v, inv_v);
      store16(out + i, unit_offset
                           ? _mm512_mul_ps(normed, _mm512_add_ps(one, load16(weight + i)))
                           : _mm512_mul_ps(load16(weight + i), round_as(normed, x)));
    }
    return;
  }
#elif defined(PAGEDSERVE_AVX2)
  if (h % 8 == 0) {
    __m256 sq = _mm256_setzero_ps();
    for (int64_t i = 0; i < h; i += 8) {
      __m256 v = load8(x + i);
      if (residual_in) v = round_as8(_mm256_add_ps(v, load8(residual_in + i)), x);
      _mm256_storeu_ps(s + i, v);
      sq = _mm256_fmadd_ps(v, v, sq);
    }
    const float inv = 1.f / std::sqrt(reduce_add8(sq) / static_cast<float>(h) + eps);
    const __m256 inv_v = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.f);
    for (int64_t i = 0; i < h; i += 8) {
      const __m256 v = _mm256_loadu_ps(s + i);
      if (residual_out) store8(residual_out + i, v);
      const __m256 normed = _mm256_mul_ps(v, inv_v);
      store8(out + i, unit_offset
                          ? _mm256_mul_ps(normed, _mm256_add_ps(one, load8(weight + i)))
                          : _mm256_mul_ps(load8(weight + i), round_as8(normed, x)));
    }
    return;
  }
#endif
  float sum_sq = 0.f;
  for (int64_t i = 0; i < h; ++i) {
    float v = to_float(x[i]);
    if (residual_in) {
      // rounded to the stored dtype first: the next layer reads the residual from memory
      v = to_float(from_float<T>(v + to_float(residual_in[i])));
    }
    s[i] = v;
    sum_sq += v * v;
  }
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    if (residual_out) residual_out[i] = from_float<T>(s[i]);
    const float normed = s[i] * inv;
    out[i] = unit_offset ? from_float<T>(normed * (1.f + to_float(weight[i])))
                         : from_float<T>(to_float(weight[i]) * to_float(from_float<T>(normed)));
  }
}

template <typename T>
void add_rms_norm_impl(const T* x, T* residual_out, const T* residual_in, const T* weight,
                       double eps, int64_t rows, int64_t h, bool unit_offset, T* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(h);
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_row(x + r * h, residual_in ? residual_in + r * h : nullptr,
                   residual_out ? residual_out + r * h : nullptr, weight,
                   static_cast<float>(eps), h, unit_offset, s.data(), out + r * h);
    }
  });
}

// Returns (norm(x + residual), x + residual); without residual, (norm(x), x).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous (rows, hidden)");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.numel() == h, "one weight per hidden value");
  torch::Tensor w = weight.to(x.scalar_type()).contiguous();
  torch::Tensor out = torch::empty_like(x);
  torch::Tensor res_out;
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual shape");
    res_out = torch::empty_like(x);
  }
  DISPATCH_FLOAT_OR_BF16(x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(
        x.data_ptr<scalar_t>(), residual ? res_out.data_ptr<scalar_t>() : nullptr,
        residual ? residual->data_ptr<scalar_t>() : nullptr, w.data_ptr<scalar_t>(), eps, rows,
        h, unit_offset, out.data_ptr<scalar_t>());
  });
  return {out, residual ? res_out : x};
}

// QK-norm in place: each of the first q_heads + k_heads heads (D values each) of every row of
// qkv (rows, width), q and k side by side as a projection leaves them, RMS-normed over its D
// values with q_weight (q heads) or k_weight (k heads), as add_rms_norm computes a row.
void rms_norm_heads_inplace(torch::Tensor qkv, int64_t q_heads, int64_t k_heads,
                            torch::Tensor q_weight, torch::Tensor k_weight, double eps,
                            bool unit_offset) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be (rows, width) with dense rows");
  const int64_t d = q_weight.numel(), rows = qkv.size(0), heads = q_heads + k_heads;
  TORCH_CHECK(k_weight.numel() == d && heads * d <= qkv.size(1), "head shapes");
  torch::Tensor qw = q_weight.to(qkv.scalar_type()).contiguous();
  torch::Tensor kw = k_weight.to(qkv.scalar_type()).contiguous();
  DISPATCH_FLOAT_OR_BF16(qkv.scalar_type(), "rms_norm_heads_inplace", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const int64_t stride = qkv.stride(0);
    const scalar_t* weights[2] = {qw.data_ptr<scalar_t>(), kw.data_ptr<scalar_t>()};
    at::parallel_for(0, rows * heads, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> s(d);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / heads, head = task % heads;
        scalar_t* x = base + r * stride + head * d;
        rms_norm_row<scalar_t>(x, nullptr, nullptr, weights[head >= q_heads],
                               static_cast<float>(eps), d, unit_offset, s.data(), x);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding in place on the first `heads` heads of each row of qkv (q and k side by side):
// x' = x * cos + roll(x, D/2) * signed_sin (the rotate-half layout, sign folded into the table).

template <typename T>
void rotary_impl(T* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t d,
                 const int64_t* positions, const T* cos_cache, const T* sin_cache) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* cos = cos_cache + positions[r] * d;
      const T* sin = sin_cache + positions[r] * d;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* x = qkv + r * row_stride + hd * d;
#ifdef PAGEDSERVE_AVX512
        if (half % 16 == 0) {
          for (int64_t i = 0; i < half; i += 16) {
            const __m512 a = load16(x + i), b = load16(x + i + half);
            store16(x + i, _mm512_fmadd_ps(a, load16(cos + i), _mm512_mul_ps(b, load16(sin + i))));
            store16(x + i + half, _mm512_fmadd_ps(b, load16(cos + i + half),
                                                  _mm512_mul_ps(a, load16(sin + i + half))));
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x[i]), b = to_float(x[i + half]);
          x[i] = from_float<T>(a * to_float(cos[i]) + b * to_float(sin[i]));
          x[i + half] = from_float<T>(b * to_float(cos[i + half]) + a * to_float(sin[i + half]));
        }
      }
    }
  });
}

void rotary_inplace(torch::Tensor qkv, int64_t heads, int64_t head_dim, torch::Tensor positions,
                    torch::Tensor cos_cache, torch::Tensor sin_cache) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be (rows, width), rows dense");
  TORCH_CHECK(heads * head_dim <= qkv.size(1), "heads exceed the row");
  TORCH_CHECK(cos_cache.scalar_type() == qkv.scalar_type(), "cache dtype");
  torch::Tensor pos = positions.to(torch::kInt64).contiguous();
  DISPATCH_FLOAT_OR_BF16(qkv.scalar_type(), "rotary_inplace", [&] {
    rotary_impl<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.size(0), qkv.stride(0), heads, head_dim,
                          pos.data_ptr<int64_t>(), cos_cache.contiguous().data_ptr<scalar_t>(),
                          sin_cache.contiguous().data_ptr<scalar_t>());
  });
}

// ---------------------------------------------------------------------------------------------
// torch.argmax(x, dim=-1) for (rows, V) logits: the first NaN's index where a row has one (torch
// takes NaN as the largest), else the first index of the maximum (-0 equals 0). Greedy sampling
// takes it every step: torch's reduction walked 32 x 49,152 fp32 logits in 0.65 ms (Zen 4, 2
// threads), as long as the step's attention for a few hundred keys. Two passes per row, both
// vectorized: the maximum (and any NaN), then the first position that equals it.

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity();
#ifdef PAGEDSERVE_AVX512
  __m512 top_v = _mm512_set1_ps(top);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;  // a NaN: the scalar walk finds it
    top_v = _mm512_max_ps(top_v, v);
  }
  top = _mm512_reduce_max_ps(top_v);
#elif defined(PAGEDSERVE_AVX2)
  __m256 top_v = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) break;
    top_v = _mm256_max_ps(top_v, v);
  }
  top = reduce_max8(top_v);
#endif
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    if (std::isnan(v)) return i;
    top = std::max(top, v);
  }
  // No NaN: the first position holding the maximum (every row has one: n >= 1).
  i = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 wanted = _mm512_set1_ps(top);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(x + i), wanted, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(PAGEDSERVE_AVX2)
  const __m256 wanted = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), wanted, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    if (to_float(x[i]) == top) return i;
  }
  return 0;  // not reached
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "x must be (rows, V) with V > 0 and dense rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  torch::Tensor out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  DISPATCH_FLOAT_OR_BF16(x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(base + r * stride, n);
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// act(gate) * up over a merged (rows, 2F) projection: silu_and_mul, gelu_tanh_and_mul.

torch::Tensor gate_and_mul(const torch::Tensor& gate_up, Gate gating) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous(), "gate_up must be (rows, 2F)");
  const int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({rows, f}, gate_up.options());
  DISPATCH_FLOAT_OR_BF16(gate_up.scalar_type(), "gate_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        gate_mul_row(gating, in + r * 2 * f, in + r * 2 * f + f, o + r * f, f);
    });
  });
  return out;
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) { return gate_and_mul(gate_up, Gate::kSilu); }

torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  return gate_and_mul(gate_up, Gate::kGeluTanh);
}

// ---------------------------------------------------------------------------------------------
// Paged attention for queries that each see a prefix of their request's cached sequence (decode,
// and the tokens of a short chunk): token t reads positions [0, seq_lens[t]) of block-table row
// block_rows[t]. Cache: (Hkv, num_blocks, block_size, D), head-major. The cache is read in place,
// block by block: no gathered copy. Two passes (scores, then values) per (token, KV head), with
// the G query heads that share the KV head handled together. Scores, softmax and the weighted
// sum of values are fp32; q . k is exact products summed in fp32 (bf16 x bf16 products are exact
// in fp32), times the scale.

#ifdef PAGEDSERVE_AVX512
// Lane i of the result = the sum of v[i]'s 16 lanes (a transpose-and-add tree: 45 shuffles and
// adds for 16 sums, against 16 x 8 for one horizontal reduction each).
inline __m512 sum16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a, b, a, b] partial sums
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d]
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));  // float adds
  }
  for (int i = 0; i < 2; ++i) {  // lanes 0+1 and 2+3 of two quads
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// Unreduced q . k partial sums (16 lanes) for one key row.
inline __m512 dot_partial(const float* k, const float* q, int64_t d) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a);
  return a;
}
inline __m512 dot_partial(const c10::BFloat16* k, const c10::BFloat16* q, int64_t d) {
  __m512 a = _mm512_setzero_ps();
#ifdef __AVX512BF16__
  for (int64_t i = 0; i < d; i += 32) {
    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + i), (__m512bh)_mm512_loadu_si512(q + i));
  }
#else
  for (int64_t i = 0; i < d; i += 16) a = _mm512_fmadd_ps(load16(q + i), load16(k + i), a);
#endif
  return a;
}
#endif

#ifdef PAGEDSERVE_AVX2
// sums[i] = q . krows[i] for the first `count` (at most 8) keys, d a multiple of 8: their 8-wide
// partial sums reduced together. Q: the query's type (the cache's, or fp32 beside codes), C: the
// key rows'.
template <typename Q, typename C>
inline void key_dots8(const Q* q, const C* const* krows, int64_t count, int64_t d, float* sums) {
  __m256 partial[8];
  for (int i = 0; i < 8; ++i) {
    partial[i] = _mm256_setzero_ps();
    if (i >= count) continue;
    for (int64_t j = 0; j < d; j += 8)
      partial[i] = _mm256_fmadd_ps(load8(q + j), load8(krows[i] + j), partial[i]);
  }
  _mm256_store_ps(sums, sum8(partial));
}
#endif

// Requests the cache lines of rows[begin, min(end, len)) (each `bytes` long): into L1 at
// locality 3, into L2 at 2.
template <int kLocality, typename T>
inline void prefetch_rows(const T* const* rows, int64_t begin, int64_t end, int64_t len,
                          int64_t bytes) {
  for (int64_t i = begin; i < std::min(end, len); ++i) {
    const char* row = reinterpret_cast<const char*>(rows[i]);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(row + line, 0, kLocality);
  }
}

// Rows (of `bytes` each) that the pass after this one reads, requested into L2 while this one
// runs: the next task's keys during a value pass.
template <typename T>
struct Ahead {
  const T* const* rows = nullptr;
  int64_t len = 0, bytes = 0;
};

#ifdef PAGEDSERVE_AVX512
// out[h][0..16*DC) = sum_p w[h * len + p] * rows[p] (out[h] at out + h * out_stride) for kHeads
// query heads that share the rows, a KV head's values. Each row is loaded (and a bf16 or
// quantized one widened) once for all the heads, where one pass per head widened it kHeads
// times: the widening cost as much as the FMAs. Each head's sums run in two sets of accumulators,
// even and odd rows (consecutive FMAs do not wait on each other), added at the end: a head gets
// the same bits in a group as alone.
template <int DC, int kHeads, typename T>
inline void head_weighted_rows(const T* const* rows, const float* w, int64_t len, float* out,
                               int64_t out_stride, const Ahead<T>& ahead = {}) {
  __m512 even[kHeads][DC], odd[kHeads][DC];
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < DC; ++c) even[h][c] = odd[h][c] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 2 <= len; p += 2) {
    prefetch_rows<2>(ahead.rows, p, p + 2, ahead.len, ahead.bytes);
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load16(rows[p] + 16 * c);
    for (int h = 0; h < kHeads; ++h) {
      const __m512 wp = _mm512_set1_ps(w[h * len + p]);
      for (int c = 0; c < DC; ++c) even[h][c] = _mm512_fmadd_ps(wp, v[c], even[h][c]);
    }
    for (int c = 0; c < DC; ++c) v[c] = load16(rows[p + 1] + 16 * c);
    for (int h = 0; h < kHeads; ++h) {
      const __m512 wp = _mm512_set1_ps(w[h * len + p + 1]);
      for (int c = 0; c < DC; ++c) odd[h][c] = _mm512_fmadd_ps(wp, v[c], odd[h][c]);
    }
  }
  prefetch_rows<2>(ahead.rows, p, ahead.len, ahead.len, ahead.bytes);  // a longer next task's rest
  if (p < len) {
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load16(rows[p] + 16 * c);
    for (int h = 0; h < kHeads; ++h) {
      const __m512 wp = _mm512_set1_ps(w[h * len + p]);
      for (int c = 0; c < DC; ++c) even[h][c] = _mm512_fmadd_ps(wp, v[c], even[h][c]);
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < DC; ++c)
      _mm512_storeu_ps(out + h * out_stride + 16 * c, _mm512_add_ps(even[h][c], odd[h][c]));
}

// The value sums of `heads` query heads sharing the rows, three at a time at d = 64 (their 24
// accumulators and a row fill the 32 registers), one at a time at d = 128.
template <int DC, typename T>
void group_weighted_rows(const T* const* rows, const float* w, int64_t heads, int64_t len,
                         float* out, int64_t out_stride, const Ahead<T>& ahead) {
  constexpr int kMaxHeads = DC <= 4 ? 3 : 1;
  Ahead<T> pending = ahead;  // requested by the first call only
  int64_t h = 0;
  for (; heads - h >= kMaxHeads; h += kMaxHeads, pending = {})
    head_weighted_rows<DC, kMaxHeads>(rows, w + h * len, len, out + h * out_stride, out_stride,
                                      pending);
  if (heads - h == 2)
    head_weighted_rows<DC, 2>(rows, w + h * len, len, out + h * out_stride, out_stride, pending);
  if (heads - h == 1)
    head_weighted_rows<DC, 1>(rows, w + h * len, len, out + h * out_stride, out_stride, pending);
}
#endif

// out[0..d) = sum_p w[p] * rows[p] (fp32). ahead: see Ahead (AVX2).
template <typename T>
void weighted_sum(const T* const* rows, const float* w, int64_t len, int64_t d, float* out,
                  const Ahead<T>& ahead = {}) {
#ifdef PAGEDSERVE_AVX512
  if (d == 64) return head_weighted_rows<4, 1>(rows, w, len, out, 0);
  if (d == 128) return head_weighted_rows<8, 1>(rows, w, len, out, 0);
#elif defined(PAGEDSERVE_AVX2)
  if (d % 64 == 0) {  // 64 columns at a time: 8 accumulators, independent FMA chains
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t p = 0; p < len; ++p) {
        if (c0 == 0) prefetch_rows<2>(ahead.rows, p, p + 1, ahead.len, ahead.bytes);
        const __m256 wp = _mm256_set1_ps(w[p]);
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(wp, load8(rows[p] + c0 + 8 * c), acc[c]);
      }
      if (c0 == 0) prefetch_rows<2>(ahead.rows, len, ahead.len, ahead.len, ahead.bytes);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + c0 + 8 * c, acc[c]);
    }
    return;
  }
#endif
  std::fill(out, out + d, 0.f);
  for (int64_t p = 0; p < len; ++p) {
    for (int64_t i = 0; i < d; ++i) out[i] += w[p] * to_float(rows[p][i]);
  }
}

// run(std::integral_constant<int, k>{}, h) for the heads h .. h + k - 1 of `heads`, three at a time
// and then the one or two left: the AVX2 attention passes take up to 3 query heads at once.
template <typename Run>
inline void by_three_heads(int64_t heads, Run&& run) {
  int64_t h = 0;
  for (; h + 3 <= heads; h += 3) run(std::integral_constant<int, 3>{}, h);
  if (heads - h == 2) run(std::integral_constant<int, 2>{}, h);
  if (heads - h == 1) run(std::integral_constant<int, 1>{}, h);
}

#ifdef PAGEDSERVE_AVX2
// The value sums of kHeads query heads against a quantized cache's rows (codes; their scales
// are in w): out[h] (at out + h * out_stride) = sum_p w[h * len + p] * rows[p], 16 columns at a
// time, each row's codes widened once for the kHeads heads, where weighted_sum widens them once
// per head. Each column's sum is weighted_sum's chain (one FMA per row, rows in order): the same
// bits.
// 32 columns per pass over the rows (12 accumulators, the kHeads weights and one widened
// vector: the 16 registers): with 16, a fp16 row's cache line was read twice over, from L2 once
// the rows outgrew L1 (300 rows of 64 fp16 values: 38 KB).
template <int kHeads, typename C>
inline void head_weighted_codes(const C* const* rows, const float* w, int64_t len, int64_t d,
                                float* out, int64_t out_stride, const Ahead<C>& ahead = {}) {
  constexpr int kVectors = 4;  // 32 columns
  for (int64_t c0 = 0; c0 < d; c0 += 8 * kVectors) {
    __m256 acc[kHeads][kVectors];
    for (int h = 0; h < kHeads; ++h)
      for (int c = 0; c < kVectors; ++c) acc[h][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < len; ++p) {
      if (c0 == 0) prefetch_rows<2>(ahead.rows, p, p + 1, ahead.len, ahead.bytes);
      __m256 wp[kHeads];
      for (int h = 0; h < kHeads; ++h) wp[h] = _mm256_set1_ps(w[h * len + p]);
      for (int c = 0; c < kVectors; ++c) {
        const __m256 v = load8(rows[p] + c0 + 8 * c);
        for (int h = 0; h < kHeads; ++h) acc[h][c] = _mm256_fmadd_ps(wp[h], v, acc[h][c]);
      }
    }
    if (c0 == 0) prefetch_rows<2>(ahead.rows, len, ahead.len, ahead.len, ahead.bytes);  // its rest
    for (int h = 0; h < kHeads; ++h)
      for (int c = 0; c < kVectors; ++c) _mm256_storeu_ps(out + h * out_stride + c0 + 8 * c, acc[h][c]);
  }
}
#endif

// weighted_sum for `heads` query heads sharing the rows: out[h] (at out + h * out_stride) =
// sum_p w[h * len + p] * rows[p]; on AVX-512 the heads share each row's load.
template <typename T>
void group_weighted_sum(const T* const* rows, const float* w, int64_t heads, int64_t len,
                        int64_t d, float* out, int64_t out_stride, const Ahead<T>& ahead = {}) {
#ifdef PAGEDSERVE_AVX512
  if (d == 64) return group_weighted_rows<4>(rows, w, heads, len, out, out_stride, ahead);
  if (d == 128) return group_weighted_rows<8>(rows, w, heads, len, out, out_stride, ahead);
#elif defined(PAGEDSERVE_AVX2)
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, c10::BFloat16>) {
    if (d % 64 == 0) {  // codes: widened once for up to 3 heads (weighted_sum's bits)
      return by_three_heads(heads, [&](auto k, int64_t h) {
        // the first heads' pass requests the next task's keys
        head_weighted_codes<decltype(k)::value>(rows, w + h * len, len, d, out + h * out_stride,
                                                out_stride, h == 0 ? ahead : Ahead<T>{});
      });
    }
  }
#endif
  for (int64_t h = 0; h < heads; ++h)  // the first head's pass requests the next task's keys
    weighted_sum(rows, w + h * len, len, d, out + h * out_stride, h == 0 ? ahead : Ahead<T>{});
}

// One query head's scores (AVX-512 builds score every head at once in group_attention_scores
// and come here only for a head size that is not a multiple of 32).
template <typename T>
void attention_scores(const T* q, const T* const* krows, int64_t len, int64_t d, float scale,
                      float* s) {
#if defined(PAGEDSERVE_AVX2)
  if (d % 8 == 0) {
    for (int64_t p0 = 0; p0 < len; p0 += 8) {
      const int64_t count = std::min<int64_t>(8, len - p0);
      alignas(32) float sums[8];
      key_dots8(q, krows + p0, count, d, sums);
      for (int64_t i = 0; i < count; ++i) s[p0 + i] = sums[i] * scale;
    }
    return;
  }
#endif
  for (int64_t p = 0; p < len; ++p) {
    float dot = 0.f;
    for (int64_t i = 0; i < d; ++i) dot += to_float(q[i]) * to_float(krows[p][i]);
    s[p] = dot * scale;
  }
}

#ifdef PAGEDSERVE_AVX2
// The scores of kHeads query heads that share a KV head against 4 keys (the first `count`):
// each key vector is loaded once for all of them, where attention_scores (key_dots8) loads the
// query beside every key vector, two loads per FMA. The same products, partial sums and
// reduction as key_dots8 (sum8's first half), so the same bits.
template <int kHeads, int kCount, typename C = float>
inline void head_key_dots4(const float* q, const C* const* krows, int64_t d,
                           __m128* sums /* [kHeads]: lanes 0 .. kCount - 1 */) {
  static_assert(kCount >= 1 && kCount <= 4, "up to 4 keys");
  __m256 partial[kHeads][4];
  for (int h = 0; h < kHeads; ++h)
    for (int i = 0; i < 4; ++i) partial[h][i] = _mm256_setzero_ps();
  const C* rows[kCount];
  for (int i = 0; i < kCount; ++i) rows[i] = krows[i];
  for (int64_t j = 0; j < d; j += 8) {
    __m256 qv[kHeads];
    for (int h = 0; h < kHeads; ++h) qv[h] = _mm256_loadu_ps(q + h * d + j);
    for (int i = 0; i < kCount; ++i) {
      const __m256 kv = load8(rows[i] + j);  // codes widened once for every head
      for (int h = 0; h < kHeads; ++h) partial[h][i] = _mm256_fmadd_ps(qv[h], kv, partial[h][i]);
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(partial[h][0], partial[h][1]),
                                    _mm256_hadd_ps(partial[h][2], partial[h][3]));
    sums[h] = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  }
}

// s[h * len + p] = (q_h . krows[p]) * factor(p) for kHeads heads: factor(p) is key p's scale
// times the softmax scale against a quantized cache (key_scales, as attention_scores_codes
// computes each head's, key_dots8's bits), else `scale`; each key's codes widened once for the
// kHeads heads. Whole runs of 4 keys take no branch per key and scale their 4 sums in one
// multiply (the same products as one at a time, so the same bits); with the value scales
// applied in softmax_inplace's pass, decode attention over an fp16 cache ran 1.10-1.14x faster
// (`bench decode-attention --baseline-kernels`, 32 x 264 to 1 x 2,000 keys, AMD EPYC Zen 3).
// vrows (or null): the value rows the value pass reads, requested into L2 as their keys are
// scored (the cache's blocks lie anywhere in the pool: streams too short for the prefetcher).
template <int kHeads, typename C>
inline void head_scores(const float* q, const C* const* krows, int64_t len, int64_t d,
                        const float* key_scales, float scale, float* s /* [kHeads][len] */,
                        const C* const* vrows = nullptr) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(C));
  const __m128 scale_v = _mm_set1_ps(scale);
  int64_t p0 = 0;
  for (; p0 + 4 <= len; p0 += 4) {
    if (vrows) prefetch_rows<2>(vrows, p0, p0 + 4, len, row_bytes);
    __m128 sums[kHeads];
    head_key_dots4<kHeads, 4>(q, krows + p0, d, sums);
    const __m128 factor = key_scales ? _mm_loadu_ps(key_scales + p0) : scale_v;
    for (int h = 0; h < kHeads; ++h) _mm_storeu_ps(s + h * len + p0, _mm_mul_ps(sums[h], factor));
  }
  const int64_t count = len - p0;
  if (count == 0) return;
  if (vrows) prefetch_rows<2>(vrows, p0, len, len, row_bytes);
  __m128 sums[kHeads];
  if (count == 3) head_key_dots4<kHeads, 3>(q, krows + p0, d, sums);
  if (count == 2) head_key_dots4<kHeads, 2>(q, krows + p0, d, sums);
  if (count == 1) head_key_dots4<kHeads, 1>(q, krows + p0, d, sums);
  for (int h = 0; h < kHeads; ++h) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, sums[h]);
    for (int64_t i = 0; i < count; ++i)
      s[h * len + p0 + i] = lanes[i] * (key_scales ? key_scales[p0 + i] : scale);
  }
}
#endif

// s[g * len + p] = scale * q_g . krows[p] for the `group` query heads q_g (q + g * d) that share
// a KV head, each head's sums the same bits in a group as alone; on AVX2 in fp32 3 heads per pass
// over the keys. vrows (or null): the value rows the next pass reads, requested into L2 here.
template <typename T>
void group_attention_scores(const T* q, int64_t group, const T* const* krows, int64_t len,
                            int64_t d, float scale, float* s, const T* const* vrows = nullptr) {
#ifdef PAGEDSERVE_AVX512
  // 16 keys at a time for every head: the 16 key rows stay in L1 for the heads after the first
  // (a whole slice's keys, 64 KB at 512 keys, would not).
  if (d % 32 == 0) {
    const __m512 scale_v = _mm512_set1_ps(scale);
    // The cache is read block by block (16 keys = 2 KB of bf16 at d = 64) from blocks anywhere in
    // the pool, streams too short for the hardware prefetcher: the value rows are requested
    // into L2 as their keys are scored (and the next task's keys during the value pass).
    // Requesting keys ahead into L1 here measured slower.
    const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
      const int64_t count = std::min<int64_t>(16, len - p0);
      if (vrows) prefetch_rows<2>(vrows, p0, p0 + 16, len, row_bytes);
      for (int64_t g = 0; g < group; ++g) {
        __m512 partial[16];
        for (int i = 0; i < 16; ++i) {
          partial[i] = i < count ? dot_partial(krows[p0 + i], q + g * d, d) : _mm512_setzero_ps();
        }
        _mm512_mask_storeu_ps(s + g * len + p0, static_cast<__mmask16>((1u << count) - 1),
                              _mm512_mul_ps(sum16(partial), scale_v));
      }
    }
    return;
  }
#endif
#ifdef PAGEDSERVE_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (d % 8 == 0) {
      return by_three_heads(group, [&](auto k, int64_t g) {
        head_scores<decltype(k)::value>(q + g * d, krows, len, d, nullptr, scale, s + g * len,
                                        g == 0 ? vrows : nullptr);
      });
    }
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    attention_scores(q + g * d, krows, len, d, scale, s + g * len);
}

// Scores against a quantized cache: s[p] = (q . codes[p]) * key_scales[p], the query widened to
// fp32 and key_scales holding each key's scale times the softmax scale. vrows (or null): the
// value rows the value pass reads, requested into L2 here (AVX-512).
template <typename C>
void attention_scores_codes(const float* q, const C* const* krows, const float* key_scales,
                            int64_t len, int64_t d, float* s, const C* const* vrows = nullptr) {
#ifdef PAGEDSERVE_AVX512
  if (d % 16 == 0) {
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
      const int64_t count = std::min<int64_t>(16, len - p0);
      if (vrows) prefetch_rows<2>(vrows, p0, p0 + 16, len, d * static_cast<int64_t>(sizeof(C)));
      const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
      __m512 partial[16];
      for (int i = 0; i < 16; ++i) {
        partial[i] = _mm512_setzero_ps();
        if (i >= count) continue;
        for (int64_t j = 0; j < d; j += 16) {
          partial[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load16(krows[p0 + i] + j), partial[i]);
        }
      }
      const __m512 scales = _mm512_maskz_loadu_ps(valid, key_scales + p0);
      _mm512_mask_storeu_ps(s + p0, valid, _mm512_mul_ps(sum16(partial), scales));
    }
    return;
  }
#elif defined(PAGEDSERVE_AVX2)
  if (d % 8 == 0) {
    for (int64_t p0 = 0; p0 < len; p0 += 8) {
      const int64_t count = std::min<int64_t>(8, len - p0);
      alignas(32) float sums[8];
      key_dots8(q, krows + p0, count, d, sums);
      for (int64_t i = 0; i < count; ++i) s[p0 + i] = sums[i] * key_scales[p0 + i];
    }
    return;
  }
#endif
  for (int64_t p = 0; p < len; ++p) {
    float dot = 0.f;
    for (int64_t i = 0; i < d; ++i) dot += q[i] * to_float(krows[p][i]);
    s[p] = dot * key_scales[p];
  }
}

// attention_scores_codes for the `group` query heads (q32 + g * d) sharing a KV head: on AVX2 3
// heads per pass over the keys (each key's codes widened once), each head's scores the same bits
// as alone; vrows as attention_scores_codes takes it (requested by the first head's pass).
template <typename C>
void group_attention_scores_codes(const float* q32, int64_t group, const C* const* krows,
                                  const float* key_scales, int64_t len, int64_t d, float* s,
                                  const C* const* vrows) {
#ifdef PAGEDSERVE_AVX2
  if (d % 8 == 0) {
    return by_three_heads(group, [&](auto k, int64_t g) {
      head_scores<decltype(k)::value>(q32 + g * d, krows, len, d, key_scales, 1.f, s + g * len,
                                      g == 0 ? vrows : nullptr);
    });
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    attention_scores_codes(q32 + g * d, krows, key_scales, len, d, s + g * len,
                           g == 0 ? vrows : nullptr);
}

// s[p] = exp(s[p] - mx) in place; returns their sum.
inline float exp_inplace(float* s, int64_t len, float mx) {
  float total = 0.f;
  int64_t p = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 mx_v = _mm512_set1_ps(mx);
  __m512 total_v = _mm512_setzero_ps();
  for (; p + 16 <= len; p += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + p), mx_v));
    _mm512_storeu_ps(s + p, e);
    total_v = _mm512_add_ps(total_v, e);
  }
  total = _mm512_reduce_add_ps(total_v);
#elif defined(PAGEDSERVE_AVX2)
  const __m256 mx_v = _mm256_set1_ps(mx);
  __m256 total_v = _mm256_setzero_ps();
  for (; p + 8 <= len; p += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + p), mx_v));
    _mm256_storeu_ps(s + p, e);
    total_v = _mm256_add_ps(total_v, e);
  }
  total = reduce_add8(total_v);
#endif
  for (; p < len; ++p) total += (s[p] = std::exp(s[p] - mx));
  return total;
}

// The largest of s[0..len) (len >= 1). std::max_element's loop stays scalar (it returns a
// position): it took a third of paged attention's own time beside the dot products (perf, Zen 4).
inline float max_of(const float* s, int64_t len) {
  int64_t p = 0;
  float top = s[0];
#ifdef PAGEDSERVE_AVX512
  __m512 top_v = _mm512_set1_ps(s[0]);
  for (; p + 16 <= len; p += 16) top_v = _mm512_max_ps(top_v, _mm512_loadu_ps(s + p));
  top = _mm512_reduce_max_ps(top_v);
#elif defined(PAGEDSERVE_AVX2)
  __m256 top_v = _mm256_set1_ps(s[0]);
  for (; p + 8 <= len; p += 8) top_v = _mm256_max_ps(top_v, _mm256_loadu_ps(s + p));
  top = reduce_max8(top_v);
#endif
  for (; p < len; ++p) top = std::max(top, s[p]);
  return top;
}

// s <- softmax(s) in place, or with `factors` softmax(s)[p] * factors[p] (a quantized cache's
// value scales: rounded after the normalization, as two passes would, in one).
inline void softmax_inplace(float* s, int64_t len, const float* factors = nullptr) {
  const float inv = 1.f / exp_inplace(s, len, max_of(s, len));
  if (factors) {
    for (int64_t p = 0; p < len; ++p) s[p] = (s[p] * inv) * factors[p];
  } else {
    for (int64_t p = 0; p < len; ++p) s[p] *= inv;
  }
}

// dst[i] = float(src[i]) * factor for n fp16 values: a run of a quantized cache's scales (one
// block's consecutive slots), 8 at a time by F16C where c10::Half's conversion is scalar. The
// same bits: the fp16 -> fp32 conversion is exact and the product rounds once either way.
inline void widen_scales(const c10::Half* src, int64_t n, float factor, float* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 factor_v = _mm256_set1_ps(factor);
  for (; i + 8 <= n; i += 8) {
    const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(wide, factor_v));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * factor;
}

// A sequence longer than kSplitKeys is attended in slices of kSplitKeys keys (the last one
// shorter), each an independent task, and the slices' partial results (max score, sum of
// exponentials, unnormalized weighted values) are then merged in order, as flash-decoding does:
// one long decode keeps every core busy instead of one per KV head. The slices depend only on
// the sequence's length, never on the batch or the thread count, so a token's result is the same
// bits in any step; a sequence of at most kSplitKeys keys is one slice, normalized directly.
constexpr int64_t kSplitKeys = 512;

// C: the cache's element type, T itself or int8 / fp8 codes; then key_scale and value_scale are
// (Hkv, num_blocks, block_size) fp16, else unused. A quantized key enters the scores as
// (q . codes) * scale (q widened to fp32), a value the weighted sum as codes with weight
// p * scale.
template <typename T, typename C>
void paged_attention_impl(const T* q, int64_t q_token_stride, const C* key_cache,
                          const C* value_cache, const c10::Half* key_scale,
                          const c10::Half* value_scale, int64_t num_cache_blocks,
                          int64_t block_size, const int64_t* block_table, int64_t table_stride,
                          const int64_t* block_rows, const int64_t* seq_lens, int64_t tokens,
                          int64_t heads, int64_t kv_heads, int64_t d, float scale, T* out) {
  constexpr bool kQuantized = !std::is_same<T, C>::value;
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = num_cache_blocks * block_size * d;  // one KV head's whole cache
  // The tasks: (token, KV head, slice of keys). first_task[t]: token t's first; a split token's
  // slices each leave, per query head, its max score, sum of exponentials and d weighted values
  // in `partials` (at its task's place), for the merge below.
  std::vector<int64_t> first_task(tokens + 1, 0), first_partial(tokens + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slices = seq_lens[t] > kSplitKeys ? (seq_lens[t] + kSplitKeys - 1) / kSplitKeys : 1;
    first_task[t + 1] = first_task[t] + kv_heads * slices;
    first_partial[t + 1] = first_partial[t] + (slices > 1 ? kv_heads * slices : 0);
  }
  const int64_t partial_size = group * (d + 2);
  std::vector<float> partials(first_partial[tokens] * partial_size);
  // Task `task`'s token t, KV head h and slice of keys (len of them): their cache rows and,
  // quantized, their scales (the keys' times the softmax scale).
  struct TaskRows {
    int64_t t = 0, h = 0, slices = 1, slice = 0, len = 0;
    std::vector<const C*> krows, vrows;
    std::vector<float> key_scales, value_scales;  // quantized only
  };
  auto locate = [&](int64_t task, TaskRows& r) {
    while (task >= first_task[r.t + 1]) ++r.t;
    r.slices = (first_task[r.t + 1] - first_task[r.t]) / kv_heads;
    r.h = (task - first_task[r.t]) / r.slices;
    r.slice = (task - first_task[r.t]) % r.slices;
    const int64_t key_begin = r.slice * kSplitKeys;
    r.len = std::min(seq_lens[r.t], key_begin + kSplitKeys) - key_begin;
    const int64_t* blocks = block_table + block_rows[r.t] * table_stride;
    const C* kh = key_cache + r.h * head_stride;
    const C* vh = value_cache + r.h * head_stride;
    const int64_t head_slots = r.h * num_cache_blocks * block_size;
    r.krows.resize(r.len);
    r.vrows.resize(r.len);
    if constexpr (kQuantized) {
      r.key_scales.resize(r.len);
      r.value_scales.resize(r.len);
    }
    // keys key_begin + i .. + run: consecutive slots of block b from `offset`
    for (int64_t i = 0, b = key_begin / block_size, offset = key_begin % block_size; i < r.len;
         ++b, offset = 0) {
      const int64_t run = std::min(block_size - offset, r.len - i);
      const int64_t first_slot = blocks[b] * block_size + offset;
      for (int64_t j = 0; j < run; ++j) {
        r.krows[i + j] = kh + (first_slot + j) * d;
        r.vrows[i + j] = vh + (first_slot + j) * d;
      }
      if constexpr (kQuantized) {
        widen_scales(key_scale + head_slots + first_slot, run, scale, r.key_scales.data() + i);
        widen_scales(value_scale + head_slots + first_slot, run, 1.f, r.value_scales.data() + i);
      }
      i += run;
    }
  };
  parallel_ranges(first_task[tokens], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * d), scores;
    std::vector<float> q32(kQuantized ? group * d : 0);  // quantized only: the widened queries
    // this task's rows and the next one's, whose keys the value pass requests ahead
    TaskRows current, next;
    current.t = next.t = std::upper_bound(first_task.begin(), first_task.end(), begin) -
                         first_task.begin() - 1;
    locate(begin, next);
    for (int64_t task = begin; task < end; ++task) {
      std::swap(current, next);
      if (task + 1 < end) locate(task + 1, next);
      else next.len = 0;
      const int64_t t = current.t, h = current.h, slices = current.slices, slice = current.slice;
      const int64_t len = current.len;
      const std::vector<const C*>& krows = current.krows;
      const std::vector<const C*>& vrows = current.vrows;
      scores.resize(group * len);
      float* partial = slices > 1 ? partials.data() +
          (first_partial[t] + h * slices + slice) * partial_size : nullptr;
      if constexpr (kQuantized) {
        widen_row(q + t * q_token_stride + h * group * d, q32.data(), group * d);
        // the first head's pass requests the value rows, as group_attention_scores does
        group_attention_scores_codes(q32.data(), group, krows.data(),
                                     current.key_scales.data(), len, d, scores.data(),
                                     vrows.data());
      } else {
        group_attention_scores(q + t * q_token_stride + h * group * d, group, krows.data(), len,
                               d, scale, scores.data(), vrows.data());
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float* value_scales = kQuantized ? current.value_scales.data() : nullptr;
        if (partial) {  // unnormalized: the merge divides by the slices' total
          partial[g * (d + 2)] = max_of(s, len);
          partial[g * (d + 2) + 1] = exp_inplace(s, len, partial[g * (d + 2)]);
          if (value_scales) {
            for (int64_t i = 0; i < len; ++i) s[i] *= value_scales[i];
          }
        } else {
          softmax_inplace(s, len, value_scales);
        }
      }
      // the value sums: group * d values at acc, or each head's d after its 2 statistics
      const Ahead<C> ahead{next.krows.data(), next.len, d * static_cast<int64_t>(sizeof(C))};
      if (partial) {
        group_weighted_sum(vrows.data(), scores.data(), group, len, d, partial + 2, d + 2, ahead);
      } else {
        group_weighted_sum(vrows.data(), scores.data(), group, len, d, acc.data(), d, ahead);
      }
      if (!partial) {
        for (int64_t g = 0; g < group; ++g) {
          T* o = out + (t * heads + h * group + g) * d;
          for (int64_t i = 0; i < d; ++i) o[i] = from_float<T>(acc[g * d + i]);
        }
      }
    }
  });
  // Merge each split token's slices, in order: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
  if (partials.empty()) return;
  at::parallel_for(0, tokens * heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / heads, head = task % heads, h = head / group, g = head % group;
      const int64_t slices = (first_task[t + 1] - first_task[t]) / kv_heads;
      if (slices == 1) continue;
      const float* first = partials.data() + (first_partial[t] + h * slices) * partial_size + g * (d + 2);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < slices; ++c) top = std::max(top, first[c * partial_size]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < slices; ++c) {
        const float* part = first + c * partial_size;
        const float weight = std::exp(part[0] - top);
        total += weight * part[1];
        for (int64_t i = 0; i < d; ++i) merged[i] += weight * part[2 + i];
      }
      T* o = out + (t * heads + head) * d;
      const float inv = 1.f / total;
      for (int64_t i = 0; i < d; ++i) o[i] = from_float<T>(merged[i] * inv);
    }
  });
}

// The element types of a quantized KV cache's codes.
#define DISPATCH_KV_CODES(TYPE, NAME, ...)                                                  \
  [&] {                                                                                    \
    if ((TYPE) == at::kChar) {                                                             \
      using cache_t = int8_t;                                                              \
      return __VA_ARGS__();                                                                \
    }                                                                                      \
    if ((TYPE) == at::kHalf) {                                                             \
      using cache_t = c10::Half;                                                           \
      return __VA_ARGS__();                                                                \
    }                                                                                      \
    TORCH_CHECK((TYPE) == at::kFloat8_e4m3fn,                                              \
                NAME ": quantized KV is int8, float8_e4m3fn or float16");                  \
    using cache_t = c10::Float8_e4m3fn;                                                    \
    return __VA_ARGS__();                                                                  \
  }()

// A quantized cache's scales: both given or neither, (Hkv, num_blocks, block_size) fp16 each.
bool check_kv_scales(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                     const c10::optional<torch::Tensor>& key_scale,
                     const c10::optional<torch::Tensor>& value_scale) {
  TORCH_CHECK(key_scale.has_value() == value_scale.has_value(), "key and value scales, or neither");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "key and value dtypes differ");
  if (!key_scale) return false;
  for (const torch::Tensor* s : {&*key_scale, &*value_scale}) {
    TORCH_CHECK(s->scalar_type() == torch::kHalf && s->is_contiguous() && s->dim() == 3 &&
                    s->size(0) == key_cache.size(0) && s->size(1) == key_cache.size(1) &&
                    s->size(2) == key_cache.size(2),
                "scales must be contiguous fp16 (Hkv, num_blocks, block_size)");
  }
  return true;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_table, torch::Tensor block_rows,
                              torch::Tensor seq_lens, double scale,
                              c10::optional<torch::Tensor> key_scale,
                              c10::optional<torch::Tensor> value_scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be (T, H, D) with dense heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous (Hkv, num_blocks, block_size, D)");
  const bool quantized = check_kv_scales(key_cache, value_cache, key_scale, value_scale);
  TORCH_CHECK(quantized || key_cache.scalar_type() == q.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.stride(1) == 1,
              "block_table must be int64 with dense rows");
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = key_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && key_cache.size(3) == d, "head shapes");
  torch::Tensor rows = block_rows.to(torch::kInt64).contiguous();
  torch::Tensor lens = seq_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(rows.numel() == tokens && lens.numel() == tokens, "one row and length per token");
  torch::Tensor out = torch::empty({tokens, heads, d}, q.options());
  DISPATCH_FLOAT_OR_BF16(q.scalar_type(), "paged_attention", [&] {
    if (!quantized) {
      paged_attention_impl<scalar_t, scalar_t>(
          q.data_ptr<scalar_t>(), q.stride(0), key_cache.data_ptr<scalar_t>(),
          value_cache.data_ptr<scalar_t>(), nullptr, nullptr, key_cache.size(1),
          key_cache.size(2), block_table.data_ptr<int64_t>(), block_table.stride(0),
          rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), tokens, heads, kv_heads, d,
          static_cast<float>(scale), out.data_ptr<scalar_t>());
      return;
    }
    DISPATCH_KV_CODES(key_cache.scalar_type(), "paged_attention", [&] {
      paged_attention_impl<scalar_t, cache_t>(
          q.data_ptr<scalar_t>(), q.stride(0), key_cache.data_ptr<cache_t>(),
          value_cache.data_ptr<cache_t>(), key_scale->data_ptr<c10::Half>(),
          value_scale->data_ptr<c10::Half>(), key_cache.size(1), key_cache.size(2),
          block_table.data_ptr<int64_t>(), block_table.stride(0), rows.data_ptr<int64_t>(),
          lens.data_ptr<int64_t>(), tokens, heads, kv_heads, d, static_cast<float>(scale),
          out.data_ptr<scalar_t>());
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Prefill attention for one request's chunk in bf16: query i (position context_len + i) attends
// to cached positions [0, context_len + i]. Flash-style: each query row walks the key blocks
// with an online softmax, so no (T x S) score matrix is formed. The keys and values of each KV
// head are first rearranged so that one AVX512-BF16 instruction does 16 keys' (or 16 dims')
// worth of pair products:
//   kt[block][p][key]  = 32-bit word (K[key][2p], K[key][2p + 1])   -> q . k for 16 keys at once
//   vt[block][kp][dim] = 32-bit word (V[2kp][dim], V[2kp + 1][dim]) -> p . v for 16 dims at once
// Scores, softmax and accumulators are fp32; the probabilities enter the value product rounded
// to bf16, as in the bf16 matmul they replace. A quantized cache is dequantized to bf16 (code *
// scale in fp32, rounded once, as the torch path does) while the tiles are laid out.

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_FLASH 1

constexpr int64_t kKeyTile = 16;

inline uint32_t bf16_pair(const c10::BFloat16* lo, const c10::BFloat16* hi) {
  return static_cast<uint32_t>(lo->x) | (static_cast<uint32_t>(hi->x) << 16);
}

// kRows query rows (each: D bf16 at q[r], seeing visible[r] keys) against the keys of one
// head, 32 keys per softmax step. Several rows and two 16-key tiles keep that many independent
// chains of dot instructions in flight (one row alone waits on their latency). Two tiles ran
// 1.09x faster than four (whose steps left fewer registers to the softmax between the two dot
// phases), three no faster (Zen 4, `bench attention`).
constexpr int64_t kTilesPerStep = 2;
constexpr int kFlashRows = 3;

// One softmax step of kStep keys (`tiles` 16-key tiles of them) for kRows query rows, the two
// phases flash_rows and flash_rows_wide share:
//   flash_scores: s[r][j] = q_r . k for the tiles' keys (unscaled), kt_step the step's tiles;
//   flash_weights: each row's running max, and where it moves rescale(r, alpha) of the row's
//     sums so far (total[r] here, the accumulators by the caller), then the softmax weights of
//     the keys row r sees, added to total[r] and rounded to bf16 pairs in pairs[r].
template <int DC, int kRows>
inline void flash_scores(const uint32_t* const* qw, const uint32_t* kt_step, int64_t tiles,
                         __m512 (&s)[kRows][kTilesPerStep]) {
  constexpr int64_t kPairs = DC * 8;
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kTilesPerStep; ++j) s[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kPairs; ++p) {
    __m512bh qp[kRows];
    for (int r = 0; r < kRows; ++r)
      qp[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r][p]));
    for (int j = 0; j < kTilesPerStep; ++j) {
      if (j >= tiles) break;
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kt_step + (j * kPairs + p) * kKeyTile);
      for (int r = 0; r < kRows; ++r) s[r][j] = _mm512_dpbf16_ps(s[r][j], k, qp[r]);
    }
  }
}

template <int kRows, typename Rescale>
inline void flash_weights(const __m512 (&s)[kRows][kTilesPerStep], const int64_t* visible,
                          int64_t first, int64_t tiles, float log2_scale, float* running_max,
                          __m512* total, uint32_t (&pairs)[kRows][kKeyTile * kTilesPerStep / 2],
                          Rescale&& rescale) {
  const __m512 log2_scale_v = _mm512_set1_ps(log2_scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < kRows; ++r) {
    __mmask16 keep[kTilesPerStep];
    __m512 step_max = minus_inf;
    for (int j = 0; j < tiles; ++j) {
      const int64_t valid = std::clamp<int64_t>(visible[r] - first - j * kKeyTile, 0, kKeyTile);
      keep[j] = static_cast<__mmask16>((1u << valid) - 1);
      step_max = _mm512_mask_max_ps(step_max, keep[j], step_max, s[r][j]);
    }
    // The running max (of the unscaled scores) moves only when this step holds a larger score
    // (most steps do not, once the first keys are seen): only then are the sums so far rescaled
    // (by 1 they would not change). Every row sees key 0, so its running max is finite from
    // the first step on.
    if (_mm512_cmp_ps_mask(step_max, _mm512_set1_ps(running_max[r]), _CMP_GT_OQ)) {
      const float new_max = _mm512_reduce_max_ps(step_max);
      const __m512 alpha_v = _mm512_set1_ps(std::exp2((running_max[r] - new_max) * log2_scale));
      running_max[r] = new_max;  // alpha is 0 at the first step (from -inf)
      total[r] = _mm512_mul_ps(total[r], alpha_v);
      rescale(r, alpha_v);
    }
    // softmax weight exp(scale * (s - max)) = 2^(s * log2_scale - max * log2_scale)
    const __m512 max_term = _mm512_set1_ps(running_max[r] * log2_scale);
    for (int j = 0; j < tiles; ++j) {
      const __m512 probs = exp2_512(keep[j], _mm512_fmsub_ps(s[r][j], log2_scale_v, max_term));
      total[r] = _mm512_add_ps(total[r], probs);
      // rounded to nearest even, as bf16_bits rounds (a weight below 2^-126, which it would
      // keep, is flushed to 0 here: nothing a bf16 sum of weights near 1 could hold)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r] + 8 * j),
                         (__m256i)_mm512_cvtneps_pbh(probs));
    }
  }
}

// Each row's softmax state before its first step: running max -inf, probability sums 0. Returns
// the most keys any of the rows sees (their steps run to it).
template <int kRows>
inline int64_t start_softmax(const int64_t* visible, float* running_max, __m512* total) {
  int64_t most = 0;
  for (int r = 0; r < kRows; ++r) {
    running_max[r] = -std::numeric_limits<float>::infinity();
    total[r] = _mm512_setzero_ps();
    most = std::max(most, visible[r]);
  }
  return most;
}

// The 16-key tiles in the softmax step from key `first` of rows that see at most `most` keys.
inline int64_t step_key_tiles(int64_t most, int64_t first) {
  return std::min<int64_t>(kTilesPerStep, (most - first + kKeyTile - 1) / kKeyTile);
}

// The rows' accumulators in registers (DC per row): head dims 64 and 128.
template <int DC, int kRows>
void flash_rows(const c10::BFloat16* const* q, const int64_t* visible, const uint32_t* kt,
                const uint32_t* vt, float scale, c10::BFloat16* const* out) {
  constexpr int64_t kD = DC * 16, kPairs = kD / 2, kStep = kKeyTile * kTilesPerStep;
  const uint32_t* qw[kRows];
  __m512 acc[kRows][DC];
  __m512 total[kRows];  // per lane: the sums of the probabilities, reduced once at the end
  float running_max[kRows];
  const int64_t most = start_softmax<kRows>(visible, running_max, total);
  for (int r = 0; r < kRows; ++r) {
    qw[r] = reinterpret_cast<const uint32_t*>(q[r]);
    for (int c = 0; c < DC; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const float log2_scale = scale * 1.4426950408889634f;
  for (int64_t first = 0; first < most; first += kStep) {
    const int64_t tiles = step_key_tiles(most, first);
    __m512 s[kRows][kTilesPerStep];
    flash_scores<DC, kRows>(qw, kt + (first / kKeyTile) * kPairs * kKeyTile, tiles, s);
    alignas(64) uint32_t pairs[kRows][kStep / 2];  // per row: (p[2kp], p[2kp+1]) as bf16 pairs
    flash_weights<kRows>(s, visible, first, tiles, log2_scale, running_max, total, pairs,
                         [&](int r, __m512 alpha_v) {
                           for (int c = 0; c < DC; ++c)
                             acc[r][c] = _mm512_mul_ps(acc[r][c], alpha_v);
                         });
    // p . v for all rows together: each value tile is loaded once for every row.
    const uint32_t* vt_step = vt + (first / 2) * kD;
    const int64_t key_pairs = std::min<int64_t>(kStep, most - first + 1) / 2;
    for (int64_t kp = 0; kp < key_pairs; ++kp) {
      __m512bh v[DC];
      for (int c = 0; c < DC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt_step + kp * kD + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][kp]));
        for (int c = 0; c < DC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], w);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total[r]));
    for (int c = 0; c < DC; ++c) store16(out[r] + 16 * c, _mm512_mul_ps(acc[r][c], inv));
  }
}

// flash_rows for wide heads (DC >= 16: head dim 256, Gemma 3), where kRows rows' accumulators
// (16 registers each) cannot all live in registers: they live in an fp32 buffer in L1, and the
// value product walks the dims outermost, 16 at a time, with the step's kRows x 16 accumulators
// in registers over its 16 key pairs (each value tile loaded once for every row, each row's
// probability pair broadcast from L1). The scores, softmax and rounding are flash_rows'.
constexpr int kFlashWideRows = 4;  // Gemma-3-270M's query heads per KV head: one token's rows

template <int DC, int kRows>
void flash_rows_wide(const c10::BFloat16* const* q, const int64_t* visible, const uint32_t* kt,
                     const uint32_t* vt, float scale, c10::BFloat16* const* out) {
  constexpr int64_t kD = DC * 16, kPairs = kD / 2, kStep = kKeyTile * kTilesPerStep;
  const uint32_t* qw[kRows];
  alignas(64) float acc[kRows][kD];
  __m512 total[kRows];
  float running_max[kRows];
  const int64_t most = start_softmax<kRows>(visible, running_max, total);
  for (int r = 0; r < kRows; ++r) {
    qw[r] = reinterpret_cast<const uint32_t*>(q[r]);
    std::fill(acc[r], acc[r] + kD, 0.f);
  }
  const float log2_scale = scale * 1.4426950408889634f;
  for (int64_t first = 0; first < most; first += kStep) {
    const int64_t tiles = step_key_tiles(most, first);
    __m512 s[kRows][kTilesPerStep];
    flash_scores<DC, kRows>(qw, kt + (first / kKeyTile) * kPairs * kKeyTile, tiles, s);
    alignas(64) uint32_t pairs[kRows][kStep / 2];
    flash_weights<kRows>(s, visible, first, tiles, log2_scale, running_max, total, pairs,
                         [&](int r, __m512 alpha_v) {
                           for (int64_t i = 0; i < kD; i += 16)
                             _mm512_store_ps(acc[r] + i,
                                             _mm512_mul_ps(_mm512_load_ps(acc[r] + i), alpha_v));
                         });
    const uint32_t* vt_step = vt + (first / 2) * kD;
    const int64_t key_pairs = std::min<int64_t>(kStep, most - first + 1) / 2;
    for (int c = 0; c < DC; ++c) {
      __m512 a[kRows];
      for (int r = 0; r < kRows; ++r) a[r] = _mm512_load_ps(acc[r] + 16 * c);
      for (int64_t kp = 0; kp < key_pairs; ++kp) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(vt_step + kp * kD + 16 * c);
        for (int r = 0; r < kRows; ++r)
          a[r] = _mm512_dpbf16_ps(
              a[r], v, (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][kp])));
      }
      for (int r = 0; r < kRows; ++r) _mm512_store_ps(acc[r] + 16 * c, a[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total[r]));
    for (int c = 0; c < DC; ++c)
      store16(out[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), inv));
  }
}

#include "amx_flash.h"

// The bf16 rows at `count` slots of one KV head (kD values each): a bf16 cache's own rows, or a
// quantized cache's rows dequantized into buf (kKeyTile * kD values).
template <int64_t kD>
inline void bf16_rows(const c10::BFloat16* head, const c10::Half* /*head_scales*/,
                      const int64_t* slots, int64_t count, c10::BFloat16* /*buf*/,
                      const c10::BFloat16** rows) {
  for (int64_t j = 0; j < count; ++j) rows[j] = head + slots[j] * kD;
}
template <int64_t kD, typename C>
inline void bf16_rows(const C* head, const c10::Half* head_scales, const int64_t* slots,
                      int64_t count, c10::BFloat16* buf, const c10::BFloat16** rows) {
  for (int64_t j = 0; j < count; ++j) {
    const C* codes = head + slots[j] * kD;
    const float row_scale = static_cast<float>(head_scales[slots[j]]);
    c10::BFloat16* row = buf + j * kD;
    for (int64_t i = 0; i < kD; ++i) row[i] = c10::BFloat16(to_float(codes[i]) * row_scale);
    rows[j] = row;
  }
}

// C: c10::BFloat16, or int8 / fp8 codes with (Hkv, num_blocks, block_size) fp16 scales.
template <int DC, typename C>
void flash_prefill(const c10::BFloat16* q, int64_t q_token_stride, const C* key_cache,
                   const C* value_cache, const c10::Half* key_scale, const c10::Half* value_scale,
                   int64_t num_cache_blocks, int64_t block_size, const int64_t* block_ids,
                   int64_t context_len, int64_t tokens, int64_t heads, int64_t kv_heads,
                   float scale, c10::BFloat16* out,
                   TileMode tiles_mode = tile_mode.load(std::memory_order_relaxed)) {
  constexpr int64_t kD = DC * 16, kPairs = kD / 2;
  const int64_t group = heads / kv_heads;
  const int64_t seq_len = context_len + tokens;
  constexpr int64_t kStep = kKeyTile * kTilesPerStep;
  // the AMX kernel's steps read whole 32-key steps: the last one padded with zero keys
  const int64_t tiles = tiles_mode == TileMode::kOff
                            ? (seq_len + kKeyTile - 1) / kKeyTile
                            : (seq_len + kStep - 1) / kStep * kTilesPerStep;
  const int64_t head_slots = num_cache_blocks * block_size;
  const int64_t head_stride = head_slots * kD;
  // kt, vt per KV head: tiles * 16 keys * D / 2 words each; keys past seq_len are zero.
  std::vector<uint32_t> kt(kv_heads * tiles * kKeyTile * kPairs, 0);
  std::vector<uint32_t> vt(kv_heads * tiles * kKeyTile * kPairs, 0);
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    c10::BFloat16 buf[kKeyTile * kD];  // dequantized rows (quantized caches only)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tiles, tile = task % tiles;
      uint32_t* kt_tile = kt.data() + task * kKeyTile * kPairs;
      uint32_t* vt_tile = vt.data() + task * kKeyTile * kPairs;
      const c10::BFloat16* rows[kKeyTile];
      int64_t slots[kKeyTile];
      const int64_t first = tile * kKeyTile, count = std::min(kKeyTile, seq_len - first);
      if (count <= 0) continue;  // a padding tile: zeros
      for (int64_t j = 0; j < count; ++j) {
        const int64_t pos = first + j;
        slots[j] = block_ids[pos / block_size] * block_size + pos % block_size;
      }
      // a bf16 cache has no scales (null) and bf16_rows ignores them
      const c10::Half* k_scales = key_scale ? key_scale + h * head_slots : nullptr;
      const c10::Half* v_scales = value_scale ? value_scale + h * head_slots : nullptr;
      bf16_rows<kD>(key_cache + h * head_stride, k_scales, slots, count, buf, rows);
      for (int64_t j = 0; j < count; ++j) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(rows[j]);
        for (int64_t p = 0; p < kPairs; ++p) kt_tile[p * kKeyTile + j] = words[p];
      }
      bf16_rows<kD>(value_cache + h * head_stride, v_scales, slots, count, buf, rows);
      for (int64_t kp = 0; kp < (count + 1) / 2; ++kp) {
        const c10::BFloat16* even = rows[2 * kp];
        const c10::BFloat16 zero(0.f);
        for (int64_t dim = 0; dim < kD; ++dim) {
          const c10::BFloat16* odd = 2 * kp + 1 < count ? rows[2 * kp + 1] + dim : &zero;
          vt_tile[kp * kD + dim] = bf16_pair(even + dim, odd);
        }
      }
    }
  });
#ifdef PAGEDSERVE_AMX_FLASH
  if (tiles_mode != TileMode::kOff) {
    // 16 consecutive tokens of one query head per pass, the blocks dealt from both ends
    flash_tile_passes.fetch_add(1, std::memory_order_relaxed);
    const int64_t token_blocks = (tokens + kFlashTileRows - 1) / kFlashTileRows;
    parallel_ranges(heads * token_blocks, 1, [&](int64_t begin, int64_t end) {
      const TileSession tile_session(tiles_mode, flash_tile_config());
      alignas(64) c10::BFloat16 qs[kFlashTileRows * kD];
      alignas(64) float outs[kFlashTileRows * kD];
      int64_t visible[kFlashTileRows];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t head = task / token_blocks, k = task % token_blocks;
        const int64_t block = k % 2 == 0 ? k / 2 : token_blocks - 1 - k / 2;
        const int64_t h = head / group, t0 = block * kFlashTileRows;
        const int64_t count = std::min(kFlashTileRows, tokens - t0);
        for (int64_t i = 0; i < kFlashTileRows; ++i) {  // rows past the chunk: zeros, 1 key
          if (i < count) {
            std::copy_n(q + (t0 + i) * q_token_stride + head * kD, kD, qs + i * kD);
          } else {
            std::fill_n(qs + i * kD, kD, c10::BFloat16(0.f));
          }
          visible[i] = i < count ? context_len + t0 + i + 1 : 1;
        }
        const uint32_t* kt_head = kt.data() + h * tiles * kKeyTile * kPairs;
        const uint32_t* vt_head = vt.data() + h * tiles * kKeyTile * kPairs;
        if (tiles_mode == TileMode::kHardware) {
          flash_tile_rows<HardwareTiles, DC>(qs, visible, kt_head, vt_head, scale, outs);
        } else {
          flash_tile_rows<TileModel, DC>(qs, visible, kt_head, vt_head, scale, outs);
        }
        for (int64_t i = 0; i < count; ++i)
          for (int64_t c = 0; c < kD; c += 16)
            store16(out + ((t0 + i) * heads + head) * kD + c, _mm512_load_ps(outs + i * kD + c));
      }
    });
    return;
  }
#endif
  // Rows (token, head) of a KV head in blocks of 8 tokens; a later token sees more keys, so the
  // blocks are dealt from both ends to even out the ranges' work. Head dim 256 (Gemma 3) runs
  // flash_rows_wide, 4 rows per pass.
  constexpr int64_t kTokenBlock = 8;
  constexpr bool kWide = DC >= 16;
  constexpr int kRowsPerPass = kWide ? kFlashWideRows : kFlashRows;
  // n (1..kRowsPerPass) rows at qs, visible, outs
  auto run_rows = [&](int n, const c10::BFloat16* const* qs, const int64_t* visible,
                      const uint32_t* kt_head, const uint32_t* vt_head,
                      c10::BFloat16* const* outs) {
    if constexpr (kWide) {
      switch (n) {
        case 4: return flash_rows_wide<DC, 4>(qs, visible, kt_head, vt_head, scale, outs);
        case 3: return flash_rows_wide<DC, 3>(qs, visible, kt_head, vt_head, scale, outs);
        case 2: return flash_rows_wide<DC, 2>(qs, visible, kt_head, vt_head, scale, outs);
        default: return flash_rows_wide<DC, 1>(qs, visible, kt_head, vt_head, scale, outs);
      }
    } else {
      switch (n) {
        case 3: return flash_rows<DC, 3>(qs, visible, kt_head, vt_head, scale, outs);
        case 2: return flash_rows<DC, 2>(qs, visible, kt_head, vt_head, scale, outs);
        default: return flash_rows<DC, 1>(qs, visible, kt_head, vt_head, scale, outs);
      }
    }
  };
  static_assert(kFlashRows == 3 && kFlashWideRows == 4, "run_rows takes 1..kRowsPerPass rows");
  const int64_t token_blocks = (tokens + kTokenBlock - 1) / kTokenBlock;
  parallel_ranges(kv_heads * token_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / token_blocks, k = task % token_blocks;
      const int64_t block = k % 2 == 0 ? k / 2 : token_blocks - 1 - k / 2;
      const uint32_t* kt_head = kt.data() + h * tiles * kKeyTile * kPairs;
      const uint32_t* vt_head = vt.data() + h * tiles * kKeyTile * kPairs;
      const c10::BFloat16* qs[kRowsPerPass];
      c10::BFloat16* outs[kRowsPerPass];
      int64_t visible[kRowsPerPass];
      int n = 0;
      const int64_t last = std::min(tokens, (block + 1) * kTokenBlock);
      for (int64_t t = block * kTokenBlock; t < last; ++t) {
        for (int64_t g = 0; g < group; ++g) {  // rows taken kRowsPerPass at a time
          const int64_t head = h * group + g;
          qs[n] = q + t * q_token_stride + head * kD;
          outs[n] = out + (t * heads + head) * kD;
          visible[n] = context_len + t + 1;
          if (++n == kRowsPerPass) {
            run_rows(n, qs, visible, kt_head, vt_head, outs);
            n = 0;
          }
        }
      }
      if (n > 0) run_rows(n, qs, visible, kt_head, vt_head, outs);
    }
  });
}
#endif

#include "prefill_attention_f32.h"

// One request's prefill chunk: bf16 with head_dim 64, 128 or 256 (the flash kernel above), or
// fp32 on a plain fp32 cache with head_dim a multiple of 8 (prefill_attention_f32.h). The caller
// keeps its torch path otherwise: `prefill_attention_supported`, `prefill_attention_f32_supported`.
// A quantized cache's rows at the sequence's slots, dequantized: out[h][pos][i] =
// float(code) * float(scale) of slot slots[pos] of KV head h (one fp32 product, the value
// kv_cache.py's dequantize_kv gives). codes: (Hkv, num_slots, D), scales (Hkv, num_slots).
template <typename C>
void dequantize_sequence(const C* codes, const c10::Half* scales, const int64_t* slots,
                         int64_t seq_len, int64_t kv_heads, int64_t num_slots, int64_t d,
                         float* out) {
  at::parallel_for(0, kv_heads * seq_len, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / seq_len, pos = task % seq_len;
      const int64_t slot = h * num_slots + slots[pos];
      const float s = static_cast<float>(scales[slot]);
      const C* row = codes + slot * d;
      float* o = out + task * d;
      int64_t i = 0;
      // widened as the decode kernel loads codes (load8 / load16: exact), then one product
#if defined(PAGEDSERVE_AVX512)
      for (; i + 16 <= d; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(load16(row + i), _mm512_set1_ps(s)));
#elif defined(PAGEDSERVE_AVX2)
      for (; i + 8 <= d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(load8(row + i), _mm256_set1_ps(s)));
#endif
      for (; i < d; ++i) o[i] = static_cast<float>(row[i]) * s;
    }
  });
}

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                torch::Tensor block_ids, int64_t context_len, double scale,
                                c10::optional<torch::Tensor> key_scale,
                                c10::optional<torch::Tensor> value_scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be (T, H, D) with dense heads");
  const bool quantized = check_kv_scales(key_cache, value_cache, key_scale, value_scale);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = key_cache.size(0), block_size = key_cache.size(2);
  torch::Tensor ids = block_ids.to(torch::kInt64).contiguous();
  TORCH_CHECK(ids.numel() * block_size >= context_len + tokens, "too few blocks");
  TORCH_CHECK(scale > 0, "the softmax scale must be positive (the running max is of raw scores)");
  torch::Tensor out = torch::empty({tokens, heads, d}, q.options());
  if (q.scalar_type() == torch::kFloat) {
#ifdef PAGEDSERVE_FLASH_F32
    TORCH_CHECK(quantized || key_cache.scalar_type() == torch::kFloat,
                "fp32 queries need an fp32 or a quantized cache");
    TORCH_CHECK(d % 8 == 0, "head_dim must be a multiple of 8");
    const int64_t seq_len = context_len + tokens;
    std::vector<int64_t> slots(seq_len);
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t pos = 0; pos < seq_len; ++pos)
      slots[pos] = id[pos / block_size] * block_size + pos % block_size;
    if (quantized) {
      // The sequence's codes dequantized once (code * scale, in fp32, as kv_cache.py's
      // dequantize_kv) into dense (Hkv, seq_len, D) keys and values, which the kernel then reads
      // at positions 0 .. seq_len: a task reads each key once per 8 query tokens, and widening a
      // code at every read cost more than the products it feeds.
      torch::Tensor keys = torch::empty({kv_heads, seq_len, d}, q.options());
      torch::Tensor values = torch::empty({kv_heads, seq_len, d}, q.options());
      const int64_t num_slots = key_cache.size(1) * block_size;
      DISPATCH_KV_CODES(key_cache.scalar_type(), "prefill_attention", [&] {
        dequantize_sequence(key_cache.data_ptr<cache_t>(), key_scale->data_ptr<c10::Half>(),
                            slots.data(), seq_len, kv_heads, num_slots, d,
                            keys.data_ptr<float>());
        dequantize_sequence(value_cache.data_ptr<cache_t>(), value_scale->data_ptr<c10::Half>(),
                            slots.data(), seq_len, kv_heads, num_slots, d,
                            values.data_ptr<float>());
      });
      std::iota(slots.begin(), slots.end(), int64_t{0});
      const F32Prefill args{q.data_ptr<float>(), q.stride(0), keys.data_ptr<float>(),
                            values.data_ptr<float>(), seq_len * d, slots.data(), context_len,
                            tokens, heads, d, static_cast<float>(scale), out.data_ptr<float>()};
      flash_prefill_f32(args, kv_heads);
      return out;
    }
    const F32Prefill args{q.data_ptr<float>(), q.stride(0), key_cache.data_ptr<float>(),
                          value_cache.data_ptr<float>(), key_cache.size(1) * block_size * d,
                          slots.data(), context_len, tokens, heads, d,
                          static_cast<float>(scale), out.data_ptr<float>()};
    flash_prefill_f32(args, kv_heads);
    return out;
#else
    TORCH_CHECK(false, "built without AVX2 and FMA");
#endif
  }
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 &&
                  (quantized || key_cache.scalar_type() == torch::kBFloat16),
              "fp32 or bf16 only");
#ifdef PAGEDSERVE_FLASH
  auto run = [&](auto dc) {
    auto run_with = [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      flash_prefill<decltype(dc)::value, C>(
          q.data_ptr<c10::BFloat16>(), q.stride(0), key_cache.data_ptr<C>(),
          value_cache.data_ptr<C>(), quantized ? key_scale->data_ptr<c10::Half>() : nullptr,
          quantized ? value_scale->data_ptr<c10::Half>() : nullptr, key_cache.size(1),
          block_size, ids.data_ptr<int64_t>(), context_len, tokens, heads, kv_heads,
          static_cast<float>(scale), out.data_ptr<c10::BFloat16>());
    };
    if (!quantized) return run_with(static_cast<c10::BFloat16*>(nullptr));
    DISPATCH_KV_CODES(key_cache.scalar_type(), "prefill_attention",
                      [&] { run_with(static_cast<cache_t*>(nullptr)); });
  };
  if (d == 64) {
    run(std::integral_constant<int, 4>());
  } else if (d == 128) {
    run(std::integral_constant<int, 8>());
  } else if (d == 256) {
    run(std::integral_constant<int, 16>());
  } else {
    TORCH_CHECK(false, "head_dim 64, 128 or 256 only");
  }
  return out;
#else
  TORCH_CHECK(false, "built without AVX512-BF16");
#endif
}

bool prefill_attention_supported() {
#ifdef PAGEDSERVE_FLASH
  return true;
#else
  return false;
#endif
}

bool prefill_attention_f32_supported() {
#ifdef PAGEDSERVE_FLASH_F32
  return true;
#else
  return false;
#endif
}

#include "amx_checks.h"

// ---------------------------------------------------------------------------------------------
// Store this step's K and V rows at their cache slots. k, v: (T, Hkv, D) views with dense heads;
// caches (Hkv, num_blocks * block_size, D) in effect. A quantized cache gets each row's codes and
// its fp16 scale at the same slot of the (Hkv, num_blocks * block_size) scales, computed exactly
// as attention/kv_cache.py quantize_kv does (same fp32 operations, same roundings: same bits).

constexpr float kScaleMin = 6.103515625e-05f;  // 2^-14, kv_cache.SCALE_MIN
constexpr float kScaleMax = 65504.f;           // kv_cache.SCALE_MAX

inline int8_t quantize_code(float x, int8_t*) {
  return static_cast<int8_t>(std::min(std::max(std::nearbyint(x), -127.f), 127.f));
}
inline c10::Float8_e4m3fn quantize_code(float x, c10::Float8_e4m3fn*) {
  return c10::Float8_e4m3fn(std::min(std::max(x, -448.f), 448.f));
}
inline c10::Half quantize_code(float x, c10::Half*) {  // rounded to nearest even, as torch
  return c10::Half(std::min(std::max(x, -1.f), 1.f));
}
inline float quant_max(int8_t*) { return 127.f; }
inline float quant_max(c10::Float8_e4m3fn*) { return 448.f; }
inline float quant_max(c10::Half*) { return 1.f; }

// One row of D values -> its codes and scale.
template <typename T, typename C>
inline void quantize_row_to(const T* x, int64_t d, C* codes, c10::Half* scale) {
  float absmax = 0.f;
  for (int64_t i = 0; i < d; ++i) absmax = std::max(absmax, std::abs(to_float(x[i])));
  const c10::Half rounded(std::min(std::max(absmax / quant_max(codes), kScaleMin), kScaleMax));
  const float s = static_cast<float>(rounded);
  for (int64_t i = 0; i < d; ++i) codes[i] = quantize_code(to_float(x[i]) / s, codes);
  *scale = rounded;
}

template <typename T, typename C>
void write_kv_quantized(C* key_cache, C* value_cache, c10::Half* key_scale, c10::Half* value_scale,
                        const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                        const int64_t* slots, int64_t num_slots, int64_t tokens, int64_t kv_heads,
                        int64_t d) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t slot = h * num_slots + slots[t];
      quantize_row_to(k + t * k_stride + h * d, d, key_cache + slot * d, key_scale + slot);
      quantize_row_to(v + t * v_stride + h * d, d, value_cache + slot * d, value_scale + slot);
    }
  }
}

void write_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_mapping, c10::optional<torch::Tensor> key_scale,
              c10::optional<torch::Tensor> value_scale) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches contiguous");
  const bool quantized = check_kv_scales(key_cache, value_cache, key_scale, value_scale);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2), "k, v must have dense heads");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), d = k.size(2);
  const int64_t slots = key_cache.numel() / (kv_heads * d);
  torch::Tensor slot = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "slot out of range");
  if (quantized) {
    TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v dtypes differ");
    DISPATCH_FLOAT_OR_BF16(k.scalar_type(), "write_kv", [&] {
      DISPATCH_KV_CODES(key_cache.scalar_type(), "write_kv", [&] {
        write_kv_quantized<scalar_t, cache_t>(
            key_cache.data_ptr<cache_t>(), value_cache.data_ptr<cache_t>(),
            key_scale->data_ptr<c10::Half>(), value_scale->data_ptr<c10::Half>(),
            k.data_ptr<scalar_t>(), k.stride(0), v.data_ptr<scalar_t>(), v.stride(0), sp, slots,
            tokens, kv_heads, d);
      });
    });
    return;
  }
  TORCH_CHECK(k.scalar_type() == key_cache.scalar_type() && v.scalar_type() == key_cache.scalar_type(),
              "k, v and cache dtypes differ");
  const int64_t elem = key_cache.element_size();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t dst = (h * slots + sp[t]) * d * elem;
      std::memcpy(kc + dst, kp + (t * k.stride(0) + h * d) * elem, d * elem);
      std::memcpy(vc + dst, vp + (t * v.stride(0) + h * d) * elem, d * elem);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The decoder layers of a Llama-family model (Llama, Qwen2) for a step of up to 32 tokens, in one
// call from Python instead of ~80 ops per layer. It runs exactly the ops the Python modules run
// on the CPU for such a step (the kernels above, in the same order and dtypes), so its output is
// bitwise equal to theirs: tests/models/test_decoder_stack.py checks that.

// A projection as Linear._linear runs it (layers/linear.py): by its packed codes (codes defined),
// or, in a layer loaded from GGUF codes in bf16, for inputs of more than packed_max_rows rows by
// torch's matmul on its weights dequantized (dequantize_linear: the dense weights' product, with
// none held); or by its dense weight (a GGUF type the codes' layout cannot hold, such as Q6_K):
// dense_rows up to dense_rows_max rows where the layer uses that kernel (0: it does not),
// F.linear otherwise.
struct StackLinear {
  torch::Tensor codes, scales, mins;
  c10::optional<torch::Tensor> bias;
  int64_t out_features, bits, activation_bits;
  bool dense_above_max_rows;
  int64_t packed_max_rows;
  c10::optional<torch::Tensor> outlier_channels, outlier_weights;
  torch::Tensor weight;  // the dense form's
  int64_t dense_rows_max = 0;

  bool dense() const { return !codes.defined(); }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (dense()) {
      if (dense_rows_max > 0 && x.dim() == 2 && x.size(0) > 0 && x.size(0) <= dense_rows_max &&
          x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16)
        return dense_rows(x, weight, bias);
      return torch::linear(x, weight, bias);
    }
    if (dense_above_max_rows && x.size(0) > packed_max_rows)  // Linear: F.linear's product
      return dequantize_linear(x, codes, scales, mins, out_features, bits, bias);
    torch::Tensor y = quant_linear(x, codes, scales, mins, out_features, bits, activation_bits,
                                   c10::nullopt, outlier_channels, outlier_weights);
    return bias ? y + *bias : y;  // as Linear.forward: the bias added in the compute dtype
  }

  // A merged gate_up layer's silu(gate) * up in one pass (quant_linear_gated), where that
  // kernel computes what silu_and_mul(*this(x)) would: codes, quantized activations, no bias.
  bool gates(const torch::Tensor& x) const {
    return !dense() && !(dense_above_max_rows && x.size(0) > packed_max_rows) &&
           activation_bits != 32 && !bias && out_features % 32 == 0;
  }
  torch::Tensor gated(const torch::Tensor& x, Gate gating) const {
    return quant_linear_product(x, codes, scales, mins, out_features, bits, activation_bits,
                                c10::nullopt, outlier_channels, outlier_weights, gating);
  }
};

// A layer's weights. Llama's block: input_norm before attention, post_attention_norm fused with
// the residual add before the MLP. Gemma 3's (`sandwich`): post_attention_norm and
// post_feedforward_norm on the attention's and the MLP's outputs, pre_feedforward_norm fused
// with the residual add before the MLP; q_norm and k_norm (QK-norm) on each head after the
// projection. cos / sin: the layer's rotary tables (Gemma's local layers rotate with their own).
struct DecoderLayerWeights {
  torch::Tensor input_norm, post_attention_norm;
  StackLinear qkv, o, gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm, pre_feedforward_norm, post_feedforward_norm;
  torch::Tensor cos, sin;

  bool sandwich() const { return pre_feedforward_norm.has_value(); }
};

// A step's LoRA adapters in the masked form (pagedserve/lora/layers.py): per layer and linear
// (qkv, o, gate_up, down) the slots' stacked A (slots * width, in) and transposed B
// (slots * width, out); per linear kind the (T, slots * width) mask of each token's own slot.
// y += ((x A^T) * mask) B, the ops and order of LoRAStep.add_delta: bitwise the same.
struct StepLoRA {
  const std::vector<torch::Tensor>& factors;
  const std::vector<torch::Tensor>& masks;

  bool active() const { return !factors.empty(); }

  torch::Tensor add(torch::Tensor y, const torch::Tensor& x, int64_t layer, int64_t kind) const {
    if (!active()) return y;
    const torch::Tensor& a = factors[(layer * 4 + kind) * 2];
    const torch::Tensor& b = factors[(layer * 4 + kind) * 2 + 1];
    return y.add_(torch::matmul(torch::linear(x, a) * masks[kind], b));
  }
};

class DecoderStack {
 public:
  // scale: the attention scores' (1 / sqrt(head_dim) for Llama); unit_offset: Gemma's norms
  // (add_rms_norm); activation: the MLP's gating, "silu" or "gelu_tanh".
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               torch::Tensor final_norm, double scale, bool unit_offset, std::string activation)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        final_norm_(final_norm), scale_(scale), unit_offset_(unit_offset),
        gating_(gate_named(activation)) {}

  // linears: (codes, scales, mins, bias or None, out_features, bits, activation_bits,
  // dense_above_max_rows, packed_max_rows, outlier_channels or None, outlier_weights or None)
  // each, or a dense one: (weight, bias or None, dense_rows_max). cos / sin: the layer's rotary
  // tables; q_norm, k_norm: its QK-norm (or None); pre / post_feedforward_norm: Gemma's sandwich
  // norms (both or neither).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm,
                 const std::vector<py::tuple>& linears, torch::Tensor cos, torch::Tensor sin,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                 c10::optional<torch::Tensor> pre_feedforward_norm,
                 c10::optional<torch::Tensor> post_feedforward_norm) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "QK-norm needs both weights");
    TORCH_CHECK(pre_feedforward_norm.has_value() == post_feedforward_norm.has_value(),
                "the sandwich form needs both feed-forward norms");
    TORCH_CHECK(linears.size() == 4, "qkv, o, gate_up, down");
    std::vector<StackLinear> parsed;
    for (const auto& l : linears) {
      auto optional_tensor = [&](int i) -> c10::optional<torch::Tensor> {
        if (l[i].is_none()) return c10::nullopt;
        return l[i].cast<torch::Tensor>();
      };
      if (l.size() == 3) {
        StackLinear dense{};
        dense.weight = l[0].cast<torch::Tensor>();
        dense.bias = optional_tensor(1);
        dense.out_features = dense.weight.size(0);
        dense.dense_rows_max = l[2].cast<int64_t>();
        parsed.push_back(dense);
        continue;
      }
      TORCH_CHECK(l.size() == 11, "a packed linear is 11 fields, a dense one 3");
      const c10::optional<torch::Tensor> bias = optional_tensor(3);
      parsed.push_back(StackLinear{l[0].cast<torch::Tensor>(), l[1].cast<torch::Tensor>(),
                                    l[2].cast<torch::Tensor>(), bias, l[4].cast<int64_t>(),
                                    l[5].cast<int64_t>(), l[6].cast<int64_t>(),
                                    l[7].cast<bool>(), l[8].cast<int64_t>(),
                                    optional_tensor(9), optional_tensor(10)});
    }
    layers_.push_back(DecoderLayerWeights{input_norm, post_attention_norm, parsed[0], parsed[1],
                                          parsed[2], parsed[3], q_norm, k_norm,
                                          pre_feedforward_norm, post_feedforward_norm, cos, sin});
  }

  // hidden: (T, hidden) embeddings; kv_caches: per layer (key, value), or (key, value,
  // key_scale, value_scale) for a quantized cache. Layer i reads and writes its KV cache group's
  // slots: group layer_groups[i] (empty: 0 for every layer), whose slot mapping and block table
  // are slot_mappings[g] and block_tables[g]. Every token t reads positions [0, seq_lens[t]) of
  // block-table row block_rows[t]. Returns the final-normed hidden states after the first
  // num_layers layers. lora_factors, lora_masks: see StepLoRA (empty: none).
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor positions,
                        const std::vector<std::vector<torch::Tensor>>& kv_caches,
                        const std::vector<torch::Tensor>& slot_mappings,
                        const std::vector<torch::Tensor>& block_tables,
                        const std::vector<int64_t>& layer_groups, torch::Tensor block_rows,
                        torch::Tensor seq_lens, int64_t num_layers,
                        const std::vector<torch::Tensor>& lora_factors,
                        const std::vector<torch::Tensor>& lora_masks) {
    const StepLoRA lora{lora_factors, lora_masks};
    TORCH_CHECK(!lora.active() || (lora_masks.size() == 4 &&
                                   static_cast<int64_t>(lora_factors.size()) >= num_layers * 8),
                "LoRA: 4 masks and (A, B) per linear of every layer run");
    TORCH_CHECK(!slot_mappings.empty() && slot_mappings.size() == block_tables.size(),
                "a slot mapping and a block table per KV cache group");
    TORCH_CHECK(layer_groups.empty() || static_cast<int64_t>(layer_groups.size()) >= num_layers,
                "a KV cache group per layer");
    const int64_t tokens = hidden.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    TORCH_CHECK(num_layers <= static_cast<int64_t>(layers_.size()), "too many layers");
    c10::optional<torch::Tensor> residual;
    torch::Tensor x = hidden;
    // norm(x + residual) (residual: the stream, None for a norm of x alone), as RMSNorm.forward
    auto norm = [&](const torch::Tensor& value, const c10::optional<torch::Tensor>& stream,
                    const torch::Tensor& weight) {
      return add_rms_norm(value, stream, weight, eps_, unit_offset_);
    };
    for (int64_t i = 0; i < num_layers; ++i) {
      const DecoderLayerWeights& layer = layers_[i];
      const int64_t group = layer_groups.empty() ? 0 : layer_groups[i];
      TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(slot_mappings.size()),
                  "KV cache group out of range");
      auto normed = norm(x, residual, layer.input_norm);
      residual = normed[1];
      torch::Tensor qkv = lora.add(layer.qkv(normed[0]), normed[0], i, 0);
      if (layer.q_norm)
        rms_norm_heads_inplace(qkv, num_heads_, num_kv_heads_, *layer.q_norm, *layer.k_norm, eps_,
                               unit_offset_);
      rotary_inplace(qkv, num_heads_ + num_kv_heads_, head_dim_, positions, layer.cos, layer.sin);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
      torch::Tensor v =
          qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
      const auto& cache = kv_caches[i];
      TORCH_CHECK(cache.size() == 2 || cache.size() == 4, "a layer's KV cache has 2 or 4 tensors");
      c10::optional<torch::Tensor> key_scale, value_scale;
      if (cache.size() == 4) key_scale = cache[2], value_scale = cache[3];
      write_kv(cache[0], cache[1], k, v, slot_mappings[group], key_scale, value_scale);
      torch::Tensor attn = paged_attention(q, cache[0], cache[1], block_tables[group], block_rows,
                                           seq_lens, scale_, key_scale, value_scale);
      torch::Tensor attn_rows = attn.view({tokens, q_size});
      x = lora.add(layer.o(attn_rows), attn_rows, i, 1);
      if (layer.sandwich()) {
        x = norm(x, c10::nullopt, layer.post_attention_norm)[0];
        normed = norm(x, residual, *layer.pre_feedforward_norm);
      } else {
        normed = norm(x, residual, layer.post_attention_norm);
      }
      residual = normed[1];
      // LoRA's delta joins the gate_up product before the activation: two steps then
      torch::Tensor activated =
          !lora.active() && layer.gate_up.gates(normed[0])
              ? layer.gate_up.gated(normed[0], gating_)
              : gate_and_mul(lora.add(layer.gate_up(normed[0]), normed[0], i, 2), gating_);
      x = lora.add(layer.down(activated), activated, i, 3);
      if (layer.sandwich()) x = norm(x, c10::nullopt, *layer.post_feedforward_norm)[0];
    }
    return norm(x, residual, final_norm_)[0];
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  torch::Tensor final_norm_;
  double scale_;
  bool unit_offset_;
  Gate gating_;
  std::vector<DecoderLayerWeights> layers_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// The machine's limits for `pagedserve bench peak`: every thread runs `iterations` x 12
// independent instructions of one kind (the int8 dot product, the bf16 one, the fp32 FMA, in
// the widest registers this build has), registers only, enough chains to hide their latency.
// Returns the wall seconds; the caller divides the work by them.
namespace peak {
volatile float sink_value;

// `iterations` x 12 independent `step`s, in registers (the empty asm keeps the chains live and
// apart); returns one chain for the caller to sink.
template <typename V, typename Step>
inline V twelve_chains(V start, int64_t iterations, Step step) {
  V a0 = start, a1 = start, a2 = start, a3 = start, a4 = start, a5 = start, a6 = start,
    a7 = start, a8 = start, a9 = start, a10 = start, a11 = start;
  for (int64_t i = 0; i < iterations; ++i) {
    a0 = step(a0), a1 = step(a1), a2 = step(a2), a3 = step(a3), a4 = step(a4), a5 = step(a5);
    a6 = step(a6), a7 = step(a7), a8 = step(a8), a9 = step(a9), a10 = step(a10), a11 = step(a11);
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),
                     "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
  return a0;
}

// Runs `kind` (peak_seconds checks first that this build has it).
inline void run(const std::string& kind, int64_t iterations) {
#if defined(PAGEDSERVE_VNNI)
  if (kind == "int8") {
    const __m512i w = _mm512_set1_epi32(0x01010101), v = _mm512_set1_epi32(0x02020202);
    const __m512i a = twelve_chains(_mm512_setzero_si512(), iterations,
                                    [&](__m512i x) { return _mm512_dpbusd_epi32(x, w, v); });
    sink_value = static_cast<float>(_mm512_reduce_add_epi32(a));
    return;
  }
#endif
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
  if (kind == "bf16") {
    const __m512bh w = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    const __m512 a = twelve_chains(_mm512_setzero_ps(), iterations,
                                   [&](__m512 x) { return _mm512_dpbf16_ps(x, w, w); });
    sink_value = _mm512_reduce_add_ps(a);
    return;
  }
#endif
#if defined(PAGEDSERVE_AVX512)
  if (kind == "fp32") {
    const __m512 x = _mm512_set1_ps(0.5f), y = _mm512_set1_ps(0.25f);
    const __m512 a = twelve_chains(_mm512_setzero_ps(), iterations,
                                   [&](__m512 c) { return _mm512_fmadd_ps(c, x, y); });
    sink_value = _mm512_reduce_add_ps(a);
    return;
  }
#elif defined(PAGEDSERVE_AVX2)
  if (kind == "fp32") {
    const __m256 x = _mm256_set1_ps(0.5f), y = _mm256_set1_ps(0.25f);
    const __m256 a = twelve_chains(_mm256_setzero_ps(), iterations,
                                   [&](__m256 c) { return _mm256_fmadd_ps(c, x, y); });
    sink_value = reduce_add8(a);
    return;
  }
#endif
  (void)iterations;
}
}  // namespace peak

// Multiply-accumulates per instruction of each kind `peak_seconds` runs, in this build (the
// kinds it lacks are absent).
std::map<std::string, int64_t> peak_kinds() {
  std::map<std::string, int64_t> kinds;
#if defined(PAGEDSERVE_VNNI)
  kinds["int8"] = 64;
#endif
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
  kinds["bf16"] = 32;
#endif
#if defined(PAGEDSERVE_AVX512)
  kinds["fp32"] = 16;
#elif defined(PAGEDSERVE_AVX2)
  kinds["fp32"] = 8;
#endif
  return kinds;
}

double peak_seconds(const std::string& kind, int64_t iterations) {
  TORCH_CHECK(peak_kinds().count(kind), "this build has no peak loop for '", kind, "'");
  const int64_t threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) peak::run(kind, iterations);
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The compute functions release the GIL while they run (their arguments are converted before,
// their results after): the server's event loop (SSE, JSON, detokenizing) then runs on the other
// core during a step instead of waiting for its end. None of them touches a Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("SOURCE_HASH") = PAGEDSERVE_STRINGIFY(PAGEDSERVE_SOURCE_HASH);
  m.attr("BUILD_ISA") = pagedserve_build_isa();
  m.def("quant_linear", &quant_linear,
        "x @ W^T: GGUF-form 4/5/8-bit weights; int16/int8 activations, or fp32 exactly (32)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("mins"), py::arg("n"),
        py::arg("bits"), py::arg("activation_bits"), py::arg("bias") = py::none(),
        py::arg("outlier_channels") = py::none(), py::arg("outlier_weights") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear_gated", &quant_linear_gated,
        "act(gate) * up of a merged gate_up layer's quant_linear, in one pass: bitwise "
        "silu_and_mul or gelu_tanh_and_mul of the product (quantized activations, no bias, "
        "N / 2 a multiple of 16)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("mins"), py::arg("n"),
        py::arg("bits"), py::arg("activation_bits"), py::arg("activation"),
        py::arg("outlier_channels") = py::none(), py::arg("outlier_weights") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("set_tiles", &set_tiles,
        "the int8 matmul (16+ rows) and the bf16 flash prefill on AMX tiles ('amx', after each "
        "kernel's check against its AVX-512 form), on the instructions' model ('model', tests), "
        "or not ('off'); returns why not ('' when in force)",
        py::arg("mode"), py::call_guard<py::gil_scoped_release>());
  m.def("tiles", &tiles, "the tiles in force: 'amx', 'model' or 'off'");
  m.def("amx_unavailable_reason", &amx_unavailable_reason,
        "why this process cannot run AMX tiles at all ('' where the CPU and Linux allow them)");
  m.def("tile_call_counts", &tile_call_counts,
        "calls run on tiles (hardware or model) in this process, per kernel");
  m.def("tile_product", &tile_product,
        "one tile product as the kernels configure it (kind int8 or bf16), on the hardware or "
        "the model",
        py::arg("a"), py::arg("b"), py::arg("kind"), py::arg("hardware"),
        py::call_guard<py::gil_scoped_release>());
  m.def("peak_kinds", &peak_kinds,
        "the instruction kinds peak_seconds runs in this build, and multiply-adds per instruction");
  m.def("peak_seconds", &peak_seconds,
        "wall seconds for every thread to run iterations x 12 independent instructions of a kind",
        py::arg("kind"), py::arg("iterations"), py::call_guard<py::gil_scoped_release>());
  m.def("dense_rows", &dense_rows,
        "x @ W^T (+ bias) for 1 to 4 bf16 rows and a dense bf16 W (AVX512-BF16)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("dense_rows_supported", &dense_rows_supported);
  m.def("exact_linear_vectorized", &exact_linear_vectorized,
        "whether quant_linear's fp32 path (activation_bits 32) is vectorized in this build");
  m.def("integer_linear_vectorized", &integer_linear_vectorized,
        "whether quant_linear's integer paths (activation_bits 16, 8) are vectorized in this build");
  m.def("pack_codes", &pack_codes, "GGUF codes (N, K), one per byte -> quant_linear's layout");
  m.def("dequantize_codes", &dequantize_codes,
        "quant_linear's layout -> dense (N, K) rows, written into out",
        py::call_guard<py::gil_scoped_release>());
  m.def("embedding_from_codes", &embedding_from_codes,
        "rows of quant_linear's layout as dense rows (T, K): an embedding lookup on the codes",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_linear", &dequantize_linear,
        "x @ W^T (+ bias) by torch's matmul on W dequantized from quant_linear's layout, by panels",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("mins"), py::arg("n"),
        py::arg("bits"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "RMSNorm after an optional residual add",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::arg("unit_offset") = false, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_heads_inplace", &rms_norm_heads_inplace,
        "QK-norm: RMSNorm of each q and k head of a qkv projection, in place",
        py::arg("qkv"), py::arg("q_heads"), py::arg("k_heads"), py::arg("q_weight"),
        py::arg("k_weight"), py::arg("eps"), py::arg("unit_offset") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_inplace", &rotary_inplace, "rotary embedding on q and k in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up",
        py::call_guard<py::gil_scoped_release>());
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu(gate, approximate='tanh') * up",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of (rows, V) logits",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "attention reading the paged cache in place",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("block_rows"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("key_scale") = py::none(), py::arg("value_scale") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "store K/V rows (quantized: codes and scales) at their cache slots",
        py::arg("key_cache"), py::arg("value_cache"), py::arg("k"), py::arg("v"),
        py::arg("slot_mapping"), py::arg("key_scale") = py::none(),
        py::arg("value_scale") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention", &prefill_attention, "one request's prefill chunk, flash-style",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_ids"),
        py::arg("context_len"), py::arg("scale"), py::arg("key_scale") = py::none(),
        py::arg("value_scale") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_supported", &prefill_attention_supported);
  m.def("prefill_attention_f32_supported", &prefill_attention_f32_supported);
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, double, torch::Tensor, double, bool,
                    std::string>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
}
