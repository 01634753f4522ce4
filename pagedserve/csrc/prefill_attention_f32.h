// Prefill attention in fp32 on 8-wide registers (AVX2 + FMA): one request's chunk of query
// tokens against its paged cache, causal. Included by cpu_ops.cpp inside its anonymous namespace
// (it uses exp256); cpu_ops.cpp's prefill_attention calls flash_prefill_f32 for fp32 queries on a
// plain fp32 cache.
//
// A task is 8 consecutive query tokens (one register's lanes) x up to 3 query heads of one KV
// head. Its queries are transposed once, qt[head][dim][token], so that one broadcast key value
// times one qt vector scores 8 tokens at once, and the softmax over keys is lane-wise: the max,
// the exponentials and the sums of 8 rows take one vector operation each, no horizontal
// reductions. Keys and values are read in place from the cache rows (head-major blocks of
// contiguous D-float rows); nothing is gathered or repacked.
//   1. scores[key][head][token]: a 4 keys x 3 heads register tile (12 accumulators) per pass
//      over the dims;
//   2. the causal mask on the last keys (key context + t0 + j is hidden from lanes < j), the
//      exact softmax: max, exp, sum over every key the block sees;
//   3. out^T[head][dim][token] += value[key][dim] * probs[key][head][token], 64 keys at a time
//      (their value rows and probabilities stay in L1), a 3 heads x 4 dims register tile;
//   4. out = out^T / sum, transposed back.
// fp32 throughout; the sums run in another order than the torch paths (SDPA, the blocked
// matmuls) take, so results agree to rounding, not to the bit. A request's result depends on its
// own chunk alone (the tasks never mix requests): the same bits alone as in any batch.

#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDSERVE_FLASH_F32 1

constexpr int64_t kF32Lanes = 8;         // query tokens per task
constexpr int64_t kF32MaxTileHeads = 3;  // query heads per task
constexpr int64_t kF32ValueSlice = 64;   // keys per pass of the value product

