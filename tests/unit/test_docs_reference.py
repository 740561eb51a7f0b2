"""The docs' generated reference pages (hack/gen-docs): current, complete, and the check mode
fails on a stale page, as tests/unit/test_crd_reference.py does for the CRD reference."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import yaml

from dynamo.runtime import cli as worker_cli
from dynamo_operator import cli as operator_cli

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import docsgen  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("relative", list(docsgen.GENERATORS), ids=str)
def test_checked_in_page_is_current(relative: Path) -> None:
    path = REPO / relative
    assert path.is_file(), f"{relative} is missing: run hack/gen-docs"
    assert path.read_text() == docsgen.GENERATORS[relative](), (
        f"{relative} is stale: run hack/gen-docs"
    )


def _leaf_paths(tree: object, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict) or not tree:
        return [prefix]
    return [p for key, sub in tree.items() for p in _leaf_paths(sub, f"{prefix}{key}.")]


def test_every_chart_value_is_documented() -> None:
    text = docsgen.values_reference()
    for values_path in sorted((REPO / "helm").glob("*/values.yaml")):
        values = yaml.safe_load(values_path.read_text())
        documented = [
            d.path
            for d in docsgen.parse_values_comments(values_path.read_text())
            if isinstance(d, docsgen.ValueDoc)
        ]
        for leaf in _leaf_paths(values):
            leaf = leaf.rstrip(".")
            owner = [p for p in documented if leaf == p or leaf.startswith(p + ".")]
            assert owner, f"{values_path}: {leaf} has no `# --` comment"
            assert f"| `{owner[0]}` |" in text
        schema = json.loads((values_path.parent / "values.schema.json").read_text())
        assert set(values) <= set(schema["properties"])


def test_values_comments_parse_sections_and_values() -> None:
    text = (
        "# -- top value\n# more\ntop: 1\n\n# A section.\nsec:\n  # -- inner\n  key: a\n"
        "  # -- a documented map\n  map:\n    # -- not listed: part of map's default\n"
        "    deep: 2\n"
    )
    docs = docsgen.parse_values_comments(text)
    assert docs == [
        docsgen.ValueDoc("top", "top value more"),
        docsgen.SectionDoc("sec", "A section."),
        docsgen.ValueDoc("sec.key", "inner"),
        docsgen.ValueDoc("sec.map", "a documented map"),
    ]


def test_every_option_is_in_the_cli_reference() -> None:
    text = docsgen.cli_reference()
    parsers = [worker_cli.build_parser(), operator_cli._parser()]
    for action in parsers[1]._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += list(action._name_parser_map.values())
    flags = [s for p in parsers for a in p._actions for s in a.option_strings if s.startswith("--")]
    assert len(flags) > 30
    missing = [flag for flag in flags if flag != "--help" and f"`{flag}`" not in text]
    assert not missing, f"options missing from docs/reference/cli.md: {missing}"
    for variable in worker_cli._ENV_FOR.values():
        assert f"`{variable}`" in text


def test_the_cli_reference_ignores_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = docsgen.cli_reference()
    monkeypatch.setenv("DYN_LOG", "debug")
    monkeypatch.setenv("DYNAMO_WORKER_IMAGE", "somewhere/else")
    assert docsgen.cli_reference() == before


def test_check_mode_fails_on_a_stale_page(tmp_path: Path) -> None:
    assert docsgen.main([], root=tmp_path) == 0
    assert docsgen.main(["--check"], root=tmp_path) == 0
    page = tmp_path / docsgen.VALUES_REFERENCE
    page.write_text(page.read_text().replace("replicaCount", "replicas"))
    assert docsgen.main(["--check"], root=tmp_path) == 1
    page.unlink()
    assert docsgen.main(["--check"], root=tmp_path) == 1
