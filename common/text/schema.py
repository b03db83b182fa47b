"""JSON schema checks for structured output, without torch: the router and the node fronts refuse
a bad schema (HTTP 400 / INVALID_ARGUMENT) with `schema_problem` before any rank sees it; the
sampling rank compiles the same grammar (engine/grammar.py) with the same options.

    schema_problem(json_schema) -> str | None    one line naming the problem; no tokenizer needed
    grammar_of(schema_text) -> str               llguidance's grammar with our options (JSON_OPTIONS)

Whitespace (JSON_OPTIONS): llguidance's default allows any run of JSON whitespace between tokens,
so a model can emit whitespace forever and never finish the object; each run is bounded to
MAX_WHITESPACE characters (pretty-printed JSON still passes). A keyword llguidance does not
implement is an error ("lenient" off), so an output always validates under the schema as written.
Before llguidance sees a schema, schema_bounds.py bounds its size and depth (llguidance compiles on
the caller's stack).
"""

from __future__ import annotations

import functools
import json

import llguidance

from kvbridge.common.sampling import MAX_SCHEMA_CHARS
from kvbridge.common.text.schema_bounds import bounds_problem

MAX_WHITESPACE = 20  # characters of one whitespace run between JSON tokens
JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}", "lenient": False}
ANY_OBJECT = '{"type": "object"}'  # json_object's schema

_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


@functools.lru_cache(maxsize=64)  # (the router and the node fronts call it on their event loops, per request)
def schema_problem(json_schema: str) -> str | None:
    """None when `json_schema` is a JSON object that llguidance compiles; else a one-line message
    naming the problem. Needs no tokenizer."""
    if len(json_schema) > MAX_SCHEMA_CHARS:
        return f"json_schema is {len(json_schema)} characters; at most {MAX_SCHEMA_CHARS}"
    try:
        schema = json.loads(json_schema)
    except json.JSONDecodeError as e:
        return f"json_schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
    except RecursionError:
        return "json_schema is not valid JSON: nested too deep"
    if not isinstance(schema, dict):
        kind = "null" if schema is None else _JSON_TYPES.get(type(schema), type(schema).__name__)
        return f"json_schema must be a JSON object (a schema), got a JSON {kind}"
    if problem := bounds_problem(schema):  # (before llguidance: past them it may overflow the stack)
        return problem
    try:
        grammar = grammar_of(json_schema)
    except ValueError as e:
        return f"json_schema: {one_line(str(e))}"
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return f"json_schema: {one_line(messages[0] if messages else 'rejected')}" if is_error else None


def unbounded(schema_text: str) -> str | None:
    """bounds_problem of a schema's text; None for text that is not a JSON object (llguidance names that)."""
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        return None
    return bounds_problem(schema) if isinstance(schema, dict) else None


def grammar_of(schema_text: str) -> str:
    """llguidance's grammar for a schema (JSON text), with our options (ValueError: not an object)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=JSON_OPTIONS)


def one_line(message: str) -> str:
    """An llguidance message on one line, without the parser state dump its errors may append."""
    return " ".join(message.split("<state>", 1)[0].split())[:500] or "rejected"
