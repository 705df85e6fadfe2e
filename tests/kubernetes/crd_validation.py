"""Validate a custom resource against a CRD's openAPIV3Schema the way the API server would: JSON Schema for
structure, then every x-kubernetes-validations CEL rule on the node it is attached to."""

from __future__ import annotations

from pathlib import Path

import celpy
import jsonschema
import yaml

CRDS = Path(__file__).resolve().parents[2] / "manifests" / "crds"


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema for every CRD we ship."""
    out = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd.get("kind") != "CustomResourceDefinition":
            continue
        for version in crd["spec"]["versions"]:
            out[(f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])] = version["schema"][
                "openAPIV3Schema"
            ]
    return out


def _with_defaults(schema: dict, value):
    """Fill in schema defaults, as the API server does before it runs the CEL rules."""
    if isinstance(value, dict):
        value = dict(value)
        for key, child in (schema.get("properties") or {}).items():
            if key not in value and "default" in child:
                value[key] = child["default"]
            if key in value:
                value[key] = _with_defaults(child, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [_with_defaults(schema["items"], item) for item in value]
    return value


def _cel_errors(schema: dict, value, path: str) -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            errors.append(f"{path}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, child in (schema.get("properties") or {}).items():
            if key in value:
                errors += _cel_errors(child, value[key], f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def validate_custom_resource(obj: dict, schemas: dict | None = None) -> list[str]:
    """Problems with `obj`, empty when the API server would accept it."""
    schemas = schemas or crd_schemas()
    schema = schemas.get((obj.get("apiVersion"), obj.get("kind")))
    if schema is None:
        return [f"no CRD for {obj.get('apiVersion')} {obj.get('kind')}"]
    errors = [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]  # fmt: skip
    return errors or _cel_errors(schema, _with_defaults(schema, obj), "")
