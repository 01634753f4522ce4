// AMX tiles (Intel Xeon 4th generation and later: AMX-TILE, AMX-INT8, AMX-BF16): the layer the
// tile kernels are written against (amx_int8.h: the int8 matmul's integer sums; amx_flash.h: the
// bf16 prefill attention's products). Included by cpu_ops.cpp inside its anonymous namespace.
//
// The layer comes in two forms with one interface. HardwareTiles issues the instructions.
// TileModel computes what the instruction set reference says they do, in plain loops, for a
// thread's own tile state, and checks the shapes the instructions check: the kernels' layouts,
// tile shapes and epilogues are tested on CPUs without AMX (tests/kernels/test_amx_tiles.py),
// and on a CPU with AMX the hardware against the model. set_tiles("amx") turns the hardware on
// only where the CPU has it, Linux grants the tile state, and each kernel's check product agrees
// with the AVX-512 kernel it replaces.
//
// Tile numbers are template arguments: the instructions name their registers, and "%c" prints a
// constant operand as the bare number.

// Which form runs the tile kernels: set once (set_tiles), read per call.
enum class TileMode { kOff, kHardware, kModel };
std::atomic<TileMode> tile_mode{TileMode::kOff};

// The tile configuration LDTILECFG reads (palette 1): 8 tiles, each up to 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row, tile t
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

struct HardwareTiles {
  __attribute__((target("amx-tile"))) static void configure(const TileConfig& config) {
    asm volatile("" ::: "memory");  // the config's stores before LDTILECFG reads it
    _tile_loadconfig(&config);
  }
  __attribute__((target("amx-tile"))) static void release() { _tile_release(); }
  // The memory clobbers order the buffers' stores before a load, and a store before their reads.
  template <int t>
  static void load(const void* base, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(t) : "memory");
  }
  template <int t>
  static void store(void* base, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(t) : "memory");
  }
  template <int t>
  static void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(t));
  }
  // c += a . b: a signed bytes, b unsigned bytes, int32 sums
  template <int c, int a, int b>
  static void dot_int8() {
    asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(c), "i"(a), "i"(b));
  }
  // c += a . b: bf16 pairs, fp32 sums
  template <int c, int a, int b>
  static void dot_bf16() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(c), "i"(a), "i"(b));
  }
};

// The instructions as the reference defines them: a load fills a tile's configured rows and bytes
// and zeroes the rest; TDPBSUD and TDPBF16PS add, for each of the sum tile's rows m and 32-bit
// columns n, the products of a's row m (words of 4 signed bytes, or 2 bf16) with column n of b
// over a's configured words (#UD where the shapes do not match). TDPBF16PS: each product of two
// bf16 is exact in fp32, the two of a word are added to the sum one after the other, rounded to
// nearest even, inputs and results below fp32's normal range taken as zero.
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
  template <int t>
  static void load(const void* base, int64_t stride) {
    State& s = state();
    TORCH_CHECK(s.configured, "tile model: a load before LDTILECFG");
    std::memset(s.data[t], 0, sizeof(s.data[t]));
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[t]);
  }
  template <int t>
  static void store(void* base, int64_t stride) {
    const State& s = state();
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t][r], s.config.colsb[t]);
  }
  template <int t>
  static void zero() {
    std::memset(state().data[t], 0, sizeof(state().data[t]));
  }
  static void check_shapes(int c, int a, int b) {
    const State& s = state();
    const TileConfig& k = s.config;
    TORCH_CHECK(s.configured && k.rows[c] == k.rows[a] && k.colsb[a] / 4 == k.rows[b] &&
                    k.colsb[c] == k.colsb[b] && k.colsb[a] % 4 == 0 && k.colsb[c] % 4 == 0,
                "tile model: the product's shapes do not match (#UD)");
  }
  template <int c, int a, int b>
  static void dot_int8() {
    check_shapes(c, a, b);
    State& s = state();
    for (int m = 0; m < s.config.rows[c]; ++m) {
      for (int n = 0; n < s.config.colsb[c] / 4; ++n) {
        int32_t sum;
        std::memcpy(&sum, &s.data[c][m][4 * n], 4);
        for (int w = 0; w < s.config.colsb[a] / 4; ++w)
          for (int i = 0; i < 4; ++i)
            sum += static_cast<int32_t>(static_cast<int8_t>(s.data[a][m][4 * w + i])) *
                   static_cast<int32_t>(s.data[b][w][4 * n + i]);
        std::memcpy(&s.data[c][m][4 * n], &sum, 4);
      }
    }
  }
  static float bf16_at(const uint8_t* p) {  // a bf16 as fp32, a subnormal as 0
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    if ((bits & 0x7F80) == 0) bits &= 0x8000;
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &wide, 4);
    return value;
  }
  static float flush(float v) { return std::fabs(v) < std::numeric_limits<float>::min() ? 0.f : v; }
  template <int c, int a, int b>
  static void dot_bf16() {
    check_shapes(c, a, b);
    State& s = state();
    for (int m = 0; m < s.config.rows[c]; ++m) {
      for (int n = 0; n < s.config.colsb[c] / 4; ++n) {
        float sum;
        std::memcpy(&sum, &s.data[c][m][4 * n], 4);
        sum = flush(sum);
        for (int w = 0; w < s.config.colsb[a] / 4; ++w)
          for (int i = 0; i < 2; ++i)
            sum = flush(sum + bf16_at(&s.data[a][m][4 * w + 2 * i]) *
                                  bf16_at(&s.data[b][w][4 * n + 2 * i]));
        std::memcpy(&s.data[c][m][4 * n], &sum, 4);
      }
    }
  }
};

// The thread's tiles configured for a kernel's work (nothing where the mode is off), released at
// the end of the scope.
class TileSession {
 public:
  TileSession(TileMode mode, const TileConfig& config) : mode_(mode) {
    if (mode_ == TileMode::kHardware) HardwareTiles::configure(config);
    if (mode_ == TileMode::kModel) TileModel::configure(config);
  }
  ~TileSession() {
    if (mode_ == TileMode::kHardware) HardwareTiles::release();
    if (mode_ == TileMode::kModel) TileModel::release();
  }
  TileSession(const TileSession&) = delete;
  TileSession& operator=(const TileSession&) = delete;

 private:
  TileMode mode_;
};

// Why this process cannot run AMX tiles ("" when it can): the CPU lacks AMX-TILE, AMX-INT8 or
// AMX-BF16 (CPUID leaf 7, EDX bits 24, 25, 22), or Linux did not grant the tile data state
// (arch_prctl; Linux 5.16+).
inline std::string amx_unavailable_reason() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return "the CPU reports no CPUID leaf 7";
  if (!(edx & (1u << 24)) || !(edx & (1u << 25)) || !(edx & (1u << 22)))
    return "this CPU has no AMX-INT8 and AMX-BF16";
  constexpr long kArchRequestXcompPermission = 0x1023;
  constexpr long kXfeatureTileData = 18;
  if (syscall(SYS_arch_prctl, kArchRequestXcompPermission, kXfeatureTileData) != 0)
    return std::string("Linux did not grant the AMX tile state (arch_prctl: ") +
           std::strerror(errno) + ")";
  return "";
}
