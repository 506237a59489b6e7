"""Every causal-LM and masked-LM model type of the installed transformers (with ``--seq2seq``: every
encoder-decoder type), built tiny (tests/tiny.py), loaded with interp on both attention paths and compared with HF.

Each type ends in one of:

- ``parity``: interp loads it; our eager equals HF eager within 1e-6 and our flash equals HF sdpa (HF eager where
  the type has no sdpa) within 1e-5, relative to the output's size, on a padded batch longer than any window;
- ``refused``: interp refuses it with a reason (grouped below);
- ``no tiny model``: transformers itself cannot build or run the tiny config (not interp's doing);
- ``mismatch``: it loads but an output differs beyond tolerance;
- ``crash``: anything else raised by interp (must be 0);
- ``not tried`` (``--seq2seq``): a composite config (speech, audio, multimodal), not built by this sweep.

An encoder-decoder type runs a batch padded in both the source and the target, with its query and key
projections scaled by 3 so that attention (and T5's position bias) is far from uniform. Composite (multimodal)
configs are skipped there.

    python benchmarks/sweep_families.py [--types llama gpt2 ...] [--json out.json]
    python benchmarks/sweep_families.py --seq2seq
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import re
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root: tests.tiny

import interp  # noqa: E402
from interp.tokens.inputs import padded_positions  # noqa: E402
from interp.structure.probe import set_attention_key  # noqa: E402
from tests.tiny import model_class, tiny_model  # noqa: E402

N_POS = 14


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def _batch(causal: bool, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(4, vocab - 1), vocab, (2, N_POS), generator=g)
    mask = torch.ones(2, N_POS, dtype=torch.long)
    if causal:
        mask[1, :5] = 0
    else:
        mask[1, N_POS - 5:] = 0
    return ids, mask


def _out(output) -> torch.Tensor:
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value.float()
    return output[0].float()


def _reference(hf, impl: str):
    """A copy of ``hf`` on HF's ``impl`` attention (eager where the type has no such implementation)."""
    ref = copy.deepcopy(hf)
    try:
        set_attention_key(ref, impl)
    except Exception:  # noqa: BLE001  no sdpa for this type
        set_attention_key(ref, "eager")
    return ref


def _verdict(worst: dict) -> tuple[str, str]:
    """parity or mismatch from ``{attn: (relative error, HF implementation)}``: eager within 1e-6, flash 1e-5."""
    detail = ", ".join(f"{a} {e:.1e} vs HF {r}" for a, (e, r) in worst.items())
    ok = worst["eager"][0] <= 1e-6 and worst["flash"][0] <= 1e-5
    return ("parity" if ok else "mismatch"), detail


def check(model_type: str) -> tuple[str, str]:
    """(outcome, detail) for one model type."""
    try:
        hf = tiny_model(model_type)
        probe = copy.deepcopy(hf)
        set_attention_key(probe, "eager")
        import inspect

        no_cache = {"use_cache": False} if "use_cache" in inspect.signature(probe.forward).parameters else {}
        with torch.no_grad():
            probe(input_ids=torch.ones(1, 4, dtype=torch.long), **no_cache)
    except Exception as err:  # noqa: BLE001  transformers cannot build or run this tiny config
        if getattr(getattr(hf, "config", None), "is_encoder_decoder", False):
            return check_seq2seq(model_type)  # BART's masked-LM class is its conditional-generation model
        return "no tiny model", f"{type(err).__name__}: {err}"
    if hf.config.is_encoder_decoder:
        return check_seq2seq(model_type)
    try:
        ours = interp.load_model(copy.deepcopy(hf), attn="eager")
    except NotImplementedError as err:
        return "refused", str(err)
    except RuntimeError as err:
        if "did not call interp's attention function" in str(err) or "does not dispatch" in str(err):
            return "refused", str(err)
        return "crash", f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001
        return "crash", f"{type(err).__name__}: {err}"
    try:
        ids, mask = _batch(ours.cfg.causal, ours.cfg.vocab_size)
        import inspect

        accepted = inspect.signature(hf.forward).parameters
        kwargs = {"use_cache": False} if "use_cache" in accepted else {}
        if ours.cfg.causal and ours._takes_position_ids:
            kwargs["position_ids"] = padded_positions(mask)
        worst = {}
        for attn, ref_impl in (("eager", "eager"), ("flash", "sdpa")):
            ref = _reference(hf, ref_impl)
            ours.set_attn(attn)
            with torch.no_grad():
                try:
                    expected = _out(ref(input_ids=ids, attention_mask=mask, **kwargs))
                except Exception as err:  # noqa: BLE001  HF itself cannot run the padded batch
                    return "no tiny model", f"HF's own forward fails on a padded batch: {type(err).__name__}: {err}"
                got = _out(ours(ids, mask))
            valid = mask.bool()
            if expected.shape[:2] != ids.shape:  # pooled or per-sequence outputs: compare all
                valid = torch.ones(expected.shape[:2], dtype=torch.bool)
            err = float((expected - got)[valid].abs().max() / expected[valid].abs().max().clamp(min=1e-12))
            worst[attn] = (err, ref.config._attn_implementation)
    except NotImplementedError as err:
        return "refused", str(err)
    except Exception as err:  # noqa: BLE001
        return "crash", f"{type(err).__name__}: {err}"
    return _verdict(worst)


