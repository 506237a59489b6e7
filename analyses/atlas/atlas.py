"""A head atlas: every head of a model with every registered score that ran, its 95% interval and its label, the
stability of each score's ranking, a causal check of each class, and what is needed to check it again (the model's
weights and tokenizer digests, the versions, the prompts' digests, the settings). ``build_atlas`` returns it as a
dict, ``save_atlas`` / ``load_atlas`` keep it as versioned JSON (``SCHEMA``), ``diff_atlas`` compares two.

Which scores run is read from the registry (``analyses.heads.registry``), nothing listed per score: every score that
applies to the model, except the task-prompted behaviour scores (IOI, ICL: several minutes each on a 135M model on a
CPU), which run when named. The atlas records which scores ran and, for the others, why not.

>>> sorted(diff_atlas(_example(), _example())["changed"])
[]
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pandas as pd
import torch

from interp.runtime.files import atomic_write
from interp.attention.sites import FRONT

from ..data.provenance import identity_changes, model_record, versions
from ..heads import registry
from .class_ablation import class_ablation
from ..heads.detect import detect_heads
from ..heads.labels import choose_scores, resolve_thresholds
from ..heads.scores import labelled

__all__ = ["SCHEMA", "WRITTEN_BY", "atlas_scores", "build_atlas", "diff_atlas", "load_atlas", "save_atlas"]

SCHEMA = 1  # the JSON's layout; load_atlas refuses another
WRITTEN_BY = "interp atlas"  # the mark of a file we wrote: --force replaces only files that carry it
_ON_REQUEST = ("runs its own task prompts through the model (IOI or ICL tasks; minutes per model on a CPU): not run "
               "by default, name it in scores to run it")


def atlas_scores(model, scores=None) -> tuple[list, dict[str, str]]:
    """The registry records the atlas runs on ``model`` and ``{name: why not}`` for every other registered score.
    scores: names to run (refused as ``detect_heads`` refuses them), or None: every score that applies to one of
    the model's sites, but the task-prompted behaviour scores (``_ON_REQUEST``). A score that needs what the model
    lacks (an unembedding, a causal LM) is found out when it runs, and moved to the second list then."""
    if scores is not None:
        chosen = choose_scores(scores, model)
    else:
        everything = choose_scores(None, model) + [r for r in registry.scores() if not r.default]
        chosen = []
        for r in everything:
            try:
                choose_scores([r.name], model)
            except (TypeError, ValueError):
                continue
            if not (r.how == "behaviour" and r.prompts == "task"):
                chosen.append(r)
    names = {r.name for r in chosen}
    skipped = {}
    for r in registry.scores():
        if r.name in names:
            continue
        if scores is not None:
            skipped[r.name] = "not asked for"
        elif r.how == "behaviour" and r.prompts == "task":
            skipped[r.name] = _ON_REQUEST
        else:
            try:
                choose_scores([r.name], model)
                skipped[r.name] = "not a default score"
            except (TypeError, ValueError) as err:
                skipped[r.name] = _first_sentence(err)
    return [r for r in registry.scores() if r.name in names], skipped


def _first_sentence(err: BaseException) -> str:
    text = str(err.args[0] if err.args else err).strip()
    return text.split(". ")[0].rstrip(".")


# -- building --------------------------------------------------------------------------------------------------
def build_atlas(model, scores=None, n_prompts: int = 64, seq_len: int = 64, context: int = 1024, seed: int = 0,
                draws: int = 10, n_bootstrap: int = 1000, source: str | None = None, strict: bool | None = None) -> dict:
    """The atlas of ``model`` as a dict (``save_atlas`` writes it).

    scores: registered score names, or None (``atlas_scores``' choice). n_prompts, seq_len: the attention-pattern
    scores' generated prompts; context: retrieval's longest haystack (cut to the model's positions); seed: the
    prompts, the bootstrap and the random heads; draws: random head sets per class in the causal check
    (``analyses.atlas.class_ablation``); source: how the model was named when loaded (the atlas's ``model.source``).
    strict: a score that fails on this model is an error (default: when ``scores`` were named); otherwise it is
    recorded under ``not_run`` with the reason."""
    strict = scores is not None if strict is None else strict
    t0, cpu0 = time.perf_counter(), time.process_time()
    records, not_run = atlas_scores(model, scores)
    if model.cfg.max_positions is not None:  # None: no position limit in the config (T5's relative buckets)
        context = min(context, model.cfg.max_positions)
    pattern = [r.name for r in records if r.how in ("target", "argmax")]
    groups = [pattern] if pattern else []
    by_runner: dict[str, list[str]] = {}
    for r in records:
        if r.how in ("weights", "behaviour"):
            by_runner.setdefault(r.runner, []).append(r.name)
    groups += list(by_runner.values())
    frames, attrs, ran = [], {"inputs": {}, "stability": {}, "prompt_sha256": {}}, []

    def run(names: list[str]) -> None:
        """Score ``names`` together; where that fails (not strict), each alone, so that one score's failure (a
        user's rule that raises) leaves the others' values and gives its own reason."""
        needle = any(registry.score(n).prompts == "needle" for n in names)
        # ours fail only for what the model lacks; a user's rule may raise anything
        caught = (TypeError, ValueError, NotImplementedError) if all(registry.score(n).builtin for n in names) \
            else Exception
        try:
            df = detect_heads(model, scores=names, n_prompts=n_prompts, seed=seed, n_bootstrap=n_bootstrap,
                              seq_len=seq_len if set(names) <= set(pattern) else None,
                              context=context if needle else None)
        except caught as err:
            if strict:
                raise
            if len(names) > 1:
                for name in names:
                    run([name])
            else:
                not_run[names[0]] = _first_sentence(err)
            return
        ran.extend(names)
        frames.append(df.drop(columns=["label", "labels"]).set_index(FRONT))
        for key in attrs:
            attrs[key].update(df.attrs.get(key) or {})

    for names in groups:
        run(names)
    if not frames:
        raise ValueError(f"No score ran on this model; the reasons: {not_run}.")
    table = pd.concat(frames, axis=1).reset_index()
    limits = resolve_thresholds(None)
    table = labelled(table, limits)
    causal = class_ablation(model, table, seed=seed, draws=draws)
    atlas = {
        "schema": SCHEMA, "written_by": WRITTEN_BY, "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": model_record(model, source),
        "versions": versions(model),
        "settings": {"seed": seed, "n_prompts": n_prompts, "seq_len": seq_len, "context": context,
                     "n_bootstrap": n_bootstrap, "draws": draws, "dtype": str(next(model.hf.parameters()).dtype),
                     "device": str(model.device)},
        "scores": {n: _score_record(n, attrs, limits) for n in registry.names() if n in ran},
        "not_run": {n: why for n, why in not_run.items() if n not in ran},
        "heads": _head_rows(table),
        "causal": causal if causal is not None else {
            "not_run": "the check ablates a class against random heads on the in-context gain of a causal LM "
                       "(repeated random tokens); this model is not a causal LM with an output layer"},
        "cost": {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - cpu0, 1),
                 "threads": torch.get_num_threads()},
    }
    return atlas


def _score_record(name: str, attrs: dict, limits: dict) -> dict:
    r = registry.score(name)
    return {"definition": r.definition, "citation": r.citation, "how": r.how, "prompts": r.prompts,
            "column": r.label_column,
            "label": r.gives if r.threshold is not None else None, "threshold": limits.get(name),
            "inputs": attrs["inputs"].get(name), "prompt_sha256": attrs["prompt_sha256"].get(name),
            "stability": _plain(attrs["stability"].get(name))}


def _value_columns(table: pd.DataFrame) -> list[str]:
    """The numeric columns of the scores that ran (a score's value, an argmax score's offset and fraction, a
    runner's extra columns), without the interval columns."""
    skip = set(FRONT) | {"label", "labels"}
    return [c for c in table.columns if c not in skip and not c.endswith(("_lo", "_hi"))
            and pd.api.types.is_numeric_dtype(table[c])]


def _head_rows(table: pd.DataFrame) -> list[dict]:
    columns = _value_columns(table)
    rows = []
    for _, row in table.iterrows():
        values = {}
        for c in columns:
            entry = {"value": _number(row[c])}
            if f"{c}_lo" in table:
                entry.update(lo=_number(row[f"{c}_lo"]), hi=_number(row[f"{c}_hi"]))
            values[c] = entry
        layer = None if pd.isna(row["layer"]) else int(row["layer"])
        rows.append({"site": row["site"], "layer": layer, "head": int(row["head"]),
                     "label": str(row["label"]), "labels": str(row["labels"] or ""), "values": values})
    return rows


def _number(v):
    """A JSON number: NaN and inf as None, whole floats of an integer column kept as floats."""
    if v is None or isinstance(v, str):
        return v
    if pd.isna(v):  # NaN, and pandas' NA of a nullable column (an argmax offset where a score does not apply)
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _plain(value):
    """A stability dict (or anything a runner put in attrs) as plain JSON."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    try:
        return _number(value)
    except (TypeError, ValueError):
        return str(value)


# -- files -----------------------------------------------------------------------------------------------------
def ours(path: str | Path) -> bool:
    """Whether ``path`` is a file this module (or the atlas page) wrote: it carries ``WRITTEN_BY``."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
    except OSError:
        return False
    return f'"written_by": "{WRITTEN_BY}"' in head or f'name="generator" content="{WRITTEN_BY}"' in head


def save_atlas(atlas: dict, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``atlas`` as JSON (whole or not at all). An existing file is replaced only with ``overwrite`` and only
    when it is an atlas we wrote; a file of anyone else's is never replaced."""
    path = Path(path)
    if path.exists() and overwrite and not ours(path):
        raise FileExistsError(f"{str(path)!r} exists and is not a file interp atlas wrote; it is not replaced, even "
                              "with --force: move it away or choose another --out.")
    atlas = {"schema": atlas.get("schema"), "written_by": WRITTEN_BY,
             **{k: v for k, v in atlas.items() if k not in ("schema", "written_by")}}
    return atomic_write(path, json.dumps(_plain(atlas), indent=1, ensure_ascii=False) + "\n", overwrite=overwrite)


def load_atlas(path: str | Path) -> dict:
    """An atlas written by ``save_atlas``; a file of another schema, not UTF-8 JSON, or whose heads are not the rows
    ``save_atlas`` writes (each a dict with site, head, label, labels and values of ``{"value", ...}``) is refused."""
    path = Path(path)
    try:
        atlas = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not JSON ({err.msg} at line {err.lineno}); pass an atlas written by "
                         "`interp atlas`.") from None
    except UnicodeDecodeError:
        raise ValueError(f"{str(path)!r} is not a text (UTF-8) file; pass an atlas JSON written by `interp atlas`.") \
            from None
    if not isinstance(atlas, dict) or "schema" not in atlas or "heads" not in atlas:
        raise ValueError(f"{str(path)!r} is not an atlas (no schema and heads); pass a file written by `interp atlas`.")
    if type(atlas["schema"]) is not int or atlas["schema"] != SCHEMA:  # noqa: E721  (true == 1 is no schema)
        raise ValueError(f"{str(path)!r} is an atlas of schema {atlas['schema']!r}; this interp reads schema "
                         f"{SCHEMA}. Write it again with this version (`interp atlas --model ... --force`).")
    bad = _bad_part(atlas)
    if bad:
        raise ValueError(f"{str(path)!r} is not an atlas as `interp atlas` writes it: {bad}. Write it again.")
    return atlas


def _bad_part(atlas: dict) -> str | None:
    """What in an atlas's sections does not have ``save_atlas``'s layout (a file edited or cut by hand), or None."""
    for key in ("scores", "not_run", "model", "versions", "settings", "causal", "cost"):
        if not isinstance(atlas.get(key, {}), dict):
            return f"{key} is {type(atlas[key]).__name__}, not an object"
    if not isinstance(atlas["heads"], list):
        return f"heads is {type(atlas['heads']).__name__}, not a list"
    for i, h in enumerate(atlas["heads"]):
        if not isinstance(h, dict) or not {"site", "head", "label", "labels", "values"} <= set(h):
            return f"head row {i} lacks site, head, label, labels or values"
        if not _whole(h["head"]) or not (h.get("layer") is None or _whole(h["layer"])):
            return f"head row {i} has layer {h.get('layer')!r} and head {h['head']!r}, not integers"
        if not isinstance(h["values"], dict) or not all(isinstance(v, dict) and all(
                x is None or type(x) in (int, float, bool) for x in v.values()) for v in h["values"].values()):
            return f"head row {i}'s values are not {{column: {{value, lo, hi}}}} numbers"
    return None


def _whole(x) -> bool:
    return type(x) in (int, float) and float(x).is_integer()  # noqa: E721  (a JSON number; never true or "0")


# -- comparing -------------------------------------------------------------------------------------------------
def diff_atlas(a: dict, b: dict) -> dict:
    """What changed from atlas ``a`` (the reference) to ``b``: ``changed``, one entry per head whose primary label or
    classes differ, or one of whose values in ``b`` lies outside ``a``'s 95% interval (or a value without interval
    that differs by more than 1e-6); ``missing``: heads, scores and values of ``a`` that ``b`` lacks; ``added``:
    heads, and values of a head, that only ``b`` has; ``notes``: what differs in the inputs (digests, versions,
    settings, prompts) and scores only ``b`` has. Nothing in ``changed``, ``missing`` and ``added``: the atlases
    agree."""
    changed, missing, added, notes = [], [], [], identity_changes(a, b)
    for key in sorted(set(a.get("settings", {})) | set(b.get("settings", {}))):
        if a.get("settings", {}).get(key) != b.get("settings", {}).get(key):
            notes.append(f"setting {key}: {a['settings'].get(key)} -> {b['settings'].get(key)}")
    for name, record in a.get("scores", {}).items():
        other = b.get("scores", {}).get(name)
        if other is None:
            missing.append(f"score {name} (in the first atlas only)")
        elif record.get("prompt_sha256") != other.get("prompt_sha256"):
            notes.append(f"score {name}: other prompts ({record.get('inputs')} -> {other.get('inputs')})")
    notes += [f"score {n}: in the second atlas only" for n in b.get("scores", {}) if n not in a.get("scores", {})]
    mine, theirs = ({(h["site"], h["head"]): h for h in atlas["heads"]} for atlas in (a, b))
    columns = [{c for h in atlas["heads"] for c in h["values"]} for atlas in (a, b)]  # each atlas's value columns
    missing += [f"value {c} (in the first atlas only)" for c in sorted(columns[0] - columns[1])
                if f"score {c} (in the first atlas only)" not in missing]
    added += [f"head {_head_name(h)}" for key, h in theirs.items() if key not in mine]
    for h in a["heads"]:
        name, other = _head_name(h), theirs.get((h["site"], h["head"]))
        if other is None:
            missing.append(f"head {name}")
            continue
        missing += [f"head {name} value {c}" for c in h["values"] if c in columns[1] and c not in other["values"]]
        added += [f"head {name} value {c}" for c in other["values"] if c in columns[0] and c not in h["values"]]
        why = []
        if (h["label"], h["labels"]) != (other["label"], other["labels"]):
            why.append(f"label {h['labels'] or h['label']} -> {other['labels'] or other['label']}")
        for column, entry in h["values"].items():
            if column not in other["values"]:
                continue  # in missing
            new = other["values"][column].get("value")
            old, lo, hi = entry.get("value"), entry.get("lo"), entry.get("hi")
            if (new is None) != (old is None):
                why.append(f"{column} {old} -> {new}")
            elif new is None:
                continue
            elif lo is not None and hi is not None:
                if not lo - 1e-9 <= new <= hi + 1e-9:
                    why.append(f"{column} {new:.4f} outside [{lo:.4f}, {hi:.4f}]")
            elif abs(new - old) > 1e-6:
                why.append(f"{column} {old:.4f} -> {new:.4f}")
        if why:
            changed.append({"head": name, "site": h["site"], "what": why})
    return {"changed": changed, "missing": missing, "added": added, "notes": notes}


def _head_name(h: dict) -> str:
    return f"{h['site']}.{h['head']}" if h.get("layer") is None else f"{int(h['layer'])}.{h['head']}"


def _example() -> dict:
    """A two-head atlas, for the docstring's example."""
    heads = [{"site": "blocks.0.attn", "layer": 0.0, "head": h, "label": label, "labels": label,
              "values": {"sink": {"value": v, "lo": v - 0.1, "hi": v + 0.1}}} for h, label, v in ((0, "sink", 0.9),
                                                                                                    (1, "none", 0.1))]
    return {"schema": SCHEMA, "scores": {"sink": {}}, "heads": heads}
