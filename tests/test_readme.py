"""CI must run exactly the README's test command."""
import re

from conftest import REPO


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    blocks = _bash_blocks(readme[readme.index("## Run the tests"):])
    test_cmd = blocks[0].strip()
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_cmd


def test_readme_demo_uses_a_recipe_that_exists():
    readme = (REPO / "README.md").read_text()
    demo = _bash_blocks(readme)[0]
    for path in re.findall(r"recipes/[\w.-]+", demo):
        assert (REPO / path).is_file(), path
