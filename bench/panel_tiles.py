"""The panel kernels' register tiles alone, one core: nanoseconds per panel row by row count.

Compiles a small C++ driver around esurge/models/cpu_kernels/coded_matmul.cc
and widened_matmul.cc (the engine's own compile flags, -march=native), and
times one thread multiplying M rows by --panels
panels of SmolLM2's gate/up shape (K = 576): 4-bit codes (the coded kernel's
expansion and tiles), bfloat16 panels (widened in registers) and float32
panels (the tiles alone). No thread pool, no XLA call: what is left
is the tiles' own instruction stream, the part the kernels' code decides. A
panel row is one k of one 32-column panel, so 1 / ns is panel rows per
nanosecond whatever the shape. With --panels 4 the weights stay in L2; the
default 96 (SmolLM2's gate/up) streams them from L3. Prints the best of
--repeats timings per row count, and the CPU's vector features.

    .venv/bin/python bench/panel_tiles.py [--rows 1,2,3,4,5,6,8,16] [--panels 96] [--repeats 300]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_DRIVER = r"""
#include "coded_matmul.cc"
#include "widened_matmul.cc"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
using namespace esurge_kernels::panel;

template <typename Run>
double Best(int repeats, Run run) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                              .count());
  }
  return best;
}

int main(int argc, char** argv) {
  const int64_t K = 576, P = std::atoll(argv[1]);
  const int repeats = std::atoi(argv[2]);
  std::mt19937 g(1);
  std::vector<uint8_t> codes(P * K * 16);
  std::vector<float> scale(P * K), offset(P * K), x(64 * K), y(64 * P * 32);
  std::vector<float> panel(P * K * 32);
  std::vector<uint16_t> halves(P * K * 32);
  for (auto& c : codes) c = g();
  for (auto& s : scale) s = (g() % 100) / 1000.f;
  for (auto& o : offset) o = -(g() % 100) / 100.f;
  for (auto& v : x) v = ((int)(g() % 2001) - 1000) / 997.f;
  for (auto& w : panel) w = ((int)(g() % 2001) - 1000) / 1999.f;
  for (auto& h : halves) h = static_cast<uint16_t>(0x3c00 + g() % 512);
  const Codes c{codes.data(), scale.data(), offset.data(), K, 4};
  for (int a = 3; a < argc; ++a) {
    const int rows = std::atoi(argv[a]);
    const Problem pb{x.data(), y.data(), rows, K, P * 32, false};
    const double coded = Best(repeats, [&] {
      for (int64_t p = 0; p < P; ++p) ExpandedChunk(pb, CodedRows<4>(c, p), p, 0, rows);
    });
    const double f32 = Best(repeats, [&] {
      for (int64_t p = 0; p < P; ++p) {
        for (int64_t r = 0; r < rows; r += kFewRows) {
          FewRows(pb, PanelRows{panel.data() + p * K * kPanel, r == 0}, r, p,
                  static_cast<int>(std::min<int64_t>(kFewRows, rows - r)));
        }
      }
    });
    const double bf16 = Best(repeats, [&] {
      for (int64_t p = 0; p < P; ++p) {
        ExpandedChunk(pb, Bf16Rows{halves.data() + p * K * kPanel}, p, 0, rows);
      }
    });
    std::printf("%4d %10.2f %10.2f %10.2f\n", rows, coded * 1e9 / (K * P), bf16 * 1e9 / (K * P),
                f32 * 1e9 / (K * P));
  }
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,16")
    parser.add_argument("--panels", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if any(r < 1 or r > 64 for r in rows) or args.panels < 1 or args.repeats < 1:
        parser.error("rows must be 1..64; --panels and --repeats positive")
    import jax

    from esurge.models import cpu_kernels

    source = REPO / "esurge/models/cpu_kernels"
    with tempfile.TemporaryDirectory() as work:
        driver = Path(work) / "driver.cc"
        driver.write_text(_DRIVER)
        binary = Path(work) / "driver"
        subprocess.run(["c++", *cpu_kernels._COMPILE_FLAGS, "-w", f"-I{source}",
                        f"-I{jax.ffi.include_dir()}", str(driver), "-o", str(binary)],
                       check=True)
        print(f"AVX-512: {cpu_kernels.cpu_has_avx512()}; {args.panels} panels of K = 576, "
              f"best of {args.repeats}; ns per panel row, one thread")
        print(f"{'rows':>4} {'4-bit':>10} {'bfloat16':>10} {'float32':>10}")
        sys.stdout.flush()
        subprocess.run([str(binary), str(args.panels), str(args.repeats), *map(str, rows)],
                       check=True)


if __name__ == "__main__":
    main()
