"""Validate response bodies against OpenAI's published API description.

``assert_conforms(body, "CreateChatCompletionResponse")`` validates with JSON Schema draft 2020-12
against ``tests/data/openai-openapi.yaml`` (OpenAI's published description, MIT licence; see
tests/data/README.md). It marks nullable fields the OpenAPI 3.0 way; they are rewritten to
``anyOf: [schema, {type: null}]``, and a null for a property the schema does not require is read as
leaving it out (OpenAI sends such nulls). The parsed and rewritten document is cached (in memory and as
a pickle next to pytest's cache) because parsing 3 MB of YAML takes seconds.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import pickle
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SPEC_PATH = REPO_ROOT / "tests" / "data" / "openai-openapi.yaml"
_CACHE_DIR = REPO_ROOT / ".pytest_cache" / "openai-schema"


def _rewrite_nullable(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: _rewrite_nullable(v) for k, v in node.items()}
        # OpenAPI keywords without meaning in JSON Schema that could confuse a validator.
        node.pop("discriminator", None)
        if node.pop("nullable", False) is True:
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_rewrite_nullable(v) for v in node]
    return node


@functools.lru_cache(maxsize=1)
def _components() -> dict[str, Any]:
    raw = SPEC_PATH.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:16]
    cached = _CACHE_DIR / f"{digest}.pickle"
    if cached.is_file():
        try:
            return pickle.loads(cached.read_bytes())
        except Exception:
            pass
    spec = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    components = {"components": {"schemas": _rewrite_nullable(spec["components"]["schemas"])}}
    try:
        _CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{id(raw)}")
        tmp.write_bytes(pickle.dumps(components))
        tmp.replace(cached)
    except OSError:
        pass
    return components


@functools.cache
def validator(schema_name: str) -> jsonschema.Draft202012Validator:
    schemas = _components()
    if schema_name not in schemas["components"]["schemas"]:
        raise KeyError(f"no schema named {schema_name!r} in {SPEC_PATH}")
    root = {**schemas, "$ref": f"#/components/schemas/{schema_name}"}
    return jsonschema.Draft202012Validator(root)


def _drop_optional_nulls(body: Any, schema_name: str) -> Any:
    """A null for a property that is not required means "absent" (OpenAI sends ``"x": null``)."""
    return _strip_nulls(copy.deepcopy(body), validator(schema_name).schema, _components(), set())


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    while isinstance(schema, dict) and "$ref" in schema and len(schema) <= 2:
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _required_of(schema: Any, root: dict[str, Any], seen: set[int]) -> tuple[set[str], dict[str, Any]]:
    """Required names and property schemas of an object schema, through allOf/anyOf/$ref."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or id(schema) in seen:
        return set(), {}
    seen = seen | {id(schema)}
    required = set(schema.get("required", ()))
    props = dict(schema.get("properties", {}))
    for key in ("allOf",):
        for sub in schema.get(key, ()):
            r, p = _required_of(sub, root, seen)
            required |= r
            for k, v in p.items():
                props.setdefault(k, v)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, ()):
            r, p = _required_of(sub, root, seen)
            required |= r  # required by some alternative: a null there is meaningful, keep it
            for k, v in p.items():
                props.setdefault(k, v)
    return required, props


def _strip_nulls(body: Any, schema: Any, root: dict[str, Any], seen: set[int]) -> Any:
    if isinstance(body, dict):
        required, props = _required_of(schema, root, set())
        for key in list(body):
            if body[key] is None and key not in required:
                del body[key]
            elif key in props:
                body[key] = _strip_nulls(body[key], props[key], root, seen)
        return body
    if isinstance(body, list):
        schema = _resolve(schema, root)
        items = None
        if isinstance(schema, dict):
            items = schema.get("items")
            for key in ("anyOf", "oneOf"):
                for sub in schema.get(key, ()):
                    sub = _resolve(sub, root)
                    if isinstance(sub, dict) and "items" in sub:
                        items = sub["items"]
        return [_strip_nulls(v, items, root, seen) for v in body] if items is not None else body
    return body


def conformance_errors(body: Any, schema_name: str) -> list[str]:
    cleaned = _drop_optional_nulls(body, schema_name)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator(schema_name).iter_errors(cleaned)
    ]


def assert_conforms(body: Any, schema_name: str) -> None:
    errors = conformance_errors(body, schema_name)
    assert not errors, f"body does not conform to {schema_name}:\n" + "\n".join(errors[:20]) + f"\n{body!r}"
