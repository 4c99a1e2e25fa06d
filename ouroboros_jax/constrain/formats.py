"""`response_format` -> a regular expression over the output text.

Accepted forms (OpenAI's, plus a regex form):
- {"type": "json_object"}: any JSON object;
- {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}: an instance of the
  schema (outlines-core's `build_regex_from_schema`);
- {"type": "regex", "pattern": "..."}: text matching the pattern in full;
- {"type": "text"} or None: no constraint.

Every refusal is a `ConstraintError` naming the field (`response_format.json_schema.schema`),
which the server answers with a 400.
"""

from __future__ import annotations

import json
from typing import Any, Optional

INSTALL = 'pip install "ouroboros-jax[structured]"  (or: pip install outlines-core)'

# JSON whitespace between tokens: at most one space (outlines-core's default is the same rule;
# stated here so the regex of a schema is a pure function of the schema)
WHITESPACE = r"[ ]?"

# Any JSON object, nesting bounded (a finite automaton cannot count brackets): values are
# scalars, or arrays/objects of scalars, two levels down.
_STR = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'
_NUM = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_SCALAR = rf"({_STR}|{_NUM}|true|false|null)"


def _container(value: str) -> str:
    w = WHITESPACE
    arr = rf"\[{w}({value}({w},{w}{value})*)?{w}\]"
    obj = rf"\{{{w}({_STR}{w}:{w}{value}({w},{w}{_STR}{w}:{w}{value})*)?{w}\}}"
    return arr, obj


def _json_object_regex() -> str:
    arr1, obj1 = _container(_SCALAR)
    level1 = rf"({_SCALAR}|{arr1}|{obj1})"
    _, obj2 = _container(level1)
    return obj2


class ConstraintError(ValueError):
    """A response_format that cannot be honoured; `field` names the part at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def is_constrained(response_format) -> bool:
    """Whether response_format asks for a constraint ({"type": "text"} and None do not)."""
    return not (response_format is None or response_format == {}
                or (isinstance(response_format, dict)
                    and response_format.get("type") == "text" and len(response_format) == 1))


def canonical(response_format) -> str:
    """A hashable key of response_format (sorted JSON), for caches."""
    return json.dumps(response_format, sort_keys=True, separators=(",", ":"))


def regex_for(response_format: Any, field: str = "response_format") -> Optional[str]:
    """response_format (see the module docstring) -> the regex its outputs must match in full,
    or None for no constraint. Raises ConstraintError naming the field at fault."""
    if not is_constrained(response_format):
        return None
    if not isinstance(response_format, dict):
        raise ConstraintError(field, f"must be an object with a 'type', got {response_format!r}")
    kind = response_format.get("type")
    if kind == "json_object":
        return _json_object_regex()
    if kind == "regex":
        pattern = response_format.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError(f"{field}.pattern", "must be a non-empty string")
        _check_pattern(pattern, f"{field}.pattern")
        return pattern
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintError(f"{field}.json_schema",
                                  "must be an object with a 'schema' (OpenAI's form)")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ConstraintError(f"{field}.json_schema.schema", "must be a JSON schema object")
        return schema_regex(schema, f"{field}.json_schema.schema")
    raise ConstraintError(f"{field}.type", f"must be 'text', 'json_object', 'json_schema' or "
                                           f"'regex', got {kind!r}")


def _check_pattern(pattern: str, field: str) -> None:
    import re

    try:
        re.compile(pattern)
    except re.error as e:
        raise ConstraintError(field, f"not a valid regular expression ({e})") from None


# Keywords outlines-core's schema compiler ignores or cannot express: refused by name rather
# than silently dropped (a dropped keyword would let outputs through that the schema refuses).
UNSUPPORTED = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired",
               "patternProperties", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems", "contains", "multipleOf", "uniqueItems")


def _find_unsupported(node, path: str):
    if isinstance(node, dict):
        for k, v in node.items():
            if k in UNSUPPORTED:
                return f"{path}.{k}"
            if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
                for name, sub in v.items():
                    hit = _find_unsupported(sub, f"{path}.{k}.{name}")
                    if hit:
                        return hit
            elif k not in ("enum", "const", "default", "examples", "required"):
                hit = _find_unsupported(v, f"{path}.{k}")
                if hit:
                    return hit
    elif isinstance(node, list):
        for i, v in enumerate(node):
            hit = _find_unsupported(v, f"{path}[{i}]")
            if hit:
                return hit
    return None


def schema_regex(schema: dict, field: str) -> str:
    """A JSON schema -> its regex (outlines-core), after checking the schema against its
    meta-schema (jsonschema, when installed) and refusing keywords the compiler cannot honour."""
    try:
        import jsonschema
    except ImportError:  # validation is best effort; the compiler still refuses what it cannot
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
            raise ConstraintError(field + where, f"not a valid JSON schema ({e.message})") \
                from None
    bad = _find_unsupported(schema, field)
    if bad is not None:
        raise ConstraintError(bad, "this keyword is not supported in a constraint (it cannot be "
                                   "compiled into a finite automaton)")
    try:
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        raise ConstraintError(field, f"structured output needs outlines-core: {INSTALL}") \
            from None
    try:
        return build_regex_from_schema(json.dumps(schema), WHITESPACE)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConstraintError(field, f"cannot be compiled into an automaton ({e})") from None
