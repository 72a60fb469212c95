"""The package as a user meets it: documented names, stubs beside them, `python -m petrel`."""

import inspect
import pathlib
import subprocess
import sys

import petrel


def test_every_public_name_has_a_docstring():
    missing = []
    for name in petrel.__all__:
        obj = getattr(petrel, name)
        if name != "__version__" and not inspect.getdoc(obj):
            missing.append(name)
        if inspect.isclass(obj):
            missing += [f"{name}.{attr}" for attr, value in vars(obj).items()
                        if not attr.startswith("_") and not inspect.getdoc(value)]
    assert missing == []


def test_the_stubs_and_py_typed_are_installed():
    package = pathlib.Path(petrel.__file__).parent
    assert (package / "py.typed").exists()
    stubs = (package / "_petrel.pyi").read_text()
    for name in ("class Log", "class Queue", "class Client", "class Subscription", "def subscribe_group",
                 "def serve", "def call"):
        assert name in stubs


def test_python_dash_m_petrel(tmp_path):
    out = subprocess.run([sys.executable, "-m", "petrel", "--help"], capture_output=True, text=True, check=True)
    assert "usage" in out.stdout.lower()
    version = subprocess.run([sys.executable, "-m", "petrel", "--version"], capture_output=True, text=True, check=True)
    assert petrel.__version__ in version.stdout
