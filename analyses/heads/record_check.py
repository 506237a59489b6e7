"""What a head-score record must hold, checked whole when it is registered (``analyses.heads.registry.register``):
every field's type and value, so that a bad record is refused there in one line that says what is accepted, and
never later, inside ``detect_heads``."""

from __future__ import annotations

import inspect

HOWS = ("target", "argmax", "weights", "behaviour")
PROMPTS = ("repeated", "corpus", "task", "needle", "weights")
RULE_ARGS = ("ids", "key_ids", "tokenizer")
NEEDS = ("tokenizer", "unembedding")
CHECKS = ("copy", "ioi", "needle", "ordinal", "suppression")  # the behaviours analyses.atlas.class_ablation tests


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _strings(v) -> bool:
    return isinstance(v, tuple) and all(isinstance(s, str) for s in v)


def _dotted(v) -> bool:  # "module:function"
    return isinstance(v, str) and v.count(":") == 1 and all(p.strip() for p in v.split(":"))


def check_record(record, site_kinds: tuple[str, ...]) -> None:
    """Raise ValueError naming the score, the field, what it accepts and what it got; None when all is well."""
    def bad(what: str) -> ValueError:
        return ValueError(f"head score {record.name!r}: {what}.")

    if not isinstance(record.name, str) or not record.name.isidentifier():
        raise bad(f"its name must be an identifier (a column name such as 'punctuation'); got {record.name!r}")
    for key in ("definition", "citation"):
        if not isinstance(getattr(record, key), str):
            raise bad(f"{key} is a string; got {getattr(record, key)!r}")
    if record.how not in HOWS:
        raise bad(f"how is one of {HOWS}; got {record.how!r}")
    if not _strings(record.sites) or not record.sites or any(s not in site_kinds for s in record.sites):
        raise bad(f"sites are some of {site_kinds}, as a tuple; got {record.sites!r}")
    if record.prompts not in PROMPTS:
        raise bad(f"prompts is one of {PROMPTS}; got {record.prompts!r}")
    if record.threshold is not None and not (_number(record.threshold) and 0 < record.threshold <= 1):
        raise bad(f"threshold is a fraction in (0, 1] or None (no label); got {record.threshold!r}")
    if not isinstance(record.precedence, int) or isinstance(record.precedence, bool):
        raise bad(f"precedence is an integer (lower: more specific; the literature's classes are 10-15, the pattern "
                  f"classes 20-26, a user's default 19); got {record.precedence!r}")
    if not _strings(record.needs) or any(n not in NEEDS for n in record.needs):
        raise bad(f"needs is a tuple of some of {NEEDS}; got {record.needs!r}")
    for key in ("label", "column"):
        value = getattr(record, key)
        if value is not None and not (isinstance(value, str) and value.isidentifier()):
            raise bad(f"{key} is None or an identifier; got {value!r}")
    for key in ("default", "builtin"):
        if not isinstance(getattr(record, key), bool):
            raise bad(f"{key} is True or False; got {getattr(record, key)!r}")
    if record.fraction is not None and not isinstance(record.fraction, bool):
        raise bad(f"fraction is True, False or None; got {record.fraction!r}")
    if not _strings(record.extra):
        raise bad(f"extra is a tuple of column names; got {record.extra!r}")
    if record.check is not None and record.check not in CHECKS:
        raise bad(f"check is None or one of {CHECKS}; got {record.check!r}")
    if record.runner is not None and not _dotted(record.runner):
        raise bad(f"runner is None or 'module:function'; got {record.runner!r}")
    if record.how in ("weights", "behaviour") and record.runner is None:
        raise bad(f"a {record.how} score needs runner='module:function' (what computes it)")
    if isinstance(record.rule, str):
        if not _dotted(record.rule):
            raise bad(f"rule is a function or 'module:function'; got {record.rule!r}")
    elif record.rule is not None and not callable(record.rule):
        raise bad(f"rule is a function; got {record.rule!r}")
    if record.how == "target" and not isinstance(record.rule, str):
        if not callable(record.rule):
            raise bad("a target-rule score needs a function (rule=)")
        params = inspect.signature(record.rule).parameters
        if not set(params) & set(RULE_ARGS) or any(p not in RULE_ARGS and v.default is inspect.Parameter.empty
                                                  for p, v in params.items()):
            raise bad(f"its function takes some of {RULE_ARGS} by name; it takes {list(params)}")