// scores[r][t][lane] = sum_i krows[r][i] * qt[t][i][lane] for R keys and T heads.
template <int T, int R>
inline void score_keys(const float* const* krows, const float* qt, int64_t d, float* scores) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m256 qv[T];
    for (int t = 0; t < T; ++t) qv[t] = _mm256_loadu_ps(qt + (t * d + i) * kF32Lanes);
    for (int r = 0; r < R; ++r) {
      const __m256 k = _mm256_broadcast_ss(krows[r] + i);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(k, qv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(scores + (r * T + t) * kF32Lanes, acc[r][t]);
}

// r[j] lane l <- r[l] lane j: an 8 x 8 block of floats transposed in registers (a task's query
// tokens sit in lanes, the cache's rows and the output's in memory order).
inline void transpose8x8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

struct F32Prefill {
  const float* q;  // (tokens, heads, d) rows q_token_stride apart
  int64_t q_token_stride;
  const float* key_cache;  // (Hkv, num_blocks, block_size, d)
  const float* value_cache;
  int64_t head_stride;   // num_blocks * block_size * d
  const int64_t* slots;  // cache slot of each position 0 .. context_len + tokens
  int64_t context_len, tokens, heads, d;
  float scale;
  float* out;  // (tokens, heads, d)
};

// Floats of scratch a task needs: qt and out^T (T x d x 8 each), scores (keys x T x 8).
inline int64_t f32_task_floats(int64_t d, int64_t keys) {
  return (2 * d + keys) * kF32MaxTileHeads * kF32Lanes;
}

// Tokens t0 .. t0 + 8 (fewer at the chunk's end) x query heads head0 .. head0 + T of KV head h.
template <int T>
void attend_f32_block(const F32Prefill& a, int64_t h, int64_t head0, int64_t t0, float* scratch) {
  constexpr int R = T == 3 ? 4 : T == 2 ? 6 : 8;  // 12, 12 or 8 accumulators
  constexpr int DV = T == 1 ? 8 : 4;  // value dims per pass: 12, 8 or 8 accumulators
  const int64_t d = a.d, n = std::min(kF32Lanes, a.tokens - t0);
  const int64_t diag = a.context_len + t0;  // lane i sees keys 0 .. diag + i
  const int64_t keys = diag + n;
  float* qt = scratch;
  float* out_t = qt + T * d * kF32Lanes;
  float* scores = out_t + T * d * kF32Lanes;
  // qt: 8 dims of the 8 tokens at a time, transposed in registers (lanes past the chunk: zero
  // queries, never stored)
  const __m256 scale_v = _mm256_set1_ps(a.scale);
  for (int t = 0; t < T; ++t) {
    for (int64_t i0 = 0; i0 < d; i0 += 8) {
      __m256 r[8];
      for (int64_t lane = 0; lane < kF32Lanes; ++lane) {
        r[lane] = lane < n ? _mm256_mul_ps(_mm256_loadu_ps(a.q + (t0 + lane) * a.q_token_stride +
                                                           (head0 + t) * d + i0),
                                           scale_v)
                           : _mm256_setzero_ps();
      }
      transpose8x8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(qt + (t * d + i0 + j) * kF32Lanes, r[j]);
    }
  }
  const float* key_head = a.key_cache + h * a.head_stride;
  const float* krows[R];
  int64_t k = 0;
  for (; k + R <= keys; k += R) {
    for (int r = 0; r < R; ++r) krows[r] = key_head + a.slots[k + r] * d;
    score_keys<T, R>(krows, qt, d, scores + k * T * kF32Lanes);
  }
  for (; k < keys; ++k) {
    krows[0] = key_head + a.slots[k] * d;
    score_keys<T, 1>(krows, qt, d, scores + k * T * kF32Lanes);
  }
  // Causal: key diag + j is hidden from lanes 0 .. j - 1.
  const __m256 lane_index = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 1; j < n; ++j) {
    const __m256 hidden = _mm256_cmp_ps(lane_index, _mm256_set1_ps(static_cast<float>(j)), _CMP_LT_OQ);
    for (int t = 0; t < T; ++t) {
      float* s = scores + ((diag + j) * T + t) * kF32Lanes;
      _mm256_storeu_ps(s, _mm256_blendv_ps(_mm256_loadu_ps(s), minus_inf, hidden));
    }
  }
  __m256 row_max[T], row_sum[T];
  for (int t = 0; t < T; ++t) row_max[t] = minus_inf, row_sum[t] = _mm256_setzero_ps();
  for (int64_t key = 0; key < keys; ++key)
    for (int t = 0; t < T; ++t)
      row_max[t] = _mm256_max_ps(row_max[t], _mm256_loadu_ps(scores + (key * T + t) * kF32Lanes));
  // Keys 0 .. diag are seen by every lane; past them exp256's floor (exp(-87), not 0) would
  // leave hidden keys a tiny weight, so their probabilities are zeroed explicitly.
  for (int64_t key = 0; key < keys; ++key) {
    for (int t = 0; t < T; ++t) {
      float* s = scores + (key * T + t) * kF32Lanes;
      const __m256 x = _mm256_loadu_ps(s);
      __m256 p = exp256(_mm256_sub_ps(x, row_max[t]));
      if (key > diag) p = _mm256_andnot_ps(_mm256_cmp_ps(x, minus_inf, _CMP_EQ_OQ), p);
      row_sum[t] = _mm256_add_ps(row_sum[t], p);
      _mm256_storeu_ps(s, p);
    }
  }
  const float* value_head = a.value_cache + h * a.head_stride;
  for (int64_t first = 0; first < keys; first += kF32ValueSlice) {
    const int64_t last = std::min(keys, first + kF32ValueSlice);
    for (int64_t i0 = 0; i0 < d; i0 += DV) {
      __m256 acc[T][DV];
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < DV; ++j)
          acc[t][j] = first == 0 ? _mm256_setzero_ps()
                                 : _mm256_loadu_ps(out_t + (t * d + i0 + j) * kF32Lanes);
      for (int64_t key = first; key < last; ++key) {
        const float* v = value_head + a.slots[key] * d + i0;
        const float* p = scores + key * T * kF32Lanes;
        __m256 probs[T];
        for (int t = 0; t < T; ++t) probs[t] = _mm256_loadu_ps(p + t * kF32Lanes);
        for (int j = 0; j < DV; ++j) {
          const __m256 value = _mm256_broadcast_ss(v + j);
          for (int t = 0; t < T; ++t) acc[t][j] = _mm256_fmadd_ps(value, probs[t], acc[t][j]);
        }
      }
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < DV; ++j) _mm256_storeu_ps(out_t + (t * d + i0 + j) * kF32Lanes, acc[t][j]);
    }
  }
  // out: 8 dims of the 8 tokens at a time, transposed back in registers (one store per token
  // row, where a float per lane and dim read back a vector just stored)
  for (int t = 0; t < T; ++t) {
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), row_sum[t]);
    for (int64_t i0 = 0; i0 < d; i0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j)
        r[j] = _mm256_mul_ps(_mm256_loadu_ps(out_t + (t * d + i0 + j) * kF32Lanes), inv);
      transpose8x8(r);
      for (int64_t lane = 0; lane < n; ++lane)
        _mm256_storeu_ps(a.out + ((t0 + lane) * a.heads + head0 + t) * d + i0, r[lane]);
    }
  }
}

// The whole chunk: tasks (KV head, head tile, block of 8 tokens). A later block sees more keys,
// so each KV head's blocks are dealt from both ends: any contiguous run of tasks (a thread's
// share) holds early and late blocks alike.
inline void flash_prefill_f32(const F32Prefill& a, int64_t kv_heads) {
  const int64_t group = a.heads / kv_heads;
  std::vector<std::pair<int64_t, int>> tiles;  // (first head within the group, heads)
  for (int64_t g = 0; g < group;) {
    const int64_t left = group - g;
    const int take = left == 4 ? 2 : static_cast<int>(std::min(left, kF32MaxTileHeads));
    tiles.emplace_back(g, take);
    g += take;
  }
  const int64_t blocks = (a.tokens + kF32Lanes - 1) / kF32Lanes;
  const int64_t per_head = static_cast<int64_t>(tiles.size()) * blocks;
  at::parallel_for(0, kv_heads * per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(f32_task_floats(a.d, a.context_len + a.tokens));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / per_head, rest = task % per_head;
      const auto [g0, take] = tiles[rest / blocks];
      const int64_t k = rest % blocks;
      const int64_t block = k % 2 == 0 ? k / 2 : blocks - 1 - k / 2;
      const int64_t head0 = h * group + g0, t0 = block * kF32Lanes;
      if (take == 3) attend_f32_block<3>(a, h, head0, t0, scratch.data());
      if (take == 2) attend_f32_block<2>(a, h, head0, t0, scratch.data());
      if (take == 1) attend_f32_block<1>(a, h, head0, t0, scratch.data());
    }
  });
}
#endif
