// The bf16 flash prefill's products on AMX tiles (amx_tiles.h). Included by cpu_ops.cpp inside its
// anonymous namespace, after the AVX512-BF16 flash kernel whose layouts and softmax it shares;
// flash_prefill runs it when the tiles are on (set_tiles).
//
// A pass takes 16 query rows (16 consecutive tokens of one query head, copied into a padded
// buffer) over their KV head's keys, 32 keys per softmax step:
//   scores (tiles 0, 1: 16 rows x 16 keys, fp32) = queries (tile 6: 16 rows x 32 dims, bf16) .
//     keys (tile 7: kt's words, 16 dim pairs x 16 keys), summed over the head's dims 32 at a time;
//   the scores stored, and flash_weights' softmax on them row by row (the AVX-512 kernel's
//     running max, rescales, exponentials and bf16 probabilities);
//   the step's value product (tiles 2-5: 16 rows x 16 dims each, fp32) = probabilities (tile 6:
//     16 rows x 32 keys, bf16) . values (tile 7: vt's words, 16 key pairs x 16 dims), 64 dims at
//     a time, stored and added to the rows' accumulators (fp32, in L1).
// kt and vt are flash_prefill's tile layouts, which are already the tiles' operand order (pairs
// of bf16 along the summed dimension); they hold whole 32-key steps here (zeros past the keys).
// The products sum in another order than the AVX-512 kernel's dot chains, so the two agree to
// rounding, not to the bit; a row's result depends on its own query and keys alone (its tile's
// other rows never meet it), so a token gets the same bits in any chunk.

#ifdef PAGEDSERVE_FLASH
#define PAGEDSERVE_AMX_FLASH 1

constexpr int64_t kFlashTileRows = 16;
std::atomic<int64_t> flash_tile_passes{0};  // calls of flash_prefill on tiles (hardware or model)

inline TileConfig flash_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kFlashTileRows;
  return config;
}

// 16 query rows (q: [16][kD] bf16; row r sees visible[r] >= 1 keys) against one KV head's kt,
// vt: out[r] (fp32, [16][kD]) = the rows' attention outputs. The tiles configured with
// flash_tile_config.
template <typename Tiles, int DC>
void flash_tile_rows(const c10::BFloat16* q, const int64_t* visible, const uint32_t* kt,
                     const uint32_t* vt, float scale, float* out) {
  constexpr int kRows = kFlashTileRows;
  constexpr int64_t kD = DC * 16, kPairs = kD / 2, kStep = kKeyTile * kTilesPerStep;
  static_assert(kTilesPerStep == 2 && DC % 4 == 0, "two score tiles, whole 64-dim groups");
  alignas(64) float acc[kRows][kD];
  alignas(64) float scores[kTilesPerStep][kRows][kKeyTile];
  alignas(64) float step_out[kRows][64];
  alignas(64) uint32_t pairs[kRows][kStep / 2];
  __m512 total[kRows];
  float running_max[kRows];
  const int64_t most = start_softmax<kRows>(visible, running_max, total);
  for (int r = 0; r < kRows; ++r) std::fill(acc[r], acc[r] + kD, 0.f);
  const float log2_scale = scale * 1.4426950408889634f;
  for (int64_t first = 0; first < most; first += kStep) {
    const int64_t tiles = step_key_tiles(most, first);
    const uint32_t* kt_step = kt + (first / kKeyTile) * kPairs * kKeyTile;
    Tiles::template zero<0>();
    Tiles::template zero<1>();
    for (int64_t c = 0; c < kD / 32; ++c) {  // 32 dims (16 pairs) per product
      Tiles::template load<6>(q + 32 * c, kD * 2);
      Tiles::template load<7>(kt_step + 16 * c * kKeyTile, 64);
      Tiles::template dot_bf16<0, 6, 7>();
      Tiles::template load<7>(kt_step + (kPairs + 16 * c) * kKeyTile, 64);
      Tiles::template dot_bf16<1, 6, 7>();
    }
    Tiles::template store<0>(&scores[0][0][0], 64);
    Tiles::template store<1>(&scores[1][0][0], 64);
    __m512 s[kRows][kTilesPerStep];
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kTilesPerStep; ++j) s[r][j] = _mm512_load_ps(scores[j][r]);
    if (tiles < kTilesPerStep) {  // flash_weights leaves the missing tile's probabilities
      for (int r = 0; r < kRows; ++r) std::fill(pairs[r] + kKeyTile / 2, pairs[r] + kStep / 2, 0u);
    }
    flash_weights<kRows>(s, visible, first, tiles, log2_scale, running_max, total, pairs,
                         [&](int r, __m512 alpha_v) {
                           for (int64_t i = 0; i < kD; i += 16)
                             _mm512_store_ps(acc[r] + i,
                                             _mm512_mul_ps(_mm512_load_ps(acc[r] + i), alpha_v));
                         });
    Tiles::template load<6>(&pairs[0][0], 64);
    const uint32_t* vt_step = vt + (first / 2) * kD;
    for (int64_t g = 0; g < kD; g += 64) {  // 64 dims: four product tiles
      Tiles::template zero<2>();
      Tiles::template zero<3>();
      Tiles::template zero<4>();
      Tiles::template zero<5>();
      Tiles::template load<7>(vt_step + g, kD * 4);
      Tiles::template dot_bf16<2, 6, 7>();
      Tiles::template load<7>(vt_step + g + 16, kD * 4);
      Tiles::template dot_bf16<3, 6, 7>();
      Tiles::template load<7>(vt_step + g + 32, kD * 4);
      Tiles::template dot_bf16<4, 6, 7>();
      Tiles::template load<7>(vt_step + g + 48, kD * 4);
      Tiles::template dot_bf16<5, 6, 7>();
      Tiles::template store<2>(&step_out[0][0], 64 * 4);
      Tiles::template store<3>(&step_out[0][16], 64 * 4);
      Tiles::template store<4>(&step_out[0][32], 64 * 4);
      Tiles::template store<5>(&step_out[0][48], 64 * 4);
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < 64; i += 16)
          _mm512_store_ps(acc[r] + g + i, _mm512_add_ps(_mm512_load_ps(acc[r] + g + i),
                                                        _mm512_load_ps(step_out[r] + i)));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total[r]));
    for (int64_t i = 0; i < kD; i += 16)
      _mm512_store_ps(out + r * kD + i, _mm512_mul_ps(_mm512_load_ps(acc[r] + i), inv));
  }
}

#endif  // PAGEDSERVE_FLASH
