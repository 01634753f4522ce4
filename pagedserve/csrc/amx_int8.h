// The int8 matmul's integer sums on AMX tiles (Intel Xeon 4th generation and later: AMX-TILE and
// AMX-INT8). Included by cpu_ops.cpp inside its anonymous namespace; quant_linear_impl runs
// amx_block in place of vnni_block for tiles of 16 activation rows when the tiles are on
// (set_int8_tiles).
//
// One TDPBSUD multiplies a tile of 16 activation rows by one 32-element group of a column block:
//   sums[m][n] += sum_k a[m][k] * b[k / 4][4n + k % 4],  a signed bytes, b unsigned bytes,
// a = the rows' int8 codes of the group ([row][32], the activation layout with 16-row tiles),
// b = the column block's codes as bytes in VNNI order ([element / 4][column][element % 4], the
// weight layout's own order; 4- and 5-bit codes widened once per block and chunk of rows). The
// integer sums are exact and equal vnni_block's, and the float epilogue below is vnni_block's,
// step for step: every output bit is the VNNI kernel's (tests/kernels/test_amx_int8.py).
//
// The tile layer comes in two forms with one interface: HardwareTiles issues the instructions;
// TileModel computes what the instruction set reference says they do, in plain loops, so the
// kernel's layout, tile shapes and epilogue are tested on CPUs without AMX (the tests compare it
// with vnni_block bit for bit, and the model's tile product with torch's integer matmul). Where
// the CPU has AMX, set_int8_tiles("amx") first runs both kernels on one product and turns the
// tiles on only if every bit agrees.

constexpr int64_t kTileRows = 16;  // activation rows per tile (a tile register's rows)
// Fewer rows than a tile: vnni_block (a padded tile would multiply mostly zeros). Not yet
// measured on an AMX machine; the row count where the tiles start to pay belongs there.
constexpr int64_t kTileMinRows = kTileRows;

// Which kernel takes the int8 sums of tiles of rows: set once (set_int8_tiles), read per call.
enum class Int8Tiles { kOff, kHardware, kModel };
std::atomic<Int8Tiles> int8_tiles_mode{Int8Tiles::kOff};
std::atomic<int64_t> int8_tile_products{0};  // products run on tiles (hardware or model)

#ifdef PAGEDSERVE_VNNI
#define PAGEDSERVE_AMX_INT8 1

constexpr int kTileGroups = 4;  // groups whose sums are in flight at once (sum tiles 0-3)

// The tile configuration LDTILECFG reads (palette 1): 8 tiles, each up to 16 rows of 64 bytes.
// Tiles 0-3: int32 sums, 16 rows x 16 columns; 4-5: activations, 16 rows x 32 bytes (one group);
// 6-7: weights, 8 rows (32 elements / 4) x 64 bytes (16 columns x 4 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row, tile t
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

