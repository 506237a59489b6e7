"""TransformerLens's Main Demo, step by step, as a TransformerLens user writes it, on interp (issue 37).

Written from TransformerLens's demos/Main_Demo.ipynb outline, not copied; loading lines differ (SmolLM2-135M for
GPT-2 small), and each other changed line says why in a CHANGED comment (``notebooks/transformerlens.md``).

    python notebooks/tl_demos/main_demo.py --attn flash      # or eager; --device cuda --dtype bfloat16
"""

from functools import partial

import torch

from interp import HookedTransformer, utils  # loading: was `from transformer_lens import HookedTransformer, utils`
from options import options  # --attn, --device, --dtype (and no gradients, as the demos set)

args = options()

# -- loading and running ---------------------------------------------------------------------------------------
model = HookedTransformer.from_pretrained("smollm2", attn=args.attn, device=args.device, dtype=args.dtype)  # loading
print(model.cfg.n_layers, "layers,", model.cfg.n_heads, "heads, d_model", model.cfg.d_model)

model_description_text = """## Loading Models

HookedTransformer comes loaded with many models. Let's load one and run it on this text. The model should predict
each next token of this text well, since it has seen text like this during training."""
loss = model(model_description_text, return_type="loss")
print("Model loss:", loss.item())

# -- caching activations ---------------------------------------------------------------------------------------
text = "Natural language processing tasks, such as question answering, machine translation, reading comprehension."
tokens = model.to_tokens(text)
logits, cache = model.run_with_cache(tokens, remove_batch_dim=True)
print(cache)
str_tokens = model.to_str_tokens(text)
print(str_tokens[:8])
if args.attn == "eager":
    attention_pattern = cache["pattern", 0, "attn"]
else:
    attention_pattern = cache.pattern(0)  # CHANGED: the flash path builds no n x n pattern; cache.pattern rebuilds it
print("layer 0 pattern", tuple(attention_pattern.shape))

# -- hooks: ablate one head's values -----------------------------------------------------------------------------
layer_to_ablate = 0
head_index_to_ablate = 2  # CHANGED: hook_v is per key/value head (SmolLM2 has 3, grouped-query attention)


def head_ablation_hook(value, hook):
    value[:, :, head_index_to_ablate, :] = 0.0
    return value


original_loss = model(tokens, return_type="loss")
ablated_loss = model.run_with_hooks(tokens, return_type="loss",
                                    fwd_hooks=[(utils.get_act_name("v", layer_to_ablate), head_ablation_hook)])
print(f"Original loss {original_loss.item():.3f}, ablated loss {ablated_loss.item():.3f}")

# -- activation patching on the residual stream -------------------------------------------------------------------
clean_prompt = "After John and Mary went to the store, Mary gave a bottle of milk to"
corrupted_prompt = "After John and Mary went to the store, John gave a bottle of milk to"
clean_tokens = model.to_tokens(clean_prompt)
corrupted_tokens = model.to_tokens(corrupted_prompt)


def logits_to_logit_diff(logits, correct_answer=" John", incorrect_answer=" Mary"):
    correct_index = model.to_single_token(correct_answer)
    incorrect_index = model.to_single_token(incorrect_answer)
    return logits[0, -1, correct_index] - logits[0, -1, incorrect_index]


clean_logits, clean_cache = model.run_with_cache(clean_tokens)
print("Clean logit diff:", logits_to_logit_diff(clean_logits).item())
corrupted_logits = model(corrupted_tokens)
print("Corrupted logit diff:", logits_to_logit_diff(corrupted_logits).item())


def residual_stream_patching_hook(resid_pre, hook, position):
    clean_resid_pre = clean_cache[hook.name]
    resid_pre[:, position, :] = clean_resid_pre[:, position, :]
    return resid_pre


