"""Write the JSON Schema of every contract into contracts/schemas/.

Run ``python -m contracts.generate`` after changing a model; a test fails while the checked-in
schemas differ from what this produces.
"""

from __future__ import annotations

import json
from pathlib import Path

from contracts import REGISTRY, Envelope

SCHEMA_DIR = Path(__file__).parent / "schemas"


def render_schemas() -> dict[str, str]:
    out: dict[str, str] = {
        "envelope.json": json.dumps(Envelope.model_json_schema(), indent=2, sort_keys=True) + "\n"
    }
    for type_, version, model in REGISTRY.contracts():
        schema = model.model_json_schema()
        schema["$id"] = f"sluice:{type_}:v{version}"
        out[f"{type_}.v{version}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def main() -> None:
    SCHEMA_DIR.mkdir(exist_ok=True)
    wanted = render_schemas()
    for stale in SCHEMA_DIR.glob("*.json"):
        if stale.name not in wanted:
            stale.unlink()
    for name, text in wanted.items():
        (SCHEMA_DIR / name).write_text(text)
    print(f"wrote {len(wanted)} schemas to {SCHEMA_DIR}")


if __name__ == "__main__":
    main()
