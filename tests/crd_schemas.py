"""Custom resources checked against the schemas their projects publish in their CRDs
(`tests/fixtures/crds`, sources in its NOTICE), as the API server would check them."""

from __future__ import annotations

import copy
import functools
import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema

CRDS = Path(__file__).resolve().parent / "fixtures" / "crds"


def crd_name(api_version: str, kind: str) -> str:
    """The file name (without `.json.gz`) of a kind's schema: `group_version_Kind`."""
    return f"{api_version.replace('/', '_')}_{kind}"


@functools.cache
def schema(name: str) -> dict[str, Any] | None:
    """A CRD's `openAPIV3Schema` by `crd_name`, None where the project does not hold it."""
    path = CRDS / f"{name}.json.gz"
    return json.loads(gzip.decompress(path.read_bytes())) if path.exists() else None


def problems(doc: Any, crd: dict[str, Any]) -> list[str]:
    """What the API server would refuse in `doc` (schema errors once the schema's defaults are filled in, as it fills
    them in before validating), and the fields it would prune without a word."""
    errors = sorted(jsonschema.Draft7Validator(crd).iter_errors(defaulted(doc, crd)), key=str)
    return ([f"{list(e.absolute_path)}: {e.message}" for e in errors]
            + [f"{field}: unknown field" for field in _unknown_fields(doc, crd)])


def defaulted(doc: Any, crd: dict[str, Any]) -> Any:
    """`doc` with the schema's `default`s set where a field is missing inside an object that is there."""
    if isinstance(doc, dict) and isinstance(crd.get("properties"), dict):
        out = dict(doc)
        for key, sub in crd["properties"].items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = defaulted(out[key], sub)
        return out
    if isinstance(doc, list) and isinstance(crd.get("items"), dict):
        return [defaulted(item, crd["items"]) for item in doc]
    return doc


def _unknown_fields(doc: Any, crd: dict[str, Any], path: str = "") -> list[str]:
    if isinstance(doc, dict) and crd.get("type") == "object":
        if crd.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in crd \
                or "properties" not in crd:  # metadata: the API server checks ObjectMeta itself
            return []
        props = crd.get("properties", {})
        out = [f"{path}.{k}" for k in doc if k not in props]
        return out + [e for k, v in doc.items() if k in props for e in _unknown_fields(v, props[k], f"{path}.{k}")]
    if isinstance(doc, list) and "items" in crd:
        return [e for i, v in enumerate(doc) for e in _unknown_fields(v, crd["items"], f"{path}[{i}]")]
    return []
