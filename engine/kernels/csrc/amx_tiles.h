// What the AMX kernels (amx_gemm.cpp, int8_amx.cpp) share: the tile configuration and the probe of the CPU's
// features and the kernel's permission. Included only where the AMX code is built (SPECMIX_AMX).
#pragma once
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace amx_tiles {

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg with the whole configuration as the asm's operand (GCC's _tile_loadconfig names only its first 8 bytes
// as read, which lets the compiler drop the stores of the shapes)
inline void load(const Config& cfg) { __asm__ volatile("ldtilecfg %0" : : "m"(cfg)); }

// A compiler barrier around tile loads and stores: GCC's _tile_loadd and _tile_stored name no memory operand, so
// without it the compiler may drop stores a tile load reads, or read what a tile store wrote before it was written
inline void memory_barrier() { __asm__ volatile("" : : : "memory"); }

// "" when this process can run tiles with feature `bit` of cpuid leaf 7's EDX (22: AMX-BF16, 25: AMX-INT8; named
// `what`), else why not
inline std::string probe(unsigned bit, const char* what) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "the CPU does not report its features (cpuid leaf 7)";
  if (!(d & (1u << 24)) || !(d & (1u << bit))) return std::string("the CPU has no ") + what + " tiles";
  // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return "the kernel refused the AMX tile state (arch_prctl)";
  return "";
}

}  // namespace amx_tiles
