"""Every top-level module's and dev/ script's width rule, as gmts.py's (tests aside): at most 5% of
its lines over 100 characters, and no joined statements (`a; b`, or a body on its header's line:
`if x: y`). A docstring squeezed to meet the count is not caught here: a reader catches it."""
import ast
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = sorted(os.path.join(folder, name)
                 for folder in ("", "dev") for name in os.listdir(os.path.join(HERE, folder))
                 if name.endswith(".py") and not name.startswith("test_"))


def joined_statements(source: str) -> list:
    """The line numbers where a statement starts on a line another one holds: a second statement
    after `;`, or a compound statement's first body statement on its header's line."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        for field in ("body", "orelse", "finalbody", "handlers"):
            stmts = getattr(node, field, None)
            if not (isinstance(stmts, list) and stmts
                    and isinstance(stmts[0], (ast.stmt, ast.excepthandler))):
                continue
            header = isinstance(node, (ast.stmt, ast.excepthandler)) and field == "body"
            if header and stmts[0].lineno == node.lineno:
                lines.add(node.lineno)
            lines.update(b.lineno for a, b in zip(stmts, stmts[1:]) if b.lineno == a.end_lineno)
    return sorted(lines)


def test_joined_statements_are_found():
    source = "x = 1; y = 2\nif x: y = 3\ndef f():\n    return [1,\n            2]\nwith a: b\n"
    assert joined_statements(source) == [1, 2, 6]


@pytest.mark.parametrize("name", MODULES)
def test_at_most_5_percent_of_lines_over_100_characters(name):
    with open(os.path.join(HERE, name)) as f:
        lines = f.read().splitlines()
    wide = [i for i, line in enumerate(lines, 1) if len(line) > 100]
    assert len(wide) <= 0.05 * len(lines), f"{name}: {len(wide)} of {len(lines)} lines: {wide[:5]}"


@pytest.mark.parametrize("name", MODULES)
def test_no_joined_statements(name):
    with open(os.path.join(HERE, name)) as f:
        assert joined_statements(f.read()) == [], name
