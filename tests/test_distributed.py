"""Studies sharded across processes (issue 16): under ``torchrun --nproc_per_node 2`` (gloo, CPU) every sharded study
returns on every rank what one process returns, within 1e-6; a rank that raises makes the whole run fail with its
error instead of hanging; the CLI runs under torchrun unchanged and prints once.

This file is also the worker that torchrun starts: ``python tests/test_distributed.py CASE FOLDER OUT`` runs the
studies of CASE and pickles each rank's results to ``OUT/rank{r}.pkl``.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import interp
from analyses import (activation_patching, attribution_patching, detect_heads, embedding_similarity, head_importance,
                      induction_task, lm_loss, logit_difference, pruning_curve)
from analyses.causal.ablation import ablation_scan
from analyses.data.batches import _main_output
from analyses.data.metrics import Metric, mean_pool
from interp.runtime import distributed
from tests.tiny import model_class, tiny_model

# A rank runs its share of the rows, a batch of another shape, and CPU matrix kernels may sum in another order for
# another shape: HF's own MiniLM forward gives hidden states 6.6e-6 apart (of 5.3) for 3 rows at once and for 2 + 1
# rows (Intel Xeon VM, 2026-11-25). So values agree to fp32 accumulation noise relative to their size (RTOL), not
# to an absolute 1e-6 that is under one fp32 step for values above 8.
TOL, RTOL = 1e-6, 1e-5
HERE = Path(__file__).resolve()
TIMEOUT = 240  # seconds for one torchrun launch: a hang fails the test instead of the CI job


class _Projection(Metric):
    """A per-example metric for encoders under patching: the mean-pooled output on a fixed random direction."""

    name, higher_is_better = "projection", True

    def per_example(self, output, inputs):
        hidden = _main_output(output).float()
        mask = inputs["attention_mask"]
        mask = torch.ones(hidden.shape[:2], device=hidden.device) if mask is None else mask
        direction = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(0)).to(hidden.device)
        return mean_pool(hidden, mask) @ direction


def _logit_mean(output, inputs) -> float:  # a plain callable: a function of the whole batch
    return float(_main_output(output).float().mean())


def tiny_studies(folder) -> dict[str, pd.DataFrame]:
    """Every sharded study on a tiny random Llama, padded batches included."""
    model = interp.load_model(folder)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (7, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[4, :2] = 0  # left padding in two rows
    batch = {"input_ids": ids, "attention_mask": mask}
    prompts = [torch.randint(1, 99, (n,), generator=g) for n in (5, 9, 12, 7, 16, 3, 11, 8, 14)]
    clean, corrupted, loss = induction_task(model, n=5, length=6, seed=0)
    answers = torch.randint(1, 99, (5,), generator=g)
    per_sequence = logit_difference(answers, (answers + 1) % 99)  # one token per sequence: a metric with row state
    return {
        "heads": detect_heads(model, n_prompts=13, seq_len=16, batch_size=3, n_bootstrap=50),
        "heads_prompts": detect_heads(model, prompts=prompts, batch_size=2, n_bootstrap=50),
        "ablation": ablation_scan(model, batch, lm_loss),
        "ablation_one_head": ablation_scan(model, batch, lm_loss, heads_per_forward=1),
        "ablation_resample": ablation_scan(model, batch, lm_loss, method="resample", reference=ids.roll(1, 0)),
        "ablation_mean": ablation_scan(model, batch, lm_loss, method="mean", reference=ids[:3]),
        "ablation_callable": ablation_scan(model, batch, _logit_mean),  # runs whole on every rank
        "importance": head_importance(model, batch, loss=lm_loss),
        "pruning": pruning_curve(model, batch, lm_loss, step=0.25),
        "pruning_ablation": pruning_curve(model, batch, lm_loss, order="ablation", step=0.5),
        "patching": activation_patching(model, clean, corrupted, loss),
        "patching_pos": activation_patching(model, clean, corrupted, per_sequence, by="head_pos", what="q"),
        "attribution": attribution_patching(model, clean, corrupted, loss),
        "attribution_pos": attribution_patching(model, clean, corrupted, per_sequence, by="head_pos"),
    }


def minilm_studies(_folder=None) -> dict[str, pd.DataFrame]:
    """Every sharded study on the real MiniLM (few sentences: this runs in CI)."""
    model = interp.load_model("minilm", device="cpu")
    texts = ["The cat sat on the mat.", "Heads can be read and edited.", "A short one.",
             "Attention heads move information between positions.", "Rain fell all day."]
    similarity = embedding_similarity(model, texts)
    clean = model.to_batch(["The cat sat on the mat.", "The dog ran in the park.", "A bird sang at dawn."])
    corrupted = {**clean, "input_ids": clean["input_ids"].clone()}
    corrupted["input_ids"][:, 2] = torch.tensor([2000, 3000, 4000])  # the second word, same padding
    return {
        "heads": detect_heads(model, n_prompts=6, seq_len=24, batch_size=2, n_bootstrap=50),
        "ablation": ablation_scan(model, texts, similarity),
        "importance": head_importance(model, texts, loss=similarity),
        "pruning": pruning_curve(model, texts, similarity, step=0.5),
        "patching": activation_patching(model, clean, corrupted, _Projection(), heads=[(0, 2), (1, 5), (5, 11)]),
        "attribution": attribution_patching(model, clean, corrupted, _Projection()),
    }


def seq2seq_studies(folder) -> dict[str, pd.DataFrame]:
    """The sharded studies on a tiny T5 (an encoder-decoder: rows per (site, head)), padding on both sides."""
    from analyses.data.seq2seq import copy_patching_task, copy_task
    from analyses.data.metrics import target_loss

    model = interp.load_model(folder)
    batch = copy_task(model, n=7, length=8, seed=0)
    batch["attention_mask"][2, 6:] = 0  # a shorter source
    batch["decoder_attention_mask"] = torch.ones_like(batch["decoder_input_ids"])
    batch["decoder_attention_mask"][4, 5:] = 0  # a shorter target
    batch["labels"] = batch["labels"].masked_fill(batch["decoder_attention_mask"] == 0, -100)
    clean, corrupted, metric = copy_patching_task(model, n=5, length=8, seed=1)  # labels held by the metric
    return {
        "heads": detect_heads(model, n_prompts=7, seq_len=8, n_bootstrap=50),
        "heads_padded": detect_heads(model, prompts=batch, n_bootstrap=50),
        "ablation": ablation_scan(model, batch, target_loss()),
        "ablation_mean": ablation_scan(model, batch, target_loss(), method="mean", reference=batch),
        "importance": head_importance(model, batch, loss=target_loss()),
        "pruning": pruning_curve(model, batch, target_loss(), step=0.5),
        "patching": activation_patching(model, clean, corrupted, metric),
        "attribution": attribution_patching(model, clean, corrupted, metric),
    }


def failing_study(_folder=None) -> dict:
    """Rank 1's metric raises in the middle of a scan; rank 0 must not wait for it."""

    class Broken(Metric):
        name = "broken"

        def per_example(self, output, inputs):
            if distributed.rank() == 1:
                raise ValueError("rank one's metric broke on purpose")
            return lm_loss.per_example(output, inputs)

    model = interp.load_model(tiny_model("llama"))
    ablation_scan(model, torch.randint(1, 99, (4, 8), generator=torch.Generator().manual_seed(0)), Broken())
    return {}


