// The AMX tile kernels' start-up checks and the functions the module exposes for them: set_tiles
// (which the kernels' loader, pagedserve/kernels/cpu_ops.py, calls once per process), and what the
// tests ask (tile_call_counts, tile_product). Included by cpu_ops.cpp inside its anonymous
// namespace, after the kernels it checks (quant_linear_dispatch, flash_prefill).

// A fixed stream of test values (the checks below must not touch torch's generator).
class CheckValues {
 public:
  uint32_t next() { return (state_ = state_ * 1664525u + 1013904223u) >> 8; }
  float uniform(float low, float high) {  // in [low, high)
    return low + (high - low) * static_cast<float>(next() % 65536) / 65536.f;
  }

 private:
  uint32_t state_ = 0x9E3779B9u;
};

// Why the int8 matmul on `tiles` disagrees with vnni_block ("" when every bit agrees): one product
// per code width, 40 rows (the last tile padded), 5 groups (a partial set of slots) and 3 column
// blocks.
std::string int8_tiles_disagreement(TileMode tiles) {
#ifdef PAGEDSERVE_AMX_INT8
  constexpr int64_t rows = 40, k = 5 * kGroup, n = 48, blocks = n / 16, groups = k / kGroup;
  CheckValues values;
  torch::Tensor x = torch::empty({rows, k}, torch::kFloat32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data_ptr<float>()[i] = values.uniform(-4.f, 4.f);
  for (int64_t bits : {4, 5, 8}) {
    torch::Tensor codes = torch::empty({blocks * groups * bits * 64}, torch::kUInt8);
    for (int64_t i = 0; i < codes.numel(); ++i) codes.data_ptr<uint8_t>()[i] = values.next() & 0xFF;
    torch::Tensor scales = torch::empty({blocks * groups * 16}, torch::kFloat32);
    torch::Tensor mins = torch::empty_like(scales);
    for (int64_t i = 0; i < scales.numel(); ++i) {
      scales.data_ptr<float>()[i] = values.uniform(1e-4f, 0.02f);
      mins.data_ptr<float>()[i] = values.uniform(-0.12f, 0.f);
    }
    torch::Tensor expected = torch::empty({rows, n}), got = torch::empty({rows, n});
    const auto* c = codes.data_ptr<uint8_t>();
    quant_linear_dispatch<int8_t, float>(x.data_ptr<float>(), rows, k, bits, c, scales, mins,
                                         nullptr, n, expected.data_ptr<float>(), {}, Gate::kNone,
                                         TileMode::kOff);
    quant_linear_dispatch<int8_t, float>(x.data_ptr<float>(), rows, k, bits, c, scales, mins,
                                         nullptr, n, got.data_ptr<float>(), {}, Gate::kNone, tiles);
    if (!torch::equal(expected, got))
      return "the int8 tiles' product differs from the VNNI kernel's (" + std::to_string(bits) +
             "-bit codes)";
  }
  return "";
#else
  return "this build has no AVX512-VNNI (the int8 tiles' epilogue and activation layout)";
#endif
}

// Why the flash prefill on `tiles` disagrees with the AVX512-BF16 kernel ("" when they agree to
// bf16 rounding: the sums run in another order): a chunk of 40 tokens (the last pass padded)
// after 50 cached keys (an odd 16-key tile, a partial step), 6 query heads on 2 KV heads.
std::string flash_tiles_disagreement(TileMode tiles) {
#ifdef PAGEDSERVE_AMX_FLASH
  constexpr int64_t tokens = 40, context = 50, heads = 6, kv_heads = 2, d = 64, block_size = 16;
  constexpr int64_t blocks = (tokens + context + block_size - 1) / block_size;
  CheckValues values;
  auto filled = [&](std::vector<int64_t> shape) {
    torch::Tensor t = torch::empty(shape, torch::kFloat32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<float>()[i] = values.uniform(-2.f, 2.f);
    return t.to(torch::kBFloat16);
  };
  const torch::Tensor q = filled({tokens, heads, d});
  const torch::Tensor key_cache = filled({kv_heads, blocks, block_size, d});
  const torch::Tensor value_cache = filled({kv_heads, blocks, block_size, d});
  std::vector<int64_t> ids(blocks);
  for (int64_t b = 0; b < blocks; ++b) ids[b] = blocks - 1 - b;  // out of order, as a pool's
  torch::Tensor expected = torch::empty({tokens, heads, d}, torch::kBFloat16);
  torch::Tensor got = torch::empty_like(expected);
  for (auto [mode, out] : {std::pair{TileMode::kOff, &expected}, std::pair{tiles, &got}})
    flash_prefill<4, c10::BFloat16>(
        q.data_ptr<c10::BFloat16>(), heads * d, key_cache.data_ptr<c10::BFloat16>(),
        value_cache.data_ptr<c10::BFloat16>(), nullptr, nullptr, blocks, block_size, ids.data(),
        context, tokens, heads, kv_heads, 0.125f, out->data_ptr<c10::BFloat16>(), mode);
  const double error = (expected.to(torch::kFloat32) - got.to(torch::kFloat32)).abs().max().item<double>();
  if (!(error <= 1.6e-2))  // 2 bf16 steps of an output near 1 (NaN fails too)
    return "the flash prefill on tiles is off the AVX512-BF16 kernel's by " + std::to_string(error);
  return "";
#else
  return "this build has no AVX512-BF16 flash prefill kernel";
#endif
}

// mode "amx": the AMX tiles, where this process can run them and both tile kernels pass the
// checks above; "model": the instructions' model (tests); "off": the AVX-512 kernels everywhere.
// Returns why the tiles are off ("" when the mode asked for is in force).
std::string set_tiles(const std::string& mode) {
  TORCH_CHECK(mode == "amx" || mode == "model" || mode == "off",
              "tiles: mode must be amx, model or off, not ", mode);
  tile_mode.store(TileMode::kOff);
  if (mode == "off") return "";
  const TileMode tiles = mode == "amx" ? TileMode::kHardware : TileMode::kModel;
  if (tiles == TileMode::kHardware) {
    const std::string reason = amx_unavailable_reason();
    if (!reason.empty()) return reason;
  }
  for (const std::string& disagreement :
       {int8_tiles_disagreement(tiles), flash_tiles_disagreement(tiles)})
    if (!disagreement.empty()) return disagreement;
  tile_mode.store(tiles);
  return "";
}

std::string tiles() {
  switch (tile_mode.load()) {
    case TileMode::kHardware: return "amx";
    case TileMode::kModel: return "model";
    default: return "off";
  }
}

// How many calls ran on tiles (hardware or model) in this process, per kernel.
std::map<std::string, int64_t> tile_call_counts() {
  return {{"int8_matmul", int8_tile_products.load()},
#ifdef PAGEDSERVE_AMX_FLASH
          {"flash_prefill", flash_tile_passes.load()}
#else
          {"flash_prefill", 0}
#endif
  };
}

// One tile product as the kernels configure it, on the hardware or the model (tests: the model
// against torch, and on AMX machines the hardware against the model):
//   kind "int8": a (16, 32) int8 times b (8, 64) uint8 in VNNI order -> (16, 16) int32;
//   kind "bf16": a (16, 32) bf16 times b (16, 32) bf16 in pair order -> (16, 16) fp32.
torch::Tensor tile_product(torch::Tensor a, torch::Tensor b, const std::string& kind,
                           bool hardware) {
  TORCH_CHECK(kind == "int8" || kind == "bf16", "tile_product: kind must be int8 or bf16");
  const bool int8 = kind == "int8";
  TORCH_CHECK(a.scalar_type() == (int8 ? torch::kInt8 : torch::kBFloat16) && a.dim() == 2 &&
                  a.size(0) == 16 && a.size(1) == 32 && a.is_contiguous(),
              "a: (16, 32) ", kind, ", contiguous");
  TORCH_CHECK(b.scalar_type() == (int8 ? torch::kUInt8 : torch::kBFloat16) && b.dim() == 2 &&
                  b.size(0) == (int8 ? 8 : 16) && b.size(1) == (int8 ? 64 : 32) &&
                  b.is_contiguous(),
              int8 ? "b: (8, 64) uint8, contiguous" : "b: (16, 32) bf16, contiguous");
  const std::string reason = hardware ? amx_unavailable_reason() : "";
  TORCH_CHECK(reason.empty(), "tile_product: ", reason);
  torch::Tensor sums = torch::empty({16, 16}, int8 ? torch::kInt32 : torch::kFloat32);
#if defined(PAGEDSERVE_AMX_INT8) && defined(PAGEDSERVE_AMX_FLASH)
  auto run = [&](auto tiles) {
    using Tiles = decltype(tiles);
    const TileSession session(hardware ? TileMode::kHardware : TileMode::kModel,
                              int8 ? int8_tile_config() : flash_tile_config());
    if (int8) {
      Tiles::template load<4>(a.data_ptr(), 32);
      Tiles::template load<6>(b.data_ptr(), 64);
      Tiles::template zero<0>();
      Tiles::template dot_int8<0, 4, 6>();
    } else {
      Tiles::template load<6>(a.data_ptr(), 64);
      Tiles::template load<7>(b.data_ptr(), 64);
      Tiles::template zero<0>();
      Tiles::template dot_bf16<0, 6, 7>();
    }
    Tiles::template store<0>(sums.data_ptr(), 64);
  };
  if (hardware) {
    run(HardwareTiles{});
  } else {
    run(TileModel{});
  }
  return sums;
#else
  TORCH_CHECK(false, "tile_product: this build has no AVX512-VNNI and AVX512-BF16 kernels");
#endif
}
