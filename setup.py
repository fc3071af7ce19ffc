"""Package discovery: `src/rlbolt` is the package and the top-level `callbacks/` folder
installs as its subpackage `rlbolt.callbacks` (pyproject.toml maps the directories)."""
from setuptools import find_packages, setup

packages = find_packages("src") + ["rlbolt.callbacks"]
packages += ["rlbolt.callbacks." + p for p in find_packages("callbacks")]
setup(packages=packages)