CASES = {"tiny": tiny_studies, "minilm": minilm_studies, "seq2seq": seq2seq_studies, "fail": failing_study}


def _counting_tokens(study, *args) -> tuple[dict, int]:
    """The study's results and the number of token ids its embedding layers looked up (the work it did)."""
    count = [0]

    def hook(module, args):
        if isinstance(module, torch.nn.Embedding):
            count[0] += args[0].numel()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        return study(*args), count[0]
    finally:
        handle.remove()


# -- the worker torchrun starts -------------------------------------------------------------------------------
def _worker(case: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    with distributed.launched():
        results, tokens = _counting_tokens(CASES[case], folder)
        with open(Path(out) / f"rank{distributed.rank()}.pkl", "wb") as f:
            pickle.dump({"results": results, "tokens": tokens}, f)


# -- the tests ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    """The ranks' environment: one thread each, and the repository on the path (this file runs as a script there,
    and imports the tiny models as ``tests.tiny``)."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}


def _torchrun(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env())


def _assert_same(got: dict, expected: dict) -> None:
    """Equal tables: the same columns, labels and NaNs, and numbers within ``TOL + RTOL * scale``, where scale is
    the size of the values a column is computed from (its own, and a patching table's clean and corrupted metric:
    an effect is a difference of such values and carries their rounding)."""
    assert got.keys() == expected.keys()
    for name, df in expected.items():
        other = got[name]
        assert list(other.columns) == list(df.columns), name
        inputs = [abs(df.attrs[key]) for key in ("clean", "corrupted") if key in df.attrs]
        for column in df.columns:
            if pd.api.types.is_numeric_dtype(df[column]) and not pd.api.types.is_bool_dtype(df[column]):
                a, b = df[column].to_numpy(float), other[column].to_numpy(float)
                assert (np.isnan(a) == np.isnan(b)).all(), (name, column)
                scale = np.maximum(np.abs(a), max(inputs, default=0.0))
                excess = np.abs(a - b) - (TOL + RTOL * scale)
                assert np.nanmax(excess, initial=0.0) <= 0, (name, column, np.nanmax(np.abs(a - b)))
            else:
                assert df[column].fillna("<NaN>").tolist() == other[column].fillna("<NaN>").tolist(), (name, column)
        for key in ("clean", "corrupted"):
            if key in df.attrs:
                assert abs(df.attrs[key] - other.attrs[key]) <= TOL + RTOL * abs(df.attrs[key]), (name, key)


