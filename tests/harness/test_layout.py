"""`python -m harness.layout`: lines per package, the largest definitions and the import cycles of a checkout, read
from its files."""

import textwrap

from harness import layout


def write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_cycles_are_the_strongly_connected_components():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert layout.cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert layout.cycles({"a": {"b"}, "b": set()}) == []


def test_a_checkout_with_a_registration_circle(tmp_path):
    """A package whose __init__ imports its plugins, each of which imports the framework, which imports the package
    (relative and absolute imports alike): one cycle; lines and definitions counted per package."""
    write(
        tmp_path,
        {
            "epp/__init__.py": "",
            "epp/framework.py": "from epp import plugins\n\n\nclass Plugin:\n    pass\n",
            "epp/plugins/__init__.py": "from . import one, two\n",
            "epp/plugins/one.py": "from epp.framework import Plugin\n\n\ndef score():\n    a = 1\n    return a\n",
            "epp/plugins/two.py": "import epp.framework\n",
            "epp/leaf.py": "import json\n",
            "harness/__init__.py": "from epp import leaf\n",
            "harness/template.tmpl": "x\ny\n",
        },
    )
    graph = layout.imports(tmp_path)
    assert graph["harness"] == {"epp", "epp.leaf"}
    assert layout.cycles(graph) == [["epp.framework", "epp.plugins", "epp.plugins.one", "epp.plugins.two"]]
    python, other = layout.line_counts(tmp_path)
    assert python["epp"] == 14 and python["epp/plugins"] == 8 and other["harness"] == 2
    (score,) = [d for d in layout.definitions(tmp_path) if d.kind == "function"]
    assert score == layout.Definition("function", "epp.plugins.one:score", 3)
    text = layout.report(tmp_path, top=5)
    assert "import cycles: 1" in text and "largest classes" in text
