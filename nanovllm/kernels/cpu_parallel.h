// parallel_for(n, parallel, num_threads, body): body(i) for i in [0, n), on num_threads threads
// (statically) where `parallel`, else in a plain loop on the calling thread: OpenMP's `if`
// clause still forks a team of one (0.9 us a call of cpu_int4.cpp's 64 x 128 against 0.2
// without). Shared by cpu_int8.cpp and cpu_int4.cpp (the build key of a kernel hashes this file
// too: cpu_build.py).
#pragma once
#include <cstdint>

template <typename F>
void parallel_for(int64_t n, bool parallel, int num_threads, F&& body) {
  if (!parallel || num_threads <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t i = 0; i < n; ++i) body(i);
}