def _run_case(case: str, folder, tmp_path) -> tuple[dict, dict]:
    """Each rank's results under torchrun, compared with one process's; each rank must have done part of the work."""
    out = tmp_path / case
    out.mkdir()
    result = _torchrun(str(HERE), case, str(folder), str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    with open(out / "rank0.pkl", "rb") as f0, open(out / "rank1.pkl", "rb") as f1:
        rank0, rank1 = pickle.load(f0), pickle.load(f1)
    with distributed.single_process():
        expected, tokens = _counting_tokens(CASES[case], folder)
    assert max(rank0["tokens"], rank1["tokens"]) < 0.8 * tokens, (rank0["tokens"], rank1["tokens"], tokens)  # split
    _assert_same(rank0["results"], expected)
    _assert_same(rank1["results"], rank0["results"])  # every rank ends with the whole result
    return rank0["results"], expected


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    return folder


def test_sharded_studies_equal_one_process_on_a_tiny_model(tiny_folder, tmp_path):
    rank0, _ = _run_case("tiny", tiny_folder, tmp_path)
    assert rank0["heads"]["induction"].notna().any() and (rank0["ablation"]["delta"].abs() > 1e-4).any()


def test_sharded_studies_equal_one_process_on_minilm(tmp_path):
    rank0, _ = _run_case("minilm", None, tmp_path)
    assert rank0["heads"].set_index(["layer", "head"]).loc[(0, 2), "previous_token"] > 0.9  # MiniLM's known head


def test_sharded_studies_equal_one_process_on_an_encoder_decoder(tmp_path):
    folder = tmp_path / "t5"
    tiny_model("t5", cls=model_class("t5", seq2seq=True)).save_pretrained(folder)
    rank0, _ = _run_case("seq2seq", folder, tmp_path)
    assert list(rank0["ablation"].columns[:3]) == ["stack", "kind", "site"] and (rank0["ablation"]["delta"] != 0).any()


def test_a_rank_that_raises_fails_the_torchrun_with_its_error(tmp_path):
    start = time.monotonic()
    result = _torchrun(str(HERE), "fail", "-", str(tmp_path), timeout=120)
    assert result.returncode != 0
    assert "rank one's metric broke on purpose" in result.stdout + result.stderr
    assert time.monotonic() - start < 120


def test_the_other_ranks_raise_the_failed_rank_error_without_a_launcher(tmp_path):
    """Without torchrun's agent to stop them, the healthy rank still ends, with rank 1's message."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(HERE), "fail", "-", str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] != [0, 0] and all(p.returncode != 0 for p in procs)
    rank0_err = outputs[0][1]
    assert "RankFailed" in rank0_err and "rank 1 failed: ValueError: rank one's metric broke on purpose" in rank0_err
    assert "rank one's metric broke on purpose" in outputs[1][1]


def test_the_cli_runs_under_torchrun_and_prints_once():
    args = ["heads", "--model", "minilm", "--n-prompts", "6", "--format", "csv", "--threads", "1"]
    result = _torchrun("-m", "analyses.cli", *args)
    assert result.returncode == 0, result.stderr[-4000:]
    one = subprocess.run([sys.executable, "-m", "analyses.cli", *args], capture_output=True, text=True, env=_env(),
                         timeout=TIMEOUT)
    assert one.returncode == 0, one.stderr[-4000:]
    assert result.stdout.count("layer,head") == 1  # rank 0 alone prints
    sharded, single = pd.read_csv(io.StringIO(result.stdout)), pd.read_csv(io.StringIO(one.stdout))
    _assert_same({"heads": sharded}, {"heads": single})


def test_without_a_process_group_nothing_is_sharded():
    assert not distributed.initialised() and distributed.shard(10) is None and distributed.rank_zero()
    with distributed.failing_together():  # a no-op
        pass


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
