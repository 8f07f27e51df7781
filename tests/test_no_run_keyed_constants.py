"""No constant of the cost model or the planner is keyed by a published run or its source: no string in
their code names a run or a source of benchmarks/data/published_runs.toml, so no run can be priced by a
rule of its own (benchmarks/loso.py's leave-one-source-out validation relies on it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).parent.parent
RUNS = tomllib.loads((ROOT / "benchmarks" / "data" / "published_runs.toml").read_text())["run"]


def _keys() -> set[str]:
    keys = {r["name"].lower() for r in RUNS}
    keys |= {r.get("source_id", r["source"].split(":", 1)[0]).lower() for r in RUNS}
    return keys


def _code_strings(path: Path) -> list[str]:
    """Every string literal of a module that is not a docstring."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def _offenders(strings: list[str]) -> list[str]:
    keys = _keys()
    pattern = re.compile("|".join(rf"(?<![\w-]){re.escape(k)}(?![\w-])" for k in sorted(keys, key=len, reverse=True)))
    return [m.group(0) for s in strings if (m := pattern.search(s.lower()))]


# where a framework's name is a file format, not a key of a rule: export/import (autopar/interop) and the CLI
# flags that name those formats (`export --to torchtitan`, `estimate --from`); they price nothing themselves
FORMATS = ("autopar/interop/", "autopar/cli/cmd_export.py", "autopar/cli/cmd_estimate.py", "autopar/cli/from_flags.py")


def test_no_code_string_names_a_published_run_or_source():
    hits = []
    for package in ("autopar", "cost_models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if str(path.relative_to(ROOT)).startswith(FORMATS):
                continue
            hits += [f"{path.relative_to(ROOT)} names {k!r}" for k in _offenders(_code_strings(path))]
    assert not hits, "constants keyed by a published run or source:\n" + "\n".join(hits)


def test_no_catalog_entry_is_a_published_run():
    keys = _keys()
    for path in sorted((ROOT / "cost_models" / "catalog").glob("*.toml")):
        doc = tomllib.loads(path.read_text())
        names = {k.lower() for k in doc} | {str(v.get("name", "")).lower() for v in doc.values() if isinstance(v, dict)}
        assert not names & keys, f"{path.name} has entries named after published runs: {sorted(names & keys)}"


def test_the_check_catches_a_rule_keyed_by_a_run(tmp_path):
    # the check is not vacuous: a table keyed by a run's name, or a source's, is caught
    src = tmp_path / "rule.py"
    src.write_text(f"FACTOR = {{{RUNS[0]['name']!r}: 0.9}}\nSOURCE = {RUNS[-1]['source_id']!r}\n")
    assert sorted(_offenders(_code_strings(src))) == sorted([RUNS[0]["name"], RUNS[-1]["source_id"]])
