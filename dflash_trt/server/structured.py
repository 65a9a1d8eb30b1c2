"""A request's structured output, as OpenAI's and vLLM's fields say it: response_format (json_object, json_schema),
vLLM's guided_json / guided_regex / guided_choice / guided_grammar and its structured_outputs object, and a
tool_choice that forces calls (vLLM's reading: the answer is JSON the call is made of). No torch."""

from __future__ import annotations

from typing import Any

from dflash_trt.structured_output import StructuredOutput

# vLLM's structured_outputs keys this server reads: StructuredOutput's field names
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# and its options: whitespace in JSON; a fallback to another grammar engine (there is one here)
_STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_fallback")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def from_response_format(v: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's response_format: None for text. ValueError naming what is wrong."""
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r:.80}")
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ValueError("json_schema must be an object holding the schema: {\"name\": ..., \"schema\": {...}}")
    return StructuredOutput(json=spec["schema"])


def from_structured_outputs(v: Any) -> StructuredOutput:
    """vLLM's structured_outputs object ({"json": schema}, {"regex": ...}, ...)."""
    if not isinstance(v, dict):
        raise ValueError(f"structured_outputs must be an object, got {type(v).__name__}")
    unknown = sorted(set(v) - set(_STRUCTURED_KEYS) - set(_STRUCTURED_OPTIONS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not supported (this server reads "
                         f"{', '.join([*_STRUCTURED_KEYS, *_STRUCTURED_OPTIONS])})")
    for option in _STRUCTURED_OPTIONS:
        if not isinstance(v.get(option, False), bool):
            raise ValueError(f"{option} must be true or false, got {v[option]!r:.80}")
    return StructuredOutput(**{k: x for k, x in v.items()
                               if k in _STRUCTURED_KEYS and x is not None and x is not False},
                            any_whitespace=not v.get("disable_any_whitespace", False))


def from_guided(field: str, v: Any) -> StructuredOutput:
    return StructuredOutput(**{GUIDED_FIELDS[field]: v})


def forced_functions(tools: list[dict[str, Any]], function: str | None) -> dict[str, Any]:
    """{name: its parameters' schema} of the functions a tool_choice that forces calls lets the answer call: the one
    it names, or ("required", function None) all of the tools."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    return params if function is None else {function: params[function]}


def forced_call_schema(tools: list[dict[str, Any]], function: str | None, max_calls: int | None) -> dict[str, Any]:
    """The JSON schema of an answer whose tool_choice forces calls: a named function's arguments, or ("required",
    function None) a list of at least one {"name", "parameters"} of the tools (at most max_calls)."""
    params = forced_functions(tools, function)
    if function is not None:
        return params[function]
    # (vLLM's, closed: its keys are the server's own, and a small model's extra ones ran on past max_tokens)
    call = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False} for name, schema in params.items()]
    out: dict[str, Any] = {"type": "array", "minItems": 1, "items": call[0] if len(call) == 1 else {"anyOf": call}}
    if max_calls is not None:
        out["maxItems"] = max_calls
    return out