def check_seq2seq(model_type: str) -> tuple[str, str]:
    """(outcome, detail) for one encoder-decoder model type."""
    if getattr(CONFIG_MAPPING[model_type], "sub_configs", None):
        return "not tried", "a composite config (speech/audio/multimodal, or EncoderDecoderModel's pair of configs)"
    g = torch.Generator().manual_seed(0)
    try:
        hf = tiny_model(model_type, cls=model_class(model_type, seq2seq=True))
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if re.search(r"\.(q_proj|k_proj|q|k)\.weight$", name):
                    p.mul_(3)
        vocab = hf.config.vocab_size
        src = torch.randint(min(4, vocab - 1), vocab, (2, N_POS), generator=g)
        tgt = torch.randint(min(4, vocab - 1), vocab, (2, N_POS // 2), generator=g)
        src_mask, tgt_mask = torch.ones_like(src), torch.ones_like(tgt)
        src_mask[1, N_POS - 5:] = 0
        tgt_mask[1, -2:] = 0
        batch = dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
                     use_cache=False)
        probe = copy.deepcopy(hf)
        set_attention_key(probe, "eager")
        with torch.no_grad():
            probe(**batch)
    except Exception as err:  # noqa: BLE001  transformers cannot build or run this tiny config
        return "no tiny model", f"{type(err).__name__}: {err}"
    try:
        ours = interp.load_model(copy.deepcopy(hf), attn="eager")
    except NotImplementedError as err:
        return "refused", str(err)
    except Exception as err:  # noqa: BLE001
        return "crash", f"{type(err).__name__}: {err}"
    worst = {}
    try:
        for attn, ref_impl in (("eager", "eager"), ("flash", "sdpa")):
            ref = _reference(hf, ref_impl)
            ours.set_attn(attn)
            with torch.no_grad():
                expected = _out(ref(**batch))
                got = _out(ours(src, src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask))
            valid = tgt_mask.bool()
            err = float((expected - got)[valid].abs().max() / expected[valid].abs().max().clamp(min=1e-12))
            worst[attn] = (err, ref.config._attn_implementation)
    except NotImplementedError as err:
        return "refused", str(err)
    except Exception as err:  # noqa: BLE001
        return "crash", f"{type(err).__name__}: {err}"
    return _verdict(worst)


def reason(detail: str) -> str:
    """A short group name for a refusal."""
    for pattern, name in ((r"did not call interp's attention|does not dispatch", "does not call the attention interface"),
                          (r"encoder-decoder|cross-attention", "encoder-decoder / cross-attention"),
                          (r"ALiBi|alibi", "ALiBi position bias"),
                          (r"position_bias|relative position", "relative position scores"),
                          (r"not a band", "chunked or block attention mask"),
                          (r"no attention \(hybrid|layers that have no attention|list of blocks", "layers without attention (hybrid) or unusual block lists"),
                          (r"several times per forward", "shared layers"),
                          (r"passes .* to its attention function", "an attention argument interp does not implement"),
                          (r"mixes block kinds", "mixed block kinds")):
        if re.search(pattern, detail):
            return name
    return detail.split(".")[0][:90]


def _isolated(model_type: str, timeout: int, check=check) -> tuple[str, str]:
    """check() in a forked child: a type whose tiny config is still huge cannot take the sweep down with it."""
    import os
    import pickle
    import resource

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read)
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(timeout)
        try:
            result = check(model_type)
        except _Timeout:
            result = ("no tiny model", f"timed out after {timeout} s")
        except MemoryError:
            result = ("no tiny model", "the tiny config still needs more than 16 GiB")
        with os.fdopen(write, "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return "no tiny model", f"the child process died (status {status}), e.g. out of memory"
    return pickle.loads(data)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per model type")
    parser.add_argument("--seq2seq", action="store_true", help="the encoder-decoder types instead")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    if args.seq2seq:
        types = args.types or sorted(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    else:
        types = args.types or sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_MASKED_LM_MAPPING_NAMES))
    results = {}
    start = time.perf_counter()
    for model_type in types:
        results[model_type] = _isolated(model_type, args.timeout, check_seq2seq if args.seq2seq else check)
        print(f"{model_type:32s} {results[model_type][0]:14s} {results[model_type][1][:150]}", flush=True)
    counts = collections.Counter(outcome for outcome, _ in results.values())
    print(f"\n# transformers {transformers.__version__}, torch {torch.__version__}, {len(types)} model types, "
          f"{time.perf_counter() - start:.0f} s")
    for outcome in ("parity", "refused", "mismatch", "crash", "no tiny model", "not tried"):
        print(f"{outcome:14s} {counts.get(outcome, 0)}")
    groups = collections.Counter(reason(d) for o, d in results.values() if o == "refused")
    print("\nrefused, by reason:")
    for name, n in groups.most_common():
        print(f"  {n:3d}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({t: {"outcome": o, "detail": d} for t, (o, d) in results.items()}, f, indent=1)
    return 1 if counts.get("crash", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
