// What the CPU ops' run-time dispatch asks of the CPU (sparse_attention.cpp, decode_attention.cpp, small_gemm.cpp,
// rms_norm.cpp, rotary.cpp).
//
// x86-64 with GCC/Clang: an op's AVX2+FMA code is compiled with target attributes beside its baseline (or, for
// decode_attention, refused without it) and cpu_has_avx2_fma() picks at run time, so one cached build serves every
// machine without -march=native. (target_clones("arch=haswell") dispatches on the CPU model, not its features, and
// fell back to the baseline on AMD EPYC.)
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define MAGNETAR_X86_DISPATCH 1

inline bool cpu_has_avx2_fma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}

// AVX-512 with byte and word lanes (F + BW): Intel Skylake-SP on, AMD Zen 4 on.
inline bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return has;
}

// AVX-512 with its BF16 dot products (VDPBF16PS): Intel Cooper Lake / Sapphire Rapids on, AMD Zen 4 on.
inline bool cpu_has_avx512_bf16() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
  }();
  return has && cpu_has_avx512();
}
#endif
