// Shared by the CPU kernels: when to use threads, and how hot loops vectorise without -march.
#pragma once

#include <cstdint>

namespace cafin {

// Below this many elements threads cost more than they save (aten's TensorIterator grain).
constexpr int64_t kGrainSize = 32768;

}  // namespace cafin

// Hot loops are compiled for several ISAs and picked at load time: the build may not use -march.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CAFIN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CAFIN_CPU_CLONES
#endif
