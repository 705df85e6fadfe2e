"""Validate CRDs and custom resources offline the way the API server would.

A CRD (`validate_crd`): the approval annotation protected groups need (`*.k8s.io`, `*.kubernetes.io`), the name
`<plural>.<group>`, a structural schema (every node typed, unless it is int-or-string or preserves unknown fields;
no `additionalProperties` beside `properties`; metadata constrained only in name/generateName), CEL rules that
compile, defaults valid against their own node. A custom resource (`validate_custom_resource`): strict decoding
(an unknown field is an error unless the schema preserves unknown fields there), JSON Schema for structure, then
every x-kubernetes-validations CEL rule on its node after defaulting."""

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


def _unknown_fields(schema: dict, value, path: str) -> list[str]:
    """The API server's strict field validation: fields the schema does not declare are errors (ObjectMeta is
    checked by the server itself, not by the CRD's schema)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata":
        return []
    errors = []
    if isinstance(value, dict) and "properties" in schema:
        for key, child in value.items():
            if key not in schema["properties"]:
                errors.append(f'{path or "<root>"}: unknown field "{key}"')
            else:
                errors += _unknown_fields(schema["properties"][key], child, f"{path}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, child in value.items():
            errors += _unknown_fields(schema["additionalProperties"], child, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _unknown_fields(schema["items"], item, f"{path}[{i}]")
    return errors


def validate_custom_resource(obj: dict, schemas: dict | None = None) -> list[str]:
    """Problems with `obj`, empty when the API server would accept it."""
    schemas = schemas or crd_schemas()
    schema = schemas.get((obj.get("apiVersion"), obj.get("kind")))
    if schema is None:
        return [f"no CRD for {obj.get('apiVersion')} {obj.get('kind')}"]
    errors = _unknown_fields(schema, obj, "")
    errors += [
        f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(obj)
    ]
    return errors or _cel_errors(schema, _with_defaults(schema, obj), "")


APPROVAL = "api-approved.kubernetes.io"


def protected_group(group: str) -> bool:
    return group in ("k8s.io", "kubernetes.io") or group.endswith((".k8s.io", ".kubernetes.io"))


def _structural_errors(schema: dict, path: str) -> list[str]:
    errors = []
    typed = (
        "type" in schema
        or schema.get("x-kubernetes-int-or-string")
        or schema.get("x-kubernetes-preserve-unknown-fields")
    )
    if not typed:
        errors.append(f"{path}: type: Required value: must not be empty for specified object fields")
    if "properties" in schema and "additionalProperties" in schema:
        errors.append(f"{path}: additionalProperties and properties are mutual exclusive")
    for key, child in (schema.get("properties") or {}).items():
        child_path = f"{path}.properties[{key}]"
        if path == "openAPIV3Schema" and key == "metadata":
            extra = set(child) - {"type", "description", "properties"}
            extra |= set(child.get("properties") or {}) - {"name", "generateName"}
            if extra:
                errors.append(f"{child_path}: metadata may only restrict name and generateName, not {sorted(extra)}")
        errors += _structural_errors(child, child_path)
    if isinstance(schema.get("items"), dict):
        errors += _structural_errors(schema["items"], f"{path}.items")
    if isinstance(schema.get("additionalProperties"), dict):
        errors += _structural_errors(schema["additionalProperties"], f"{path}.additionalProperties")
    for i, rule in enumerate(schema.get("x-kubernetes-validations") or []):
        try:
            celpy.Environment().compile(rule["rule"])
        except Exception as exc:  # celpy raises its own parse errors
            errors.append(f"{path}.x-kubernetes-validations[{i}].rule: compilation failed: {exc}")
    if "default" in schema:
        node = {k: v for k, v in schema.items() if k != "default"}
        for error in jsonschema.Draft7Validator(node).iter_errors(schema["default"]):
            errors.append(f"{path}.default: {error.message}")
    return errors


def validate_crd(crd: dict) -> list[str]:
    """Problems the API server would reject `crd` for (apiextensions.k8s.io/v1), empty when it would accept it."""
    errors = []
    spec, metadata = crd.get("spec") or {}, crd.get("metadata") or {}
    group, plural = spec.get("group", ""), (spec.get("names") or {}).get("plural", "")
    if metadata.get("name") != f"{plural}.{group}":
        errors.append(f'metadata.name: must be spec.names.plural+"."+spec.group ({plural}.{group})')
    if protected_group(group):
        value = (metadata.get("annotations") or {}).get(APPROVAL)
        if not value:
            errors.append(
                f"metadata.annotations[{APPROVAL}]: Required value: protected groups must have approval annotation"
            )
        elif not value.startswith(("https://", "http://", "unapproved")):
            errors.append(f"metadata.annotations[{APPROVAL}]: must be a URL or start with 'unapproved'")
    versions = spec.get("versions") or []
    if sum(1 for v in versions if v.get("storage")) != 1:
        errors.append("spec.versions: exactly one version must be the storage version")
    for version in versions:
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            errors.append(f"spec.versions[{version.get('name')}].schema.openAPIV3Schema: Required value")
            continue
        if schema.get("type") != "object":
            errors.append(f"spec.versions[{version.get('name')}]: the root type must be object")
        errors += [
            f"spec.versions[{version.get('name')}].schema.{e}" for e in _structural_errors(schema, "openAPIV3Schema")
        ]
    return errors
