// What a C++ user of the CMake-built library does: write new tokens into a paged KV cache with
// attnops::reshape_and_cache, then run attnops::paged_attention (decode, then a prefill-style multi-token step),
// both through the dispatcher on CPU tensors. The outputs are checked for shape, finiteness, and against the same
// attention written with plain ATen ops. Exit code 0 on success. Built by CMakeLists.txt, run by tests/test_cmake.py.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

int failures = 0;

std::string sci(double x) {
  std::ostringstream s;
  s << std::scientific << x;
  return s.str();
}

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok:   " : "FAIL: ") << what << "\n";
  if (!ok) ++failures;
}

// Attention for one sequence with ATen ops: q [n, Hq, D] are the last n of the kv_len positions (causal).
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const int64_t n = q.size(0), kv_len = k.size(0), group = q.size(1) / k.size(1);
  const at::Tensor kk = k.repeat_interleave(group, 1).transpose(0, 1);  // [Hq, kv_len, D]
  const at::Tensor vv = v.repeat_interleave(group, 1).transpose(0, 1);
  at::Tensor scores = at::matmul(q.transpose(0, 1), kk.transpose(1, 2)) * scale;  // [Hq, n, kv_len]
  const at::Tensor query_pos = at::arange(kv_len - n, kv_len).unsqueeze(1);
  const at::Tensor key_pos = at::arange(kv_len).unsqueeze(0);
  scores = scores.masked_fill(key_pos > query_pos, -INFINITY);
  return at::matmul(at::softmax(scores, -1), vv).transpose(0, 1);  // [n, Hq, D]
}

}  // namespace

int main() {
  at::manual_seed(0);
  const int64_t num_q_heads = 8, num_kv_heads = 2, head_dim = 64, page_size = 16, num_pages = 32;
  const std::vector<int64_t> kv_lens = {37, 1, 100};
  const int64_t batch = static_cast<int64_t>(kv_lens.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));

  // FlashInfer's layout: K and V of a page next to each other; pages handed out in random order
  const at::Tensor kv = at::zeros({num_pages, 2, page_size, num_kv_heads, head_dim});
  at::Tensor k_cache = kv.select(1, 0), v_cache = kv.select(1, 1);
  const at::Tensor order = at::randperm(num_pages, at::kInt);
  at::Tensor block_table = at::full({batch, 8}, -1, at::kInt);
  std::vector<at::Tensor> keys, values;
  int64_t next_page = 0;
  std::vector<int64_t> slots;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pages = (kv_lens[b] + page_size - 1) / page_size;
    block_table[b].narrow(0, 0, pages).copy_(order.narrow(0, next_page, pages));
    next_page += pages;
    for (int64_t t = 0; t < kv_lens[b]; ++t)
      slots.push_back(block_table[b][t / page_size].item<int64_t>() * page_size + t % page_size);
    keys.push_back(at::randn({kv_lens[b], num_kv_heads, head_dim}));
    values.push_back(at::randn({kv_lens[b], num_kv_heads, head_dim}));
  }
  const at::Tensor seq_lens = at::tensor(std::vector<int32_t>(kv_lens.begin(), kv_lens.end()), at::kInt);

  auto& dispatcher = c10::Dispatcher::singleton();
  auto reshape_and_cache =
      dispatcher.findSchemaOrThrow("attnops::reshape_and_cache", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                      c10::string_view, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  auto paged_attention =
      dispatcher.findSchemaOrThrow("attnops::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const std::optional<at::Tensor>&, std::optional<double>, double, int64_t,
                            c10::string_view, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();

  // 1. write every token of every sequence (one padding slot, -1, is skipped)
  std::vector<int64_t> slots_padded = slots;
  slots_padded.push_back(-1);
  const at::Tensor all_keys = at::cat({at::cat(keys), at::randn({1, num_kv_heads, head_dim})});
  const at::Tensor all_values = at::cat({at::cat(values), at::randn({1, num_kv_heads, head_dim})});
  reshape_and_cache.call(all_keys, all_values, k_cache, v_cache, at::tensor(slots_padded, at::kLong), "auto",
                         std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  const at::Tensor written = k_cache.flatten(0, 1).index_select(0, at::tensor(slots, at::kLong));
  expect(at::equal(written, at::cat(keys)), "reshape_and_cache wrote every key into its slot");

  // 2. decode: one query per sequence
  const at::Tensor q = at::randn({batch, num_q_heads, head_dim});
  const at::Tensor out = paged_attention.call(q, k_cache, v_cache, block_table, seq_lens, std::nullopt, std::nullopt,
                                              0.0, -1, "auto", std::nullopt, std::nullopt, std::nullopt,
                                              std::nullopt);
  expect(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "decode output is [B, Hq, D] float32");
  expect(at::isfinite(out).all().item<bool>(), "decode output is finite");
  double worst = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor expected = reference(q.narrow(0, b, 1), keys[b], values[b], scale);
    worst = std::max(worst, (out.narrow(0, b, 1) - expected).abs().max().item<double>());
  }
  expect(worst < 1e-4, "decode matches ATen attention (max abs error " + sci(worst) + ")");

  // 3. a multi-token step: the last 5 positions of sequence 0 (causal among themselves) and of sequence 2
  const at::Tensor cu_seqlens_q = at::tensor(std::vector<int32_t>{0, 5, 5, 10}, at::kInt);
  const at::Tensor lens2 = at::tensor(std::vector<int32_t>{37, 0, 100}, at::kInt);  // sequence 1 empty
  const at::Tensor q2 = at::randn({10, num_q_heads, head_dim});
  const at::Tensor out2 = paged_attention.call(q2, k_cache, v_cache, block_table, lens2, cu_seqlens_q, scale, 0.0, -1,
                                               "auto", std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  const at::Tensor expected2 = at::cat({reference(q2.narrow(0, 0, 5), keys[0], values[0], scale),
                                        reference(q2.narrow(0, 5, 5), keys[2], values[2], scale)});
  const double err2 = (out2 - expected2).abs().max().item<double>();
  expect(err2 < 1e-4, "multi-token causal step matches ATen attention (max abs error " + sci(err2) + ")");

  std::cout << (failures ? "FAILED" : "PASSED") << "\n";
  return failures ? 1 : 0;
}