inline TileConfig kernel_tile_config() {
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.colsb[t] = 64, config.rows[t] = kTileRows;
  for (int t = 4; t < 6; ++t) config.colsb[t] = kGroup, config.rows[t] = kTileRows;
  for (int t = 6; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kGroup / 4;
  return config;
}

// Slot j (0..3) of the groups in flight: sums in tile j, activations in tile 4 + j % 2, weights in
// tile 6 + j % 2.
struct HardwareTiles {
  __attribute__((target("amx-tile"))) static void configure(const TileConfig& config) {
    asm volatile("" ::: "memory");  // the config's stores before LDTILECFG reads it
    _tile_loadconfig(&config);
  }
  __attribute__((target("amx-tile"))) static void release() { _tile_release(); }
  // gcc's tile intrinsics are asm statements that take the address as a register, with no memory
  // operand: the compiler barriers make the buffers' stores land before a load reads them.
  template <int j>
  static void load(const int8_t* activations, const uint8_t* weights) {
    asm volatile("" ::: "memory");
    if constexpr (j % 2 == 0) {
      _tile_loadd(4, activations, kGroup);
      _tile_loadd(6, weights, 64);
    } else {
      _tile_loadd(5, activations, kGroup);
      _tile_loadd(7, weights, 64);
    }
  }
  template <int j>
  static void multiply() {
    if constexpr (j == 0) {
      _tile_zero(0);
      _tile_dpbsud(0, 4, 6);
    } else if constexpr (j == 1) {
      _tile_zero(1);
      _tile_dpbsud(1, 5, 7);
    } else if constexpr (j == 2) {
      _tile_zero(2);
      _tile_dpbsud(2, 4, 6);
    } else {
      _tile_zero(3);
      _tile_dpbsud(3, 5, 7);
    }
  }
  template <int j>
  static void store(int32_t* sums) {  // _tile_stored declares its memory clobber itself
    if constexpr (j == 0) {
      _tile_stored(0, sums, 64);
    } else if constexpr (j == 1) {
      _tile_stored(1, sums, 64);
    } else if constexpr (j == 2) {
      _tile_stored(2, sums, 64);
    } else {
      _tile_stored(3, sums, 64);
    }
  }
};

// The instructions as the reference defines them, for a thread's own tile state: a load fills a
// tile's configured rows and bytes and zeroes the rest; TDPBSUD adds, for each of the sum tile's
// rows m and columns n, the products of a's row m (signed bytes, as 32-bit words of 4) with
// column n of b (unsigned bytes) over a's configured words, and checks the shapes the instruction
// checks (#UD otherwise).
struct TileModel {
  struct State {
    TileConfig config;
    alignas(64) uint8_t data[8][16][64];
    bool configured = false;
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void configure(const TileConfig& config) {
    State& s = state();
    s.config = config;
    std::memset(s.data, 0, sizeof(s.data));
    s.configured = true;
  }
  static void release() { state().configured = false; }
  static void load_tile(int t, const void* base, int64_t stride) {
    State& s = state();
    TORCH_CHECK(s.configured, "tile model: load before LDTILECFG");
    std::memset(s.data[t], 0, sizeof(s.data[t]));
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[t]);
  }
  static void multiply_tiles(int c, int a, int b) {
    State& s = state();
    const TileConfig& k = s.config;
    TORCH_CHECK(s.configured && k.rows[c] == k.rows[a] && k.colsb[a] / 4 == k.rows[b] &&
                    k.colsb[c] == k.colsb[b] && k.colsb[a] % 4 == 0 && k.colsb[c] % 4 == 0,
                "tile model: TDPBSUD's shapes do not match (#UD)");
    for (int m = 0; m < k.rows[c]; ++m) {
      for (int n = 0; n < k.colsb[c] / 4; ++n) {
        int32_t sum;
        std::memcpy(&sum, &s.data[c][m][4 * n], 4);
        for (int w = 0; w < k.colsb[a] / 4; ++w)
          for (int i = 0; i < 4; ++i)
            sum += static_cast<int32_t>(static_cast<int8_t>(s.data[a][m][4 * w + i])) *
                   static_cast<int32_t>(s.data[b][w][4 * n + i]);
        std::memcpy(&s.data[c][m][4 * n], &sum, 4);
      }
    }
  }
  template <int j>
  static void load(const int8_t* activations, const uint8_t* weights) {
    load_tile(4 + j % 2, activations, kGroup);
    load_tile(6 + j % 2, weights, 64);
  }
  template <int j>
  static void multiply() {
    std::memset(state().data[j], 0, sizeof(state().data[j]));  // TILEZERO
    multiply_tiles(j, 4 + j % 2, 6 + j % 2);
  }
  template <int j>
  static void store(int32_t* sums) {
    const State& s = state();
    for (int r = 0; r < s.config.rows[j]; ++r)
      std::memcpy(reinterpret_cast<uint8_t*>(sums) + r * 64, s.data[j][r], s.config.colsb[j]);
  }
};

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
// dx, xsum: [group][16].
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
      Tiles::template load<j>(xq + (g0 + j) * kTileRows * kGroup, weights + (g0 + j) * 8 * 64);
      Tiles::template multiply<j>();
    });
    for_each_slot(count, [&](auto slot) {
      constexpr int j = decltype(slot)::value;
      Tiles::template store<j>(&sums[j][0][0]);
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

// A column block's codes as bytes in the 8-bit layout ([group][8][64]): the tiles load bytes.
template <int kBits>
inline void widen_codes_to_bytes(const uint8_t* codes, int64_t groups, uint8_t* panel) {
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[16];  // the int8 form fills 8
    unpack_group<kBits, int8_t>(codes + g * kBits * 64, w);
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(panel + g * 8 * 64 + j * 64, w[j]);
  }
}

// Why this process cannot run AMX-INT8 tiles ("" when it can): the CPU lacks them (CPUID leaf 7,
// EDX bits 24 and 25), or Linux did not grant the tile data state (arch_prctl; Linux 5.16+).
inline std::string amx_unavailable_reason() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return "the CPU reports no CPUID leaf 7";
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return "this CPU has no AMX-INT8";
  constexpr long kArchRequestXcompPermission = 0x1023;
  constexpr long kXfeatureTileData = 18;
  if (syscall(SYS_arch_prctl, kArchRequestXcompPermission, kXfeatureTileData) != 0)
    return std::string("Linux did not grant the AMX tile state (arch_prctl: ") +
           std::strerror(errno) + ")";
  return "";
}

#endif  // PAGEDSERVE_VNNI
