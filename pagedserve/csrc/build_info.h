// What this build of the kernels is: the hash of the csrc/ files it was compiled from (setup.py
// passes -DPAGEDSERVE_SOURCE_HASH) and the instruction sets it was compiled for, as
// /proc/cpuinfo names them. pagedserve/kernels/cpu_ops.py refuses a module whose hash differs from
// the shipped sources' or that needs an instruction set the running CPU lacks.
#pragma once

#include <string>

#define PAGEDSERVE_STRINGIFY_(x) #x
#define PAGEDSERVE_STRINGIFY(x) PAGEDSERVE_STRINGIFY_(x)
#ifndef PAGEDSERVE_SOURCE_HASH
#define PAGEDSERVE_SOURCE_HASH unknown
#endif

inline std::string pagedserve_build_isa() {
  std::string isa;
#if defined(__AVX2__)
  isa += " avx2";
#endif
#if defined(__AVX512F__)
  isa += " avx512f";
#endif
#if defined(__AVX512BW__)
  isa += " avx512bw";
#endif
#if defined(__AVX512VL__)
  isa += " avx512vl";
#endif
#if defined(__AVX512DQ__)
  isa += " avx512dq";
#endif
#if defined(__AVX512VNNI__)
  isa += " avx512_vnni";
#endif
#if defined(__AVX512BF16__)
  isa += " avx512_bf16";
#endif
#if defined(__FMA__)
  isa += " fma";
#endif
#if defined(__F16C__)
  isa += " f16c";
#endif
  return isa.empty() ? isa : isa.substr(1);
}
