"""DuoAttention-style gates (``analyses.long.streaming_gates``, issue 26): on the trained toy model, whose induction heads
(layer 1) copy a token ``len(x)`` positions back and whose layer-0 heads look one token back, the gates keep the
induction heads full and let layer 0 stream; with a window that covers every row, every gate streams."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import second_copy_loss, streaming_curve, streaming_gates, streaming_order
from analyses.data.toy import repeated_sequences

INDUCTION = [(1, 0), (1, 1), (1, 3)]  # the toy model's induction heads (analyses.causal.ablation's doctest)


@pytest.fixture(scope="module")
def toy():
    return interp.load_model("toy-induction", attn="flash")


def _copy_task(model, n=8, half=31):
    ids = repeated_sequences(n, half, model.cfg.vocab_size, torch.Generator().manual_seed(0),
                             model.hf.config.bos_token_id)
    positions = torch.zeros_like(ids, dtype=torch.bool)
    positions[:, half + 1:-1] = True  # the second copy: predicted by looking len(x) tokens back
    return ids, positions


def test_gates_keep_the_heads_that_need_the_long_context(toy):
    ids, positions = _copy_task(toy)
    before = toy(ids).logits
    state = {k: v.clone() for k, v in toy.hf.state_dict().items()}
    flags = [p.requires_grad for p in toy.hf.parameters()]
    df = streaming_gates(toy, ids, positions, sink=1, window=8, steps=100)
    gate = {(r.layer, r.head): r.gate for r in df.itertuples()}
    assert max(gate[(0, h)] for h in range(4)) < 0.05  # previous-token heads: all they need is in the window
    assert min(gate[h] for h in INDUCTION) > 0.8
    assert df.attrs["loss_end"] < df.attrs["loss_start"]
    order = streaming_order(toy, order=df)
    assert set(order[:4]) == {(0, 0), (0, 1), (0, 2), (0, 3)} and set(order[-3:]) <= set(INDUCTION) | {(1, 2)}
    # the model as it was: its path, weights, gradients off, no hooks, the same outputs
    assert toy.attn == "flash" and [p.requires_grad for p in toy.hf.parameters()] == flags
    assert all(torch.equal(v, toy.hf.state_dict()[k]) for k, v in state.items())
    assert not toy._registry.active()
    assert torch.equal(toy(ids).logits, before)


def test_a_window_that_covers_every_row_lets_every_gate_stream(toy):
    ids, positions = _copy_task(toy, n=4)
    df = streaming_gates(toy, ids, positions, sink=1, window=64, steps=60)
    assert df.gate.max() < 0.05  # streaming is full attention here: only the L1 term speaks
    assert df.attrs["distance_end"] < 1e-6


def test_the_gate_order_in_a_streaming_curve_and_bad_arguments(toy):
    df = streaming_curve(toy, _copy_task(toy, n=4)[0], second_copy_loss, order="gates", step=0.5, sink=1,
                         window=8)
    assert list(df.order.unique()) == ["gates"] and len(df) == 3
    with pytest.raises(ValueError, match="steps must be"):
        streaming_gates(toy, steps=0)
    with pytest.raises(ValueError, match="window must be"):
        streaming_gates(toy, window=0)
    with pytest.raises(ValueError, match="positions must be"):
        streaming_gates(toy, torch.ones(2, 10, dtype=torch.long), torch.ones(2, 9, dtype=torch.bool))


def test_a_closed_gate_is_exactly_the_streaming_head():
    """alpha = 0 everywhere: the gated model's distance is the distance of the model under stream_heads."""
    from analyses.long.streaming_gates import _distance, _optimise

    model = interp.load_model("toy-induction", attn="eager")
    ids, _ = _copy_task(model, n=4)
    every = torch.ones_like(ids, dtype=torch.bool)
    p = torch.arange(ids.shape[1])
    gap = p[:, None] - p[None]
    drop = (~((p[None, :] < 1) | (gap < 8)))[None, None].expand(len(ids), 1, -1, -1)
    gates = {l: torch.zeros(4, requires_grad=True) for l in range(2)}
    closed = _optimise(model, ids, None, every, drop, gates, 0, 0.1, 0.0)["distance_end"]
    with torch.no_grad():
        full = model(ids).logits
        with interp.stream_heads(model, model.cfg.heads(), sink=1, window=8):
            streamed = model(ids)
    assert closed > 0.5  # streaming every head breaks the copy
    assert closed == pytest.approx(float(_distance(streamed, full, every).mean()), rel=1e-6, abs=0)  # fp32, row by row


def test_gemma3_gates_only_its_full_attention_layers():
    """Gemma 3's sliding-window layers keep a window already and stream_heads refuses them: the gates cover the
    heads of the full-attention layer only (they raised NotImplementedError before), and the model is as it was."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           sliding_window=9, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = interp.load_model(Gemma3ForCausalLM(cfg).eval(), attn="flash")
    ids = torch.randint(1, 99, (2, 24), generator=torch.Generator().manual_seed(0))
    df = streaming_gates(model, ids, sink=1, window=4, steps=3)
    assert sorted(zip(df["layer"], df["head"])) == [(1, h) for h in range(4)]
    assert df.kv_head.eq(0).all() and df.gate.between(0, 1).all()
    assert model.attn == "flash" and not model._registry.active()
    everything_sliding = Gemma3TextConfig(**{**cfg.to_dict(), "layer_types": ["sliding_attention"] * 3})
    with pytest.raises(ValueError, match="no head of this gemma3_text model can stream"):
        streaming_gates(interp.load_model(Gemma3ForCausalLM(everything_sliding).eval()), ids, steps=1)


def test_the_fit_shows_progress_in_a_log(toy, capsys):
    """The fit takes minutes on a real model: a log gets a line when it starts and one when it ends."""
    ids, positions = _copy_task(toy, n=2)
    interp.set_progress("lines")
    try:
        streaming_gates(toy, ids, positions, sink=1, window=8, steps=3)
    finally:
        interp.set_progress(None)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "streaming gates: 3 Adam steps and a last measuring pass: 0/4 pass"
    assert err[-1].startswith("streaming gates: 3 Adam steps and a last measuring pass: 4/4 pass, done in")
