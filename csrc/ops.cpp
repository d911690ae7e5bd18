// The operator schemas of attnops. They are the contract (docs/design.md): argument names and order matter.
// Implementations are registered elsewhere: Python impls + fakes in attnops/ops.py, C++ kernels in csrc/cpu/.
#include <torch/library.h>

TORCH_LIBRARY(attnops, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q=None, *, float? scale=None, float soft_cap=0.0, int window_left=-1, "
      "str kv_format=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None, "
      "Tensor? tree_mask=None) -> Tensor");
  m.def(
      "paged_attention.out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q=None, *, float? scale=None, float soft_cap=0.0, int window_left=-1, "
      "str kv_format=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None, "
      "Tensor? tree_mask=None, Tensor(a!) out) -> ()");
  // paged_attention's result and each row's log-sum-exp (float32 [T, Hq], natural log of the softmax denominator,
  // sinks included): what merge_attention_states takes to combine results over disjoint keys
  m.def(
      "paged_attention_with_lse(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q=None, *, float? scale=None, float soft_cap=0.0, int window_left=-1, "
      "str kv_format=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None, "
      "Tensor? tree_mask=None) -> (Tensor, Tensor)");
  m.def(
      "paged_attention_with_lse.out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q=None, *, float? scale=None, float soft_cap=0.0, int window_left=-1, "
      "str kv_format=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None, "
      "Tensor? tree_mask=None, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, *, "
      "str kv_format=\"auto\", Tensor? k_scale=None, Tensor? v_scale=None, "
      "Tensor(c!)? k_block_scale=None, Tensor(d!)? v_block_scale=None) -> ()");
  m.def("merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  m.def(
      "merge_attention_states.out(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, *, Tensor(a!) out, "
      "Tensor(b!) lse) -> ()");
}
