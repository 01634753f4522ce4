// The int8 matmul's integer sums on AMX tiles (amx_tiles.h). Included by cpu_ops.cpp inside its
// anonymous namespace; quant_linear_impl runs amx_block in place of vnni_block for tiles of 16
// activation rows when the tiles are on (set_tiles).
//
// One TDPBSUD multiplies a tile of 16 activation rows by one 32-element group of a column block:
//   sums[m][n] += sum_k a[m][k] * b[k / 4][4n + k % 4],  a signed bytes, b unsigned bytes,
// a = the rows' int8 codes of the group ([row][32], the activation layout with 16-row tiles),
// b = the column block's codes as bytes in VNNI order ([element / 4][column][element % 4], the
// weight layout's own order; 4- and 5-bit codes widened once per block and chunk of rows by
// widen_to_bytes). The integer sums are exact and equal vnni_block's, and the float epilogue
// below is vnni_block's, step for step: every output bit is the VNNI kernel's.

constexpr int64_t kTileRows = 16;  // activation rows per tile (a tile register's rows)
// Fewer rows than a tile: vnni_block (a padded tile would multiply mostly zeros). Not yet
// measured on an AMX machine; the row count where the tiles start to pay belongs there.
constexpr int64_t kTileMinRows = kTileRows;
std::atomic<int64_t> int8_tile_products{0};  // int8 products run on tiles (hardware or model)

#ifdef PAGEDSERVE_VNNI
#define PAGEDSERVE_AMX_INT8 1

constexpr int kTileGroups = 4;  // groups whose sums are in flight at once (sum tiles 0-3)

// Tiles 0-3: int32 sums, 16 rows x 16 columns; 4-5: activations, 16 rows x 32 bytes (one group);
// 6-7: weights, 8 rows (32 elements / 4) x 64 bytes (16 columns x 4 bytes). Slot j (0..3) of the
// groups in flight: sums in tile j, activations in tile 4 + j % 2, weights in tile 6 + j % 2.
inline TileConfig int8_tile_config() {
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.colsb[t] = 64, config.rows[t] = kTileRows;
  for (int t = 4; t < 6; ++t) config.colsb[t] = kGroup, config.rows[t] = kTileRows;
  for (int t = 6; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kGroup / 4;
  return config;
}

// f(std::integral_constant<int, j>) for j = 0 .. count - 1 (count <= kTileGroups): the tile
// numbers must be constants.
template <typename F>
inline void for_each_slot(int count, F f) {
  if (count > 0) f(std::integral_constant<int, 0>{});
  if (count > 1) f(std::integral_constant<int, 1>{});
  if (count > 2) f(std::integral_constant<int, 2>{});
  if (count > 3) f(std::integral_constant<int, 3>{});
}

// One column block times a tile of 16 activation rows: out[r][0..15] (fp32), vnni_block's values.
// weights: the block's codes as bytes, [group][8][64]; xq: the tile's codes [group][16][32];
// dx, xsum: [group][16]. The tiles configured with int8_tile_config.
template <typename Tiles, typename S>
inline void amx_block(const uint8_t* weights, const S* scales, const S* mins, int64_t groups,
                      const int8_t* xq, const float* dx, const float* xsum, float* out) {
  static_assert(kTileRows == 16 && kGroup == 32, "one tile of rows, one group per product");
  __m512 acc[kTileRows];
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) int32_t sums[kTileGroups][kTileRows][16];
  for (int64_t g0 = 0; g0 < groups; g0 += kTileGroups) {
    const int count = static_cast<int>(std::min<int64_t>(kTileGroups, groups - g0));
    for_each_slot(count, [&](auto slot) {
      constexpr int j = decltype(slot)::value;
      Tiles::template load<4 + j % 2>(xq + (g0 + j) * kTileRows * kGroup, kGroup);
      Tiles::template load<6 + j % 2>(weights + (g0 + j) * 8 * 64, 64);
      Tiles::template zero<j>();
      Tiles::template dot_int8<j, 4 + j % 2, 6 + j % 2>();
    });
    for_each_slot(count, [&](auto slot) {
      constexpr int j = decltype(slot)::value;
      Tiles::template store<j>(&sums[j][0][0], 64);
    });
    // vnni_block's epilogue, group by group in order
    for (int j = 0; j < count; ++j) {
      const int64_t g = g0 + j;
      const __m512 scale = load_scales(scales + g * 16);
      const __m512 minimum = load_scales(mins + g * 16);
      const float* dxg = dx + g * kTileRows;
      const float* xsumg = xsum + g * kTileRows;
      for (int r = 0; r < kTileRows; ++r) {
        const __m512i dot = _mm512_load_si512(sums[j][r]);
        const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(dxg[r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
        acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsumg[r]), acc[r]);
      }
    }
  }
  for (int r = 0; r < kTileRows; ++r) _mm512_storeu_ps(out + r * 16, acc[r]);
}
#endif  // PAGEDSERVE_VNNI
