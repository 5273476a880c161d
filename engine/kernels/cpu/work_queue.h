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

// Indices of costs, largest first (ties keep their order).
template <typename C>
static std::vector<int64_t> costliest_first(int64_t n, const C& cost) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  return order;
}