num_positions = len(clean_tokens[0])
ioi_patching_result = torch.zeros((model.cfg.n_layers, num_positions), device=model.device)
for layer in range(model.cfg.n_layers):
    for position in range(num_positions):
        temp_hook_fn = partial(residual_stream_patching_hook, position=position)
        patched_logits = model.run_with_hooks(corrupted_tokens,
                                              fwd_hooks=[(utils.get_act_name("resid_pre", layer), temp_hook_fn)])
        ioi_patching_result[layer, position] = logits_to_logit_diff(patched_logits).detach()
best = ioi_patching_result.flatten().argmax().item()
print("patching: best (layer, position)", divmod(best, num_positions), f"{ioi_patching_result.max().item():.2f}")

# -- induction heads ----------------------------------------------------------------------------------------------
batch_size, seq_len = 4, 50
size = (batch_size, seq_len)
input_tensor = torch.randint(1000, 10000, size)
random_tokens = input_tensor.to(model.device)
repeated_tokens = torch.cat([random_tokens, random_tokens], dim=1)
repeated_logits = model(repeated_tokens)
correct_log_probs = model.loss_fn(repeated_logits, repeated_tokens, per_token=True)
loss_by_position = correct_log_probs.mean(0)
print(f"loss on the first half {loss_by_position[:seq_len - 1].mean().item():.2f}, "
      f"second half {loss_by_position[seq_len:].mean().item():.2f}")

induction_score_store = torch.zeros((model.cfg.n_layers, model.cfg.n_heads), device=model.device)


def induction_score_hook(pattern, hook):
    induction_stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
    induction_score = induction_stripe.mean(-1).mean(0)
    induction_score_store[hook.layer(), :] = induction_score


pattern_hook_names_filter = lambda name: name.endswith("pattern")  # noqa: E731
if args.attn == "eager":
    model.run_with_hooks(repeated_tokens, return_type=None,
                         fwd_hooks=[(pattern_hook_names_filter, induction_score_hook)])
else:  # CHANGED: no pattern hook on the flash path; the same score from cache.pattern, layer by layer
    _, rep_cache = model.run_with_cache(repeated_tokens, return_type=None)  # CHANGED: (as above)
    for layer in range(model.cfg.n_layers):  # CHANGED: (as above)
        induction_score_store[layer] = rep_cache.pattern(layer).diagonal(dim1=-2, dim2=-1, offset=1 - seq_len).mean(-1).mean(0)  # CHANGED: (as above)
top = induction_score_store.flatten().topk(3).indices.tolist()
print("top induction heads", [divmod(i, model.cfg.n_heads) for i in top],
      f"score {induction_score_store.max().item():.2f}")

# -- weights and factored matrices ---------------------------------------------------------------------------------
print("W_Q", tuple(model.blocks[0].attn.W_Q.shape), "W_E", tuple(model.W_E.shape), "W_U", tuple(model.W_U.shape))
layer, head_index = divmod(top[0], model.cfg.n_heads)
OV_circuit_all_heads = model.OV
print(OV_circuit_all_heads)
OV_circuit_all_heads_eigenvalues = OV_circuit_all_heads.eigenvalues
OV_copying_score = OV_circuit_all_heads_eigenvalues.sum(dim=-1).real / OV_circuit_all_heads_eigenvalues.abs().sum(dim=-1)
print(f"OV copying score of the top induction head {OV_copying_score[layer, head_index].item():.2f}")
full_OV_circuit = model.W_E @ OV_circuit_all_heads[layer, head_index] @ model.W_U
indices = torch.randint(1000, 10000, (200,))
full_OV_circuit_sample = full_OV_circuit[indices, indices].AB
print("full OV sample diagonal top-1 rate",
      (full_OV_circuit_sample.argmax(dim=-1) == torch.arange(200, device=full_OV_circuit_sample.device)).float().mean().item())
U, S, V = OV_circuit_all_heads[layer, head_index].svd()
print("OV singular values", S[:4].tolist())

# -- generation and tokens ----------------------------------------------------------------------------------------
torch.manual_seed(0)
print(model.generate("The capital of Germany is", max_new_tokens=8, temperature=0.7))
print(model.to_string(model.to_tokens("Hello world")[0]))
print(model.get_token_position(" Mary", clean_prompt, mode="last"))
