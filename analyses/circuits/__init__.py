"""Circuits of heads (issue 48): a model as a graph of nodes and edges, exact edge patching, edge attribution.

- ``graph``: the nodes (the input, each head's output as ``(site, head)``, each MLP's output) and the edges into
  each downstream input (a head's q, k or v input, under GQA k and v belonging to the key/value head; an MLP's
  input; the logits), as a DataFrame with one row per edge; ``nodes`` holds their data types and ``stacks`` the
  graph of a pre-norm encoder-decoder (T5: two streams, cross-attention's k and v reading the encoder's).
- ``patching``: exact edge patching: a run in which chosen edges carry another run's sender outputs, every
  downstream input recomputed through the receiver's own norm.
- ``postnorm``: post-norm blocks (BERT, MiniLM, RoBERTa, DistilBERT): each node's output carried through every
  later norm with the run's own scale, the constants in the input node, so that the stream is a sum of nodes.
- ``attribution``: EAP and EAP-IG, every edge scored from one backward per interpolation step; ``taps`` holds
  that backward's parts (each receiver's gradient from it, the scores taken during it a few blocks at a time,
  its progress).
- ``evaluation``: circuits chosen from the scores (top-n, threshold, pruned to what reaches the metric), their
  faithfulness curve by exact patching with bootstrap intervals, MIB's CPR and CMD, random circuits of each size.
- ``saved``: a circuit with its provenance (digests of weights, tokenizer and prompts; versions; method, steps,
  metric; the faithfulness curve) as JSON, loaded back exactly and refused for another model or an edited file;
  the diff of two.
- ``compression``: the circuit edges that streaming or pruning a set of heads cuts, the faithfulness the circuit
  keeps without them, beside the task metric under the compression itself.

May import ``hooks``, ``interp`` and the study rooms of ``analyses`` (engine, batches, metrics, patching); nothing
here imports the views or the CLI. Not ``interp.lens.circuits`` (low-rank OV/QK circuits of weights, another meaning).
"""
