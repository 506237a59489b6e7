"""Saved circuits: a circuit's edges (``edge_attribution``'s rows, highest ``|score|`` first) with what is needed to
check it again, as the head atlas records it (``analyses.data.provenance``: the weights, tokenizer and prompts'
digests, the versions), the method, steps and metric, and the faithfulness curve. ``Circuit.save`` writes it as JSON
(``SCHEMA``) with a digest of its content; ``load_circuit`` refuses a file edited or cut after it was written, a file
of another schema, and, given a model, a circuit of another model; ``diff_circuits`` compares two.

>>> c = _example()
>>> c.top(1)["upstream"].tolist(), c.faithfulness_at(2)
(['blocks.0.attn:1'], 0.625)
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from interp.runtime.files import atomic_write

from ..data.batches import batch_of
from .graph import senders
from ..data.provenance import (batch_digest, identity_changes, model_record, tokenizer_digest, versions,
                               weights_digest)

__all__ = ["SCHEMA", "WRITTEN_BY", "Circuit", "check_model", "circuit_of", "diff_circuits", "load_circuit"]

SCHEMA = 1  # the JSON's layout; load_circuit refuses another
WRITTEN_BY = "interp circuit"
EDGE_COLUMNS = ("upstream", "up_kind", "up_layer", "up_site", "up_head", "downstream", "input", "down_layer",
                "down_site", "down_head", "score")
CURVE_COLUMNS = ("size", "edges", "faithfulness", "lo", "hi")
_AGAIN = "write it again (Circuit.save, or `interp circuit ... --out DIR`)"


@dataclass
class Circuit:
    """A circuit: ``edges`` (one row per edge, ``edge_attribution``'s columns, highest ``|score|`` first; its attrs:
    method, steps, metric, clean and corrupted values), ``provenance`` (model, versions, prompts, method, steps,
    metric, task, the graph's sites ``[name, layer, heads, key/value heads]`` and MLP layers (an encoder-decoder
    model's MLP nodes by name, ``"decoder.mlp.1"``), total edges scored, when), ``curve`` (``faithfulness``'s table,
    its attrs CPR and CMD), or None."""

    edges: pd.DataFrame
    provenance: dict = field(default_factory=dict)
    curve: pd.DataFrame | None = None

    def top(self, n: int) -> pd.DataFrame:
        """The ``n`` highest-``|score|`` edges."""
        return self.edges.iloc[:n]

    def faithfulness_at(self, n: int) -> float | None:
        """The faithfulness of the top ``n`` edges from the saved curve: measured at that size, else the straight
        line between the sizes either side; None outside the measured sizes or without a curve."""
        if self.curve is None or self.curve.empty:
            return None
        size, value = self.curve["size"].to_numpy(float), self.curve["faithfulness"].to_numpy(float)
        if not size.min() <= n <= size.max():
            return None
        return float(np.interp(n, size, value))

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the circuit as JSON, whole or not at all; an existing file is replaced only with ``overwrite`` and
        only when it is a circuit this module wrote."""
        path = Path(path)
        if path.exists() and overwrite and not _ours(path):
            raise FileExistsError(f"{str(path)!r} exists and is not a circuit interp wrote; it is not replaced: move "
                                  "it away or choose another path.")
        body = {"schema": SCHEMA, "written_by": WRITTEN_BY, "provenance": _plain(self.provenance),
                "edges": _frame_json(self.edges), "curve": None if self.curve is None else _frame_json(self.curve)}
        body = {"schema": SCHEMA, "written_by": WRITTEN_BY, "content_sha256": _digest(body), **body}
        return atomic_write(path, json.dumps(body, indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                            overwrite=overwrite)

    def __repr__(self) -> str:
        p = self.provenance
        return (f"Circuit({len(self.edges)} edges of {p.get('total_edges', '?')}, {p.get('method', '?')} on "
                f"{p.get('model', {}).get('name', '?')}, metric {p.get('metric', '?')}; .save(path) writes JSON)")


def circuit_of(model, scores: pd.DataFrame, clean, corrupted, curve: pd.DataFrame | None = None,
               edges: int | None = None, task: str | None = None, source: str | None = None) -> Circuit:
    """A ``Circuit`` of ``model`` from ``edge_attribution``'s frame ``scores`` (its ``edges`` highest ``|score|``
    rows, all by default) computed on ``clean`` and ``corrupted`` (whose digests it records), with ``faithfulness``'s
    ``curve`` when given; ``task`` names the task, ``source`` where the model was loaded from."""
    missing = [c for c in EDGE_COLUMNS if c not in scores]
    if missing or "method" not in scores.attrs:
        raise ValueError(f"circuit_of needs edge_attribution's frame (columns {list(EDGE_COLUMNS)} and its attrs); "
                         f"got one without {missing or ['attrs method']}.")
    order = scores["score"].abs().sort_values(ascending=False, kind="stable").index
    kept = scores.loc[order[:edges] if edges is not None else order].reset_index(drop=True)
    kept.attrs = dict(scores.attrs)
    a = scores.attrs
    clean, corrupted = batch_of(model, clean), batch_of(model, corrupted)
    provenance = {
        "model": model_record(model, source), "versions": versions(model),
        "method": a["method"], "steps": a.get("steps"), "metric": a.get("metric"), "task": task,
        "prompts": {"n": int(clean["input_ids"].shape[0]), "clean_sha256": batch_digest(clean),
                    "corrupted_sha256": batch_digest(corrupted)},
        "metric_values": {"clean": a.get("clean"), "corrupted": a.get("corrupted")},
        "graph": {"sites": [[s.name, s.block, s.n_heads, s.n_kv_heads] for s in model.cfg.sites],
                  "mlp": [u.name if u.stack else u.layer for u in senders(model) if u.kind == "mlp"]},
        "total_edges": len(scores), "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    return Circuit(kept, provenance, curve)


# -- files -----------------------------------------------------------------------------------------------------
def _ours(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f'"written_by": "{WRITTEN_BY}"' in f.read(4096)
    except OSError:
        return False


def _digest(body: dict) -> str:
    """sha256 of the body's canonical JSON (keys sorted, no spaces): what ``load_circuit`` checks again."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _cell(v):
    """A JSON value of a frame's cell: numpy scalars as Python's, a non-finite float as its name (restored by the
    column's float dtype)."""
    if isinstance(v, (np.integer, np.bool_)):
        return v.item()
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else str(float(v))
    return v


def _frame_json(df: pd.DataFrame) -> dict:
    return {"columns": [str(c) for c in df.columns], "dtypes": [str(t) for t in df.dtypes],
            "values": [[_cell(v) for v in df[c].tolist()] for c in df.columns], "attrs": _plain(df.attrs)}


def _frame_of(part: dict, what: str) -> pd.DataFrame:
    columns, dtypes, values = part["columns"], part["dtypes"], part["values"]
    if not len(columns) == len(dtypes) == len(values) or len({len(v) for v in values}) > 1:
        raise ValueError(f"its {what} table has {len(columns)} columns, {len(dtypes)} dtypes and {len(values)} value "
                         "lists of unequal lengths")
    df = pd.DataFrame({c: pd.Series(v, dtype=t) for c, t, v in zip(columns, dtypes, values)}, columns=columns)
    df.attrs = dict(part.get("attrs") or {})
    return df


def _plain(value):
    """Attrs and provenance as plain JSON: numpy numbers as Python's, non-finite floats as None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return str(value)


def load_circuit(path: str | Path, model=None) -> Circuit:
    """A circuit written by ``Circuit.save``. Refused, each in one line saying what was expected, what was found and
    the fix: a file that is not JSON or ends early (truncated), one of another schema, one whose content no longer
    matches the digest it was written with (edited or damaged), and, given ``model``, a circuit found on other
    weights or another tokenizer."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{str(path)!r} is not a text (UTF-8) file; expected a circuit JSON: {_AGAIN}.") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        cut = text.lstrip().startswith("{") and not text.rstrip().endswith("}")  # Circuit.save's last line is "}"
        where = "it ends early: truncated" if cut else f"{err.msg} at line {err.lineno}"
        raise ValueError(f"{str(path)!r} is not a whole circuit JSON ({len(text)} bytes; {where}); expected a file "
                         f"written by Circuit.save: {_AGAIN}.") from None
    if not isinstance(body, dict) or body.get("written_by") != WRITTEN_BY or "edges" not in body:
        raise ValueError(f"{str(path)!r} is not a circuit (expected written_by {WRITTEN_BY!r} and edges); pass a "
                         "file written by Circuit.save or `interp circuit --out DIR`.")
    if type(body.get("schema")) is not int or body["schema"] != SCHEMA:  # noqa: E721  (true == 1 is no schema)
        raise ValueError(f"{str(path)!r} is a circuit of schema {body.get('schema')!r}; this interp reads schema "
                         f"{SCHEMA}: {_AGAIN} with this version.")
    recorded = body.pop("content_sha256", None)
    found = _digest(body)
    if recorded != found:
        raise ValueError(f"{str(path)!r} was changed after it was written: its content's sha256 is {found[:16]}..., "
                         f"the file records {str(recorded)[:16]}...; restore the original or {_AGAIN}.")
    try:
        edges = _frame_of(body["edges"], "edges")
        curve = None if body.get("curve") is None else _frame_of(body["curve"], "faithfulness")
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{str(path)!r} is not a circuit as Circuit.save writes it ({err}); {_AGAIN}.") from None
    missing = [c for c in EDGE_COLUMNS if c not in edges]
    if missing:
        raise ValueError(f"{str(path)!r}'s edges lack the columns {missing}; expected edge_attribution's: {_AGAIN}.")
    circuit = Circuit(edges, body.get("provenance") or {}, curve)
    if model is not None:
        check_model(circuit, model, str(path))
    return circuit


def check_model(circuit: Circuit, model, where: str = "this circuit") -> None:
    """Refuse, in one line, a model whose weights or tokenizer are not those the circuit was found on."""
    record = circuit.provenance.get("model", {})
    mine = {"weights_sha256": weights_digest(model), "tokenizer_sha256": tokenizer_digest(model)}
    for key, what in (("weights_sha256", "weights"), ("tokenizer_sha256", "tokenizer")):
        if record.get(key) != mine[key]:
            raise ValueError(f"{where} is a circuit of {record.get('name', 'another model')!r} ({what} sha256 "
                             f"{str(record.get(key))[:16]}...); this model's {what} are {str(mine[key])[:16]}...: "
                             "load it with the model it was found on, or find the circuit again on this one.")


def diff_circuits(a: Circuit, b: Circuit, rtol: float = 1e-6) -> tuple[pd.DataFrame, list[str]]:
    """What changed from circuit ``a`` to ``b``: one row per edge (``upstream``, ``downstream``) only one has
    (``change`` "added": only in ``b``; "removed": only in ``a``) or whose score moved by more than ``rtol`` of the
    larger ``|score|`` ("changed"), with ``score_a``, ``score_b``, ``rank_a``, ``rank_b`` (1 = highest
    ``|score|``); and notes on what differs in their provenance (digests, versions, method, steps, metric,
    prompts)."""
    def keyed(c: Circuit) -> pd.DataFrame:
        df = c.edges[["upstream", "downstream", "score"]].copy()
        df["rank"] = np.arange(1, len(df) + 1)
        return df.set_index(["upstream", "downstream"])

    x, y = keyed(a), keyed(b)
    both = x.join(y, how="outer", lsuffix="_a", rsuffix="_b")
    change = np.where(both["score_a"].isna(), "added", np.where(both["score_b"].isna(), "removed", ""))
    moved = (both["score_a"] - both["score_b"]).abs() > rtol * np.maximum(both["score_a"].abs(), both["score_b"].abs())
    change = np.where((change == "") & moved.to_numpy(), "changed", change)
    both["change"] = change
    out = both[both["change"] != ""].reset_index()
    out = out[["change", "upstream", "downstream", "score_a", "score_b", "rank_a", "rank_b"]]
    out["rank_a"], out["rank_b"] = out["rank_a"].astype("Int64"), out["rank_b"].astype("Int64")
    order = {"removed": 0, "added": 1, "changed": 2}
    out = out.sort_values(["change", "rank_a", "rank_b"], key=lambda s: s.map(order) if s.name == "change" else s,
                          kind="stable").reset_index(drop=True)
    pa, pb = a.provenance, b.provenance
    notes = identity_changes(pa, pb)
    notes += [f"{k}: {pa.get(k)} -> {pb.get(k)}" for k in ("method", "steps", "metric", "task") if pa.get(k) != pb.get(k)]
    notes += [f"prompts {k}: {pa.get('prompts', {}).get(k)} -> {pb.get('prompts', {}).get(k)}"
              for k in ("n", "clean_sha256", "corrupted_sha256")
              if pa.get("prompts", {}).get(k) != pb.get("prompts", {}).get(k)]
    return out, notes


def _example() -> Circuit:
    """A three-edge circuit with a two-point curve, for the docstring's example."""
    rows = [("blocks.0.attn:1", "head", 0, "blocks.0.attn", 1, "blocks.1.attn:0.k", "k", 1, "blocks.1.attn", 0, 0.9),
            ("input", "input", -1, "", -1, "logits", "logits", 2, "", -1, -0.5),
            ("blocks.1.attn:0", "head", 1, "blocks.1.attn", 0, "logits", "logits", 2, "", -1, 0.2)]
    curve = pd.DataFrame({"size": [1, 3], "edges": [1, 3], "faithfulness": [0.25, 1.0], "lo": [0.2, 0.9],
                          "hi": [0.3, 1.1]})
    return Circuit(pd.DataFrame(rows, columns=list(EDGE_COLUMNS)), {"method": "eap-ig"}, curve)
