"""Chain bundles on the Hugging Face Hub: push a bundle folder, resolve a Hub id to a local folder.

A bundle is an ordinary Hub model repository (manifest.json, level safetensors, README.md model
card, recipe.yaml). Downloads go through the HF cache, so a bundle fetched once (or copied into the
cache) loads offline with HF_HUB_OFFLINE=1.
"""
from __future__ import annotations

from pathlib import Path

from polybasic.errors import ModelNotFoundError, PolybasicError

MANIFEST = "manifest.json"


def is_hub_id(source: str) -> bool:
    """owner/name that is not a local path."""
    return source.count("/") == 1 and not source.startswith((".", "/", "~")) and not Path(source).exists()


def resolve_bundle(source: str | Path, revision: str | None = None) -> Path:
    """A local bundle folder for a folder path or a Hub id (through the HF cache)."""
    p = Path(source).expanduser()
    if p.is_dir():
        return p
    if not is_hub_id(str(source)):
        raise ModelNotFoundError(f"bundle: {source} is neither a bundle folder nor a Hub id (owner/name); "
                                 "pass the folder `polybasic export` wrote or a Hub repository id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(source), revision=revision))
    except Exception as e:  # offline without a cached copy, unknown repo, no network
        raise ModelNotFoundError(
            f"bundle: Hub id '{source}' is not in the local Hugging Face cache and could not be downloaded "
            f"({type(e).__name__}); download it on a connected machine (it is then cached) or pass a "
            "local bundle folder") from None


def push_bundle(folder: str | Path, repo_id: str, private: bool = False, token: str | None = None,
                api=None) -> str:
    """Create the Hub model repo (if needed) and upload the bundle folder; returns the commit URL.

    api: an `huggingface_hub.HfApi`-like object (tests pass a recorder)."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise ModelNotFoundError(f"push: {folder} has no {MANIFEST}; pass a folder written by "
                                 "`polybasic export` (or `polybasic run`)")
    if not is_hub_id(repo_id):
        raise ModelNotFoundError(f"push: REPO_ID '{repo_id}' is not a Hub id; spell it owner/name")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message="polybasic chain bundle",
                                 ignore_patterns=[".*", "*.partial"])
    except Exception as e:  # network, authentication, permissions: huggingface_hub's many error types
        raise PolybasicError(f"push: uploading {folder} to {repo_id} failed ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); check the network and your "
                             "token (`hf auth login` or HF_TOKEN)") from None
    return str(getattr(info, "commit_url", info))
