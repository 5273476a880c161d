// Dynamic scheduling over torch's intra-op threads. at::parallel_for hands each thread an equal
// count of items; decode rows arrive sorted by context length and prompt chunks' later tiles
// see more keys, so equal counts left one of two threads with ~3/4 of the work. Here each thread
// takes the next item when it finishes one; callers order items costliest first.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

// fn(item, state) for item in [0, n); State is built once per thread (scratch buffers).
template <typename State, typename F>
static void parallel_dynamic(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)), 1, [&](int64_t, int64_t) {
    State state{};
    for (int64_t w; (w = next.fetch_add(1)) < n;) fn(w, state);
  });
}

// fn(item, state) for item in [0, n), each thread over its own contiguous run of items in order
// (a streamed weight's hardware and software prefetch carry on into the next item), and a thread
// whose run is done takes items from the back of the others' (two threads then meet in the
// middle of a run). For items of equal cost whose order in memory matters.
template <typename State, typename F>
static void parallel_runs(int64_t n, const F& fn) {
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  // Run r's [front, back) packed in one word, so taking from either end is one compare-exchange.
  std::vector<std::atomic<uint64_t>> runs(t);
  for (int64_t r = 0; r < t; ++r) runs[r] = (static_cast<uint64_t>(n * r / t) << 32) | static_cast<uint64_t>(n * (r + 1) / t);
  const auto take = [&](int64_t r, bool front) -> int64_t {
    uint64_t v = runs[r].load();
    for (;;) {
      const int64_t f = static_cast<int64_t>(v >> 32), b = static_cast<int64_t>(v & 0xFFFFFFFFu);
      if (f >= b) return -1;
      const uint64_t next = front ? v + (uint64_t{1} << 32) : v - 1;
      if (runs[r].compare_exchange_weak(v, next)) return front ? f : b - 1;
    }
  };
  at::parallel_for(0, t, 1, [&](int64_t r0, int64_t) {
    State state{};
    for (int64_t i; (i = take(r0, true)) >= 0;) fn(i, state);
    for (int64_t k = 1; k < t; ++k)
      for (int64_t i; (i = take((r0 + k) % t, false)) >= 0;) fn(i, state);
  });
}

// Indices of costs, largest first (ties keep their order).
template <typename C>
static std::vector<int64_t> costliest_first(int64_t n, const C& cost) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  return order;
}
