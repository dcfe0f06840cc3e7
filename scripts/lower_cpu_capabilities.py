"""Print the ATEN_CPU_CAPABILITY values below the one torch picks on this CPU, one a line.

torch's CPU kernels are compiled for several vector widths and pick the widest the CPU
has; their reductions sum in an order that follows the width. ``make test`` reruns the
exactness tests under each lower width, so that an AVX-512 machine also checks the AVX2 and
scalar paths (and an AVX2 machine the scalar one).
"""

import torch

LEVELS = ["default", "avx2", "avx512"]  # x86, narrowest first

native = torch.backends.cpu.get_cpu_capability().lower()
lower = LEVELS[: LEVELS.index(native)] if native in LEVELS else ["default"]
print("\n".join(c for c in lower if c != native))
