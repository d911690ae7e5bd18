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
  // Latent attention (MLA, DeepSeek's absorbed form): one latent row a token, [c (R values), r (P values)], shared
  // by every query head; scores scale * (q_nope . c + q_pe . r), output the weighted sum of the c rows; with
  // topk_indices (the sparse form) a row sees only the key positions it lists (docs/design.md, "mla_attention")
  m.def(
      "mla_attention(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q=None, *, float scale, str kv_format=\"auto\", Tensor? kv_scale=None, "
      "Tensor? sinks=None, Tensor? tree_mask=None, Tensor? topk_indices=None) -> Tensor");
  m.def(
      "mla_attention.out(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q=None, *, float scale, str kv_format=\"auto\", Tensor? kv_scale=None, "
      "Tensor? sinks=None, Tensor? tree_mask=None, Tensor? topk_indices=None, Tensor(a!) out) -> ()");
  m.def(
      "mla_attention_with_lse(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor? cu_seqlens_q=None, *, float scale, str kv_format=\"auto\", Tensor? kv_scale=None, "
      "Tensor? sinks=None, Tensor? tree_mask=None, Tensor? topk_indices=None) -> (Tensor, Tensor)");
  m.def(
      "mla_attention_with_lse.out(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor? cu_seqlens_q=None, *, float scale, str kv_format=\"auto\", "
      "Tensor? kv_scale=None, Tensor? sinks=None, Tensor? tree_mask=None, Tensor? topk_indices=None, "
      "Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def(
      "mla_cache_write(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, *, "
      "str kv_format=\"auto\", Tensor? kv_scale=None) -> ()");
  m.def("merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  m.def(
      "merge_attention_states.out(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, *, Tensor(a!) out, "
      "Tensor(b!) lse) -> ()");
}
