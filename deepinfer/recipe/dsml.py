"""Tool calls in DeepSeek's DSML markup as a structured-output constraint.

The official encodings write an assistant's tool calls as DSML blocks (V4.1 shown; V4 writes the tag
names `tool_calls`, `invoke` and `parameter` right after the marker, without the space):

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

where `｜DSML｜` is one special token, a string parameter is written as it is and any other as JSON.
A request whose `tool_choice` forces a call ("required", a named function; Anthropic's "any" or a named
tool) ends its prompt with the opening `<｜DSML｜ calls>` line, and the recipe's `OutputConstraint`
(kind `tool_call_required`) lists the tools the call may name. `calls_constraint` turns that list into
a Lark grammar for llguidance (`SamplingParams.structured`): 1 to MAX_CONSTRAINED_CALLS invokes, each of
an allowed function, its parameters in the schema's property order, the required ones present, each
value valid under its property's schema, then the closing tag. A parameter is written as the encodings write it: a string value
with `string="true"`, as it is (it ends at the first `</` followed by the marker), any other value with
`string="false"` as JSON spaced as the encodings write it (`", "` and `": "`). The constraint checks a
string written as text with a regex where one says what the schema allows (any text, a length range up
to MAX_TEXT_LENGTH, an enum or const of strings); where none does (a pattern, a format, a longer
bound) the string is written as JSON checked by its schema, which the official parser reads back as
the same value, and so is every value that is not a string. So the recipe's `StreamProcessor` parses every
constrained turn into tool calls whose arguments validate against the tools' schemas.
"""

from __future__ import annotations

import json

from deepinfer.errors import DeepInferError

MARKER = "｜DSML｜"
TAGS = {  # by official encoding: the calls block's, an invoke's and a parameter's tag after the marker
    "v4": ("tool_calls", "invoke", "parameter"),
    "v41": (" calls", " invoke", " parameter"),
}
EMPTY_INVOKE = {"v4": "", "v41": "\n"}  # what an invoke without parameters holds between its tags
MAX_CONSTRAINED_CALLS = 8  # invokes a constrained turn may make
TEXT_STRING_KEYS = {"type", "description", "title", "minLength", "maxLength", "default", "examples"}
MAX_TEXT_LENGTH = 1024  # a longer maxLength is checked by the JSON branch (a counted repeat that large is slow)
REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as the encodings write JSON


class ToolCallConstraintError(DeepInferError, ValueError):
    """Tools the DSML constraint cannot be made from."""


def calls_constraint(tools_json: str, encoding: str, marker_id: int) -> dict:
    """The Lark constraint (`SamplingParams.structured`) of a turn that continues a prompt ending in the
    opening calls tag: the invokes of the tools in `tools_json` (the recipe's `OutputConstraint.schema`:
    a JSON array of Chat Completions function tools), then the closing tag. `marker_id` is the
    tokenizer's id of the `｜DSML｜` special token, which the grammar names by id."""
    calls_tag, invoke_tag, parameter_tag = TAGS[encoding]
    marker = f"<[{marker_id}]>"
    functions = _functions(tools_json)
    lines = [f'start: invoke~1..{MAX_CONSTRAINED_CALLS} "</" {marker} {json.dumps(calls_tag + ">")}',
             "invoke: " + " | ".join(f"invoke_{k}" for k in range(len(functions)))]
    for k, (name, parameters) in enumerate(functions):
        opening = json.dumps(f'{invoke_tag} name="{name}">\n')
        properties = _properties(name, parameters)
        for j, (key, schema, _) in enumerate(properties):
            lines += _parameter(f"param_{k}_{j}", key, schema, marker, parameter_tag)
        lines.append(f"params_{k}: " + _parameter_lists(k, [required for _, _, required in properties],
                                                        EMPTY_INVOKE[encoding]))
        invoke_end = json.dumps(invoke_tag + ">\n")
        lines.append(f'invoke_{k}: "<" {marker} {opening} params_{k} "</" {marker} {invoke_end}')
    return {"grammar": "\n".join(lines) + "\n", "syntax": "lark"}


