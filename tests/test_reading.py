"""README.md's "Read the code" gives the sizes tests/read_the_code.py measures, not typed ones."""
from pathlib import Path

import read_the_code


def test_the_readmes_sizes_are_the_measured_ones():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    opening = "<!-- sizes: python tests/read_the_code.py -->\n"
    start, end = readme.index(opening) + len(opening), readme.index("<!-- /sizes -->")
    assert readme[start:end].strip() == read_the_code.tables(), "run python tests/read_the_code.py and paste its output"
