import re

from tests.helpers import ROOT


def test_the_readme_documents_every_environment_variable() -> None:
    sources = [ROOT / "kvrun" / "settings.py", ROOT / "kvrun" / "launcher.py",
               ROOT / "engine" / "devices.py"]
    used = set()
    for path in sources:
        text = path.read_text()
        used |= set(re.findall(r'env\.\w+\(\s*"([A-Z_]+)"', text))
        used |= set(re.findall(r'env(?:iron)?\.get\(\s*"([A-Z_]+)"', text))
        used |= set(re.findall(r'environ\[\s*"([A-Z_]+)"\]', text))
    used -= {"DJANGO_SETTINGS_MODULE", "XDG_RUNTIME_DIR"}
    readme = (ROOT / "README.md").read_text()

    assert used, "found no variables: the pattern is wrong"
    missing = sorted(name for name in used if f"`{name}`" not in readme)
    assert not missing, f"README's configuration table lacks {missing}"
