// specrt's token-tree verification ops — verify_tree_greedy, rejection_sample_tree: schemas,
// op bodies and the CPU registrations (the CUDA registrations live in csrc/cuda/tree_cuda.cu;
// the math in csrc/include/specrt/tree.h, the CPU kernels in csrc/cpu/tree_cpu.cpp).
//
// The op bodies check as the chain ops' do (csrc/sampling_ops.cpp): every argument named,
// values (token ids, parents, counts, probability rows) only when check_values is set.
#include <torch/library.h>

#include <string>
#include <tuple>

#include "checks.h"
#include "ops.h"

namespace specrt {

namespace {

// The tree arguments of both tree ops: node_token_ids / node_parents [B, N] and
// num_nodes [B], integers on `device`, against target rows [B, N+1, V].
void check_tree_args(const at::Tensor& target, const char* target_name, const at::Tensor& node_token_ids,
                     const at::Tensor& node_parents, const at::Tensor& num_nodes, const at::Device& device) {
  const int64_t batch = target.size(0);
  const int64_t n1 = target.size(1);
  TORCH_CHECK_VALUE(n1 >= 1 && target.size(2) >= 1, target_name,
                    " must be [B, N+1, V] with N+1 >= 1 and V >= 1, got ", shape_str(target));
  TORCH_CHECK_VALUE(target.size(2) < (int64_t{1} << 31), target_name, ": vocabulary size ", target.size(2),
                    " must be < 2^31");
  TORCH_CHECK_VALUE(n1 - 1 < (int64_t{1} << 31), target_name, ": N = ", n1 - 1, " nodes must be < 2^31");
  check_int_arg(node_token_ids, "node_token_ids", 2, device);
  check_size(node_token_ids, "node_token_ids", 0, batch, "B of the target rows");
  check_size(node_token_ids, "node_token_ids", 1, n1 - 1, "N = target rows - 1");
  check_int_arg(node_parents, "node_parents", 2, device);
  check_size(node_parents, "node_parents", 0, batch, "B of the target rows");
  check_size(node_parents, "node_parents", 1, n1 - 1, "N = target rows - 1");
  check_int_arg(num_nodes, "num_nodes", 1, device);
  check_size(num_nodes, "num_nodes", 0, batch, "B of the target rows");
}

// The three outputs, allocated like the chain ops' (the kernels write the -1 padding).
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_outputs(const at::Tensor& target) {
  const auto options = target.options().dtype(at::kInt);
  return {at::empty({target.size(0), target.size(1)}, options), at::empty({target.size(0)}, options),
          at::empty({target.size(0), target.size(1) - 1}, options)};
}

// With value checks: every row a tree can reach (target row 0, and target row
// j + 1 and draft row j of every node j < num_nodes) holds some probability.
// Run after check_tree_values, so the counts are in [0, N].
void check_tree_rows(const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                     const at::Tensor& num_nodes) {
  const at::Tensor counts = wide_host(num_nodes);
  const at::Tensor p = host(target_probs);
  const at::Tensor q = draft_probs.has_value() ? host(*draft_probs) : at::Tensor();
  const int64_t batch = p.size(0), n1 = p.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = counts.data_ptr<int64_t>()[b];
    TORCH_CHECK_VALUE(row_has_mass(p, b * n1), "target_probs[", b, ", 0] (the root's row) is all zero");
    for (int64_t j = 0; j < n; ++j) {
      TORCH_CHECK_VALUE(row_has_mass(p, b * n1 + j + 1), "target_probs[", b, ", ", j + 1, "] (node ", j,
                        "'s row) is all zero");
      TORCH_CHECK_VALUE(!q.defined() || row_has_mass(q, b * (n1 - 1) + j), "draft_probs[", b, ", ", j,
                        "] is all zero, yet node_token_ids[", b, ", ", j, "] was sampled from it");
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_greedy_op(const at::Tensor& target_logits,
                                                                     const at::Tensor& node_token_ids,
                                                                     const at::Tensor& node_parents,
                                                                     const at::Tensor& num_nodes, bool check_values,
                                                                     VerifyTreeGreedyKernel kernel) {
  TORCH_CHECK_VALUE(target_logits.defined(), "target_logits must be a tensor, got None");
  const at::Device device = target_logits.device();
  check_tensor(target_logits, "target_logits", at::kFloat, 3, device);
  check_tree_args(target_logits, "target_logits", node_token_ids, node_parents, num_nodes, device);
  if (check_values) check_tree_values(node_token_ids, node_parents, num_nodes, target_logits.size(2));
  auto [out, n_acc, nodes] = tree_outputs(target_logits);
  if (target_logits.size(0) > 0)
    kernel(target_logits, saturate_int32(node_token_ids), saturate_int32(node_parents), saturate_int32(num_nodes),
           out, n_acc, nodes);
  return {out, n_acc, nodes};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rejection_sample_tree_op(
    const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs, const at::Tensor& node_token_ids,
    const at::Tensor& node_parents, const at::Tensor& num_nodes, const at::Tensor& seeds, const at::Tensor& positions,
    const std::string& method, bool check_values, RejectionSampleTreeKernel kernel) {
  TORCH_CHECK_VALUE(method == "rejection" || method == "coupled", "method must be 'rejection' or 'coupled', got '",
                    method, "'");
  TORCH_CHECK_VALUE(target_probs.defined(), "target_probs must be a tensor, got None");
  const at::Device device = target_probs.device();
  check_tensor(target_probs, "target_probs", at::kFloat, 3, device);
  check_tree_args(target_probs, "target_probs", node_token_ids, node_parents, num_nodes, device);
  const int64_t batch = target_probs.size(0);
  const int64_t n1 = target_probs.size(1);
  const int64_t vocab = target_probs.size(2);
  if (draft_probs.has_value()) {
    check_tensor(*draft_probs, "draft_probs", at::kFloat, 3, device);
    check_size(*draft_probs, "draft_probs", 0, batch, "B of target_probs");
    check_size(*draft_probs, "draft_probs", 1, n1 - 1, "N = target_probs.shape[1] - 1");
    check_size(*draft_probs, "draft_probs", 2, vocab, "V of target_probs");
  }
  check_tensor(seeds, "seeds", at::kLong, 1, device);
  check_size(seeds, "seeds", 0, batch, "B of target_probs");
  check_tensor(positions, "positions", at::kLong, 1, device);
  check_size(positions, "positions", 0, batch, "B of target_probs");
  const bool coupled = method == "coupled";
  if (check_values) {
    check_probs_values(target_probs, "target_probs");
    if (draft_probs.has_value() && !coupled) check_probs_values(*draft_probs, "draft_probs");
    check_tree_values(node_token_ids, node_parents, num_nodes, vocab);
    check_positions(positions);
    check_tree_rows(target_probs, coupled ? std::optional<at::Tensor>() : draft_probs, num_nodes);
  }
  auto [out, n_acc, nodes] = tree_outputs(target_probs);
  if (batch > 0)
    kernel(target_probs, draft_probs, saturate_int32(node_token_ids), saturate_int32(node_parents),
           saturate_int32(num_nodes), seeds, positions, coupled ? AcceptMethod::kCoupled : AcceptMethod::kRejection,
           out, n_acc, nodes);
  return {out, n_acc, nodes};
}

}  // namespace specrt

// Schemas: one per op; mutated arguments are marked (a!). specrt/ops/ holds
// the documented Python wrappers and the fake (meta) kernels.
TORCH_LIBRARY_FRAGMENT(specrt, m) {
  m.def("verify_tree_greedy(Tensor target_logits, Tensor node_token_ids, Tensor node_parents, Tensor num_nodes, "
        "bool check_values=True) -> (Tensor output_token_ids, Tensor num_accepted, Tensor accepted_nodes)");
  m.def("rejection_sample_tree(Tensor target_probs, Tensor? draft_probs, Tensor node_token_ids, "
        "Tensor node_parents, Tensor num_nodes, Tensor seeds, Tensor positions, str method=\"rejection\", "
        "bool check_values=True) -> (Tensor output_token_ids, Tensor num_accepted, Tensor accepted_nodes)");
}

TORCH_LIBRARY_IMPL(specrt, CPU, m) {
  using at::Tensor;
  m.impl("verify_tree_greedy", [](const Tensor& target_logits, const Tensor& node_token_ids,
                                  const Tensor& node_parents, const Tensor& num_nodes, bool check) {
    return specrt::verify_tree_greedy_op(target_logits, node_token_ids, node_parents, num_nodes, check,
                                         &specrt::verify_tree_greedy_cpu);
  });
  m.impl("rejection_sample_tree",
         [](const Tensor& target_probs, const std::optional<Tensor>& draft_probs, const Tensor& node_token_ids,
            const Tensor& node_parents, const Tensor& num_nodes, const Tensor& seeds, const Tensor& positions,
            std::string method, bool check) {
           return specrt::rejection_sample_tree_op(target_probs, draft_probs, node_token_ids, node_parents,
                                                   num_nodes, seeds, positions, method, check,
                                                   &specrt::rejection_sample_tree_cpu);
         });
}

// Sampling is not differentiable: outputs never require grad, whatever the inputs.
TORCH_LIBRARY_IMPL(specrt, Autograd, m) {
  for (const char* op : {"verify_tree_greedy", "rejection_sample_tree"})
    m.impl(op, torch::CppFunction::makeFallthrough());
}
