"""TransformerLens's Exploratory Analysis Demo (indirect object identification), step by step, on interp (issue 37).

From TransformerLens's demos/Exploratory_Analysis_Demo.ipynb outline, not copied: the loading lines use SmolLM2-135M
for GPT-2 small, and a CHANGED comment says why any other line differs (``notebooks/transformerlens.md``).

    python notebooks/tl_demos/exploratory_demo.py --attn flash      # or eager; --device cuda --dtype bfloat16
"""

from functools import partial

import torch

from interp import HookedTransformer, utils  # loading: was `from transformer_lens import HookedTransformer, utils`
from options import options  # --attn, --device, --dtype (and no gradients, as the demos set)

args = options()

model = HookedTransformer.from_pretrained("smollm2", attn=args.attn, device=args.device, dtype=args.dtype)  # loading

# -- the task ------------------------------------------------------------------------------------------------------
prompt_format = [
    "When John and Mary went to the shops,{} gave the bag to",
    "When Tom and James went to the park,{} gave the ball to",
    "When Dan and Sid went to the shops,{} gave an apple to",
    "After Martin and Amy went to the park,{} gave a drink to",
]
name_pairs = [(" Mary", " John"), (" Tom", " James"), (" Dan", " Sid"), (" Martin", " Amy")]
prompts = [prompt_format[i].format(name_pairs[i][1 - j]) for i in range(4) for j in range(2)]
answers = [(name_pairs[i][j], name_pairs[i][1 - j]) for i in range(4) for j in range(2)]
answer_tokens = torch.tensor([[model.to_single_token(a) for a in pair] for pair in answers]).to(model.device)
tokens = model.to_tokens(prompts, prepend_bos=True)
print(prompts[0], "->", answers[0])
print(model.to_str_tokens(tokens[0]))

original_logits, cache = model.run_with_cache(tokens)


def logits_to_ave_logit_diff(logits, answer_tokens, per_prompt=False):
    final_logits = logits[:, -1, :]
    answer_logits = final_logits.gather(dim=-1, index=answer_tokens)
    answer_logit_diff = answer_logits[:, 0] - answer_logits[:, 1]
    return answer_logit_diff if per_prompt else answer_logit_diff.mean()


original_average_logit_diff = logits_to_ave_logit_diff(original_logits, answer_tokens)
print("Per prompt logit difference:", logits_to_ave_logit_diff(original_logits, answer_tokens, per_prompt=True))
print("Average logit difference:", original_average_logit_diff.item())

# -- direct logit attribution ---------------------------------------------------------------------------------------
answer_residual_directions = model.tokens_to_residual_directions(answer_tokens)
correct_residual_directions, incorrect_residual_directions = answer_residual_directions.unbind(dim=1)
logit_diff_directions = correct_residual_directions - incorrect_residual_directions
final_residual_stream = cache["resid_post", -1]
final_token_residual_stream = final_residual_stream[:, -1, :]
scaled_final_token_residual_stream = cache.apply_ln_to_stack(final_token_residual_stream, layer=-1, pos_slice=-1)
average_logit_diff = torch.einsum("bd,bd->", scaled_final_token_residual_stream, logit_diff_directions) / len(prompts)
print("Calculated average logit diff:", average_logit_diff.item(), "original:", original_average_logit_diff.item())


def residual_stack_to_logit_diff(residual_stack, cache):
    scaled_residual_stack = cache.apply_ln_to_stack(residual_stack, layer=-1, pos_slice=-1)
    return torch.einsum("...bd,bd->...", scaled_residual_stack, logit_diff_directions) / len(prompts)


accumulated_residual, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
logit_lens_logit_diffs = residual_stack_to_logit_diff(accumulated_residual, cache)
print("logit lens:", [f"{l} {v:.2f}" for l, v in zip(labels[-5:], logit_lens_logit_diffs[-5:].tolist())])