def _parameter_lists(k: int, required: list[bool], empty: str) -> str:
    """The parameter lists function `k` may write, in the schema's order, every required one present:
    as one sequence of optional items where it has a required parameter, else the empty list (which the
    encoding writes as `empty`) or a list whose first present parameter is each one in turn."""
    items = [f"param_{k}_{j}" + ("" if needed else "?") for j, needed in enumerate(required)]
    if any(required):
        return " ".join(items)
    firsts = [" ".join([f"param_{k}_{j}", *items[j + 1:]]) for j in range(len(items))]
    return " | ".join([*firsts, json.dumps(empty) if empty else '""'])


def _parameter(rule: str, key: str, schema: object, marker: str, tag: str) -> list[str]:
    """The Lark rules of one parameter: a text branch (`string="true"`, the value as it is) for the
    strings the schema allows where a regex can say which, and a JSON branch (`string="false"`) for
    every other value, or for every value where the strings are constrained otherwise."""
    closing = json.dumps(tag + ">\n")
    text = _text_value(schema)
    lines, branches = [], []
    if text is not None:
        head = json.dumps(f'{tag} name="{key}" string="true">')
        lines.append(f"{rule.upper()}_TEXT: /{text}<\\//")
        branches.append(f'"<" {marker} {head} {rule.upper()}_TEXT {marker} {closing}')
    if text is None or not _only_strings(schema):
        head = json.dumps(f'{tag} name="{key}" string="false">')
        written = {**schema, "x-guidance": JSON_STYLE} if isinstance(schema, dict) else schema
        lines.append(f"{rule}_json: %json {json.dumps(written, sort_keys=True)}")
        branches.append(f'"<" {marker} {head} {rule}_json "</" {marker} {closing}')
    return [*lines, f"{rule}: " + " | ".join(branches)]


def _text_value(schema: object) -> str | None:
    """A regex of the strings `schema` allows, written as text, or None where it allows none or a regex
    here would not say which (a pattern, a format, a long length bound: the JSON branch checks those)."""
    if not isinstance(schema, dict):
        return r"(?s:.*)" if schema is True else None
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        strings = [v for v in values if isinstance(v, str)] if isinstance(values, list) else []
        return "(?:" + "|".join(_literal(v) for v in strings) + ")" if strings else None
    types = schema.get("type", "string")
    if "string" not in (types if isinstance(types, list) else [types]) or not set(schema) <= TEXT_STRING_KEYS:
        return None
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if high is None:
        return r"(?s:.*)" if low == 0 else f"(?s:.{{{low},}})"
    return f"(?s:.{{{low},{high}}})" if isinstance(high, int) and high <= MAX_TEXT_LENGTH else None


def _only_strings(schema: object) -> bool:
    """Whether every value `schema` allows is a string (so the text branch alone writes them all)."""
    if not isinstance(schema, dict):
        return False
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return isinstance(values, list) and all(isinstance(v, str) for v in values)
    return schema.get("type", None) == "string"


def _literal(text: str) -> str:
    """`text` as a regex that matches it alone (Rust's regex syntax, inside a Lark /.../ literal)."""
    return "".join("\\" + c if c in REGEX_SPECIAL else c for c in text)


def _functions(tools_json: str) -> list[tuple[str, dict]]:
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as err:
        raise ToolCallConstraintError(f"the tool list is not JSON ({err.msg})") from None
    functions = []
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters") or {"type": "object"}
            if not isinstance(parameters, dict):
                raise ToolCallConstraintError(f"tool {function['name']!r}: parameters must be a JSON Schema object")
            functions.append((function["name"], parameters))
    if not functions:
        raise ToolCallConstraintError("a tool-call constraint needs a function tool")
    return functions


def _properties(name: str, parameters: dict) -> list[tuple[str, object, bool]]:
    """(key, schema, required) of a function's parameters, in the schema's order."""
    properties = parameters.get("properties", {})
    required = parameters.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise ToolCallConstraintError(f"tool {name!r}: parameters need an object of properties and a list required")
    if missing := [key for key in required if key not in properties]:
        raise ToolCallConstraintError(f"tool {name!r}: required parameter {missing[0]!r} has no property schema")
    for key in properties:
        if not isinstance(key, str) or '"' in key or MARKER in key:
            raise ToolCallConstraintError(f"tool {name!r}: parameter name {key!r} cannot be written in DSML")
    return [(key, schema, key in required) for key, schema in properties.items()]
