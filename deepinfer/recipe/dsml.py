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
value valid under its property's schema, then the closing tag. A property whose schema is exactly a
string (`{"type": "string"}`, with at most a description or title) is written with `string="true"`; its
value is any text, which ends at the first `</` followed by the marker. Every other property, a
constrained string too, is written with `string="false"` as JSON checked by its schema, spaced as the
encodings write it (`", "` and `": "`), which the official parser reads back as the same value. So the recipe's `StreamProcessor` parses every
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
MAX_CONSTRAINED_CALLS = 8  # invokes a constrained turn may make
PLAIN_STRING_KEYS = {"type", "description", "title"}
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
             "invoke: " + " | ".join(f"invoke_{k}" for k in range(len(functions))),
             r"TEXT_VALUE: /(?s:.*)<\//"]
    for k, (name, parameters) in enumerate(functions):
        opening = json.dumps(f'{invoke_tag} name="{name}">\n')
        items = []
        for j, (key, schema, required) in enumerate(_properties(name, parameters)):
            rule = f"param_{k}_{j}"
            items.append(rule if required else f"{rule}?")
            closing = json.dumps(parameter_tag + ">\n")
            if _plain_string(schema):
                head = json.dumps(f'{parameter_tag} name="{key}" string="true">')
                lines.append(f'{rule}: "<" {marker} {head} TEXT_VALUE {marker} {closing}')
            else:
                head = json.dumps(f'{parameter_tag} name="{key}" string="false">')
                written = {**schema, "x-guidance": JSON_STYLE} if isinstance(schema, dict) else schema
                lines.append(f"{rule}_value: %json {json.dumps(written, sort_keys=True)}")
                lines.append(f'{rule}: "<" {marker} {head} {rule}_value "</" {marker} {closing}')
        body, invoke_end = " ".join(items), json.dumps(invoke_tag + ">\n")
        lines.append(f'invoke_{k}: "<" {marker} {opening} {body} "</" {marker} {invoke_end}')
    return {"grammar": "\n".join(lines) + "\n", "syntax": "lark"}


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


def _plain_string(schema: object) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string" and set(schema) <= PLAIN_STRING_KEYS