per_layer_residual, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
per_layer_logit_diffs = residual_stack_to_logit_diff(per_layer_residual, cache)
top = per_layer_logit_diffs.abs().topk(4).indices.tolist()
print("per layer:", [f"{labels[i]} {per_layer_logit_diffs[i].item():.2f}" for i in top])

per_head_residual, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
per_head_logit_diffs = residual_stack_to_logit_diff(per_head_residual, cache)
per_head_logit_diffs = per_head_logit_diffs.reshape(model.cfg.n_layers, model.cfg.n_heads)
top_positive = per_head_logit_diffs.flatten().topk(3).indices.tolist()
print("top heads:", [f"L{i // model.cfg.n_heads}H{i % model.cfg.n_heads}" for i in top_positive])

# -- attention of the top heads -------------------------------------------------------------------------------------
for index in top_positive:
    layer, head = divmod(index, model.cfg.n_heads)
    if args.attn == "eager":
        pattern = cache["pattern", layer][0, head]
    else:
        pattern = cache.pattern(layer, head)[0, 0]  # CHANGED: the flash path builds no n x n pattern
    str_tokens = model.to_str_tokens(tokens[0])
    print(f"L{layer}H{head} attends from the end to {str_tokens[pattern[-1].argmax().item()]!r}")

# -- activation patching ----------------------------------------------------------------------------------------
corrupted_prompts = []
for i in range(0, len(prompts), 2):
    corrupted_prompts.append(prompts[i + 1])
    corrupted_prompts.append(prompts[i])
corrupted_tokens = model.to_tokens(corrupted_prompts, prepend_bos=True)
corrupted_logits, corrupted_cache = model.run_with_cache(corrupted_tokens, return_type="logits")
corrupted_average_logit_diff = logits_to_ave_logit_diff(corrupted_logits, answer_tokens)
print("Corrupted average logit diff", corrupted_average_logit_diff.item())


def patch_residual_component(corrupted_residual_component, hook, pos, clean_cache):
    corrupted_residual_component[:, pos, :] = clean_cache[hook.name][:, pos, :]
    return corrupted_residual_component


def normalize_patched_logit_diff(patched_logit_diff):
    return (patched_logit_diff - corrupted_average_logit_diff) / (original_average_logit_diff - corrupted_average_logit_diff)


patched_residual_stream_diff = torch.zeros(model.cfg.n_layers, tokens.shape[1], device=model.device)
for layer in range(model.cfg.n_layers):
    for position in range(tokens.shape[1]):
        hook_fn = partial(patch_residual_component, pos=position, clean_cache=cache)
        patched_logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(utils.get_act_name("resid_pre", layer), hook_fn)],
                                              return_type="logits")
        patched_logit_diff = logits_to_ave_logit_diff(patched_logits, answer_tokens)
        patched_residual_stream_diff[layer, position] = normalize_patched_logit_diff(patched_logit_diff)
print("resid_pre patching at the last position, by layer:", patched_residual_stream_diff[::6, -1].tolist())


def patch_head_vector(corrupted_head_vector, hook, head_index, clean_cache):
    corrupted_head_vector[:, :, head_index, :] = clean_cache[hook.name][:, :, head_index, :]
    return corrupted_head_vector


patched_head_z_diff = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, device=model.device)
for layer in range(model.cfg.n_layers):
    for head_index in range(model.cfg.n_heads):
        hook_fn = partial(patch_head_vector, head_index=head_index, clean_cache=cache)
        patched_logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(utils.get_act_name("z", layer, "attn"), hook_fn)],
                                              return_type="logits")
        patched_logit_diff = logits_to_ave_logit_diff(patched_logits, answer_tokens)
        patched_head_z_diff[layer, head_index] = normalize_patched_logit_diff(patched_logit_diff)
best = patched_head_z_diff.flatten().topk(3).indices.tolist()
print("head z patching, top heads:", [f"L{i // model.cfg.n_heads}H{i % model.cfg.n_heads}" for i in best],
      f"{patched_head_z_diff.max().item():.2f}")
