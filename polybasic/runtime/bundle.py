"""Chain bundles: everything a planned chain needs to run, except the target's weights.

A bundle folder holds:
  manifest.json   schema version; the target by reference (source id + sha256, tokenizer fingerprint);
                  the chain as a typed ChainSpec whose level files are relative to the bundle, each
                  with its sha256; k, thresholds and sampling defaults; the profile and plan it came
                  from; the machine it was measured on; the polybasic version
  levels/         level weights (safetensors): quantized copies, drafter heads
  speculators/    when the level right under the target is an eagle3 head: that head in the speculators
                  format (config.json, model.safetensors), which vLLM serves as the target's eagle3 drafter
  README.md       a model card in Hugging Face conventions
  recipe.yaml     the resolved recipe, when a recipe exported it

`export_bundle` writes one (atomically: a temp folder renamed into place); `check_bundle` reads and
checks a manifest and every file it names, before any model loads: schema version, level kinds,
missing files, damaged safetensors, sha256, the target's identity and tokenizer. `load`
(polybasic.runtime.load) then builds the chain and returns a `BundleDecoder`.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from polybasic import __version__
from polybasic.artifacts import atomic_path
from polybasic.config import SamplingConfig, check_draft_confidence
from polybasic.errors import ConfigError, CorruptFileError, ModelNotFoundError, check
from polybasic.models.eagle_head import load_head
from polybasic.models.loader import folder_and_args, load_model, load_tokenizer, resolve_hf_folder, tokenizer_memo
from polybasic.models.preflight import (HEAD_CONFIG_KEY, check_source, read_json, safetensors_metadata, source_kind,
                                        split_kernel)
from polybasic.models.registry import REGISTRY, gguf_path
from polybasic.models.registry import sha256_file as _sha
from polybasic.models.speculators_format import save_speculators
from polybasic.quant.api import load_any_model
from polybasic.runtime.chain import Chain, check_k
from polybasic.runtime.chain_builder import build_chain
from polybasic.runtime.chainspec import LEVEL_KINDS, ChainSpec, check_chain_files, named
from polybasic.runtime.context import check_device
from polybasic.runtime.hub import resolve_bundle
from polybasic.runtime.model_card import render_model_card
from polybasic.runtime.sampling import make_generator
from polybasic.runtime.text import encode_prompt, eos_ids, stream_text

FORMAT = "polybasic-chain-bundle"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
FILE_LEVEL_KINDS = ("quantized", "eagle")  # levels whose weights travel in the bundle
SPECULATORS = "speculators"  # the bundle's folder of the target's eagle3 head for vLLM
REFERENCE_LEVEL_KINDS = ("model",)  # levels that are other models, by reference like the target


@dataclass(frozen=True)
class Decoding:
    """How the bundle's chain decodes by default (a caller may override the sampling)."""

    k: int = 5  # tokens the bottom level proposes per round
    thresholds: tuple[int, ...] | None = None  # one per middle level; None = k + 1 each
    adaptive_k: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    draft_confidence: float = 0.0  # drafting levels end a draft below this confidence (Chain.draft_confidence)

    def __post_init__(self) -> None:
        check_k(self.k)
        check_draft_confidence(self.draft_confidence)
        if self.thresholds is not None:
            object.__setattr__(self, "thresholds", tuple(int(t) for t in self.thresholds))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["thresholds"] = None if self.thresholds is None else list(self.thresholds)
        return d


@dataclass
class Manifest:
    target: dict  # {source, dtype, sha256, vocab_size, tokenizer_sha256}
    chain: ChainSpec  # level paths relative to the bundle folder
    decoding: Decoding
    files: dict[str, dict] = field(default_factory=dict)  # bundle-relative path -> {sha256, bytes}
    references: dict[str, dict] = field(default_factory=dict)  # model level name -> {source, sha256, ...}
    profile: dict | None = None
    plan: dict | None = None
    machine: dict = field(default_factory=dict)
    recipe: str | None = None  # bundle-relative path of the resolved recipe
    polybasic_version: str = ""
    created: str = ""
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT

    def to_dict(self) -> dict:
        return {"format": self.format, "schema_version": self.schema_version,
                "polybasic_version": self.polybasic_version, "created": self.created,
                "target": self.target, "chain": self.chain.to_dict(), "decoding": self.decoding.to_dict(),
                "files": self.files, "references": self.references, "profile": self.profile,
                "plan": self.plan, "machine": self.machine, "recipe": self.recipe}

    @property
    def predicted_speedup(self) -> float | None:
        return (self.plan or {}).get("predicted_speedup")

    @property
    def planned_compiled(self) -> bool:
        """Whether the plan timed compiled steps: its predicted speedup is then the chain's, compiled, over compiled
        plain decoding (else both eager)."""
        return bool((self.plan or {}).get("compiled", False))


# -- fingerprints ---------------------------------------------------------------------------------
def sha256_file(path: str | Path) -> str:
    return _sha(Path(path))


def source_sha256(source: str) -> str:
    """The sha256 that identifies a model source's weights without loading them: of its GGUF file
    (packaged short names, .gguf), of the file (.safetensors), or over a folder's *.safetensors. A 'NAME@w4a8'
    source runs NAME's weights on another kernel: NAME's."""
    source = split_kernel(source)[0]
    kind = source_kind(source)
    if kind == "registry":
        spec = REGISTRY[source]
        return spec.sha256 or sha256_file(gguf_path(spec))
    if kind in ("gguf", "quantized"):
        return sha256_file(Path(source).expanduser())

    folder = resolve_hf_folder(source)
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{sha256_file(f)}\n".encode())
    return h.hexdigest()


def tokenizer_sha256(tokenizer) -> str:
    """A fingerprint of a tokenizer's vocabulary (token -> id) and its special tokens (kept beside the tokenizer's
    cached copy: models.loader.tokenizer_memo)."""
    return tokenizer_memo(tokenizer, "fingerprint-v1", _fingerprint)


def _fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(getattr(tokenizer, "all_special_tokens", []) or [])
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()


def _model_ref(source: str, dtype: str, tokenizer) -> dict:
    return {"source": source, "dtype": dtype, "sha256": source_sha256(source),
            "vocab_size": len(tokenizer.get_vocab()), "tokenizer_sha256": tokenizer_sha256(tokenizer)}


def _level_config(kind: str, path: Path) -> dict:
    """What a level file says it is, from its header: a quantized copy's scheme, kernel, dtype and
    source; a head's drafter config."""
    meta = safetensors_metadata(path, "export it again")
    if kind == "quantized":
        return {"quant_config": json.loads(meta.get("quant_config", "{}")), "dtype": meta.get("dtype"),
                "source": meta.get("source")}
    return {"drafter_config": json.loads(meta.get(HEAD_CONFIG_KEY, "{}"))}


# -- export ---------------------------------------------------------------------------------------
def export_speculators(folder: str | Path, head_path: str | Path, target_source: str, k: int) -> Path:
    """An eagle3 head file written as a speculators folder that vLLM serves on `target_source` (checked
    against the target's config, no weights load). The verifier it names: the target's Hub id, or the
    local HF folder polybasic resolves it to."""
    hf_folder, args = folder_and_args(target_source)
    verifier = target_source if source_kind(target_source) == "hub" else str(hf_folder)
    return save_speculators(load_head(head_path), folder, verifier, k=k, target=args)


def _eagle3_on_target(chain: ChainSpec, files: dict[str, dict]) -> str | None:
    """The bundle path of the level right under the target when it is an eagle3 head (else None)."""
    first = chain.levels[0] if chain.levels else None
    if first is None or first.kind != "eagle":
        return None
    arch = files[first.path]["config"]["drafter_config"].get("arch", "eagle1")
    return first.path if arch == "eagle3" else None


def export_bundle(folder: str | Path, target_source: str, target_dtype: str, chain: ChainSpec,
                  decoding: Decoding, tokenizer, *, profile: dict | None = None, plan: dict | None = None,
                  recipe_yaml: str | None = None, machine: dict | None = None,
                  level_tokenizers: dict[str, object] | None = None) -> Path:
    """Write a bundle folder for `chain` under the target (atomically; replaces an older bundle).

    tokenizer: the target's; level_tokenizers: {level name: tokenizer} of 'model' levels (other
    models, stored by reference), checked equal to the target's."""
    check_chain_files(chain)
    folder = Path(folder)
    target = _model_ref(target_source, target_dtype, tokenizer)
    files, refs, levels = {}, {}, []
    with atomic_path(folder) as tmp:
        (tmp / "levels").mkdir(parents=True)
        for i, lv in enumerate(chain.levels, 1):
            if lv.kind in FILE_LEVEL_KINDS:
                rel = f"levels/{i}-{lv.kind}.safetensors"
                shutil.copyfile(Path(lv.path).expanduser(), tmp / rel)
                lv = replace(lv, path=rel, name="")  # named by its place in the bundle
                files[rel] = {"sha256": sha256_file(tmp / rel), "bytes": (tmp / rel).stat().st_size,
                              "level": lv.name, "config": _level_config(lv.kind, tmp / rel)}
            elif lv.kind in REFERENCE_LEVEL_KINDS:
                tok = (level_tokenizers or {}).get(lv.name)
                if tok is None:
                    raise ConfigError(f"export: level '{lv.name}' is another model; pass its tokenizer "
                                      "in level_tokenizers")
                refs[lv.name] = _model_ref(lv.source, lv.dtype, tok)
            levels.append(lv)
        if head := _eagle3_on_target(ChainSpec(tuple(levels)), files):
            # vLLM serves the model itself (its own kernels): a 'NAME@w4a8' target's head goes to NAME
            written = export_speculators(tmp / SPECULATORS, tmp / head, split_kernel(target_source)[0], decoding.k)
            for f in sorted(written.iterdir()):
                files[f"{SPECULATORS}/{f.name}"] = {"sha256": sha256_file(f), "bytes": f.stat().st_size,
                                                    "serves": f"the target's eagle3 drafter in vLLM ({head})"}
        manifest = Manifest(target=target, chain=ChainSpec(tuple(levels)), decoding=decoding, files=files,
                            references=refs, profile=profile, plan=plan, machine=machine or {},
                            recipe="recipe.yaml" if recipe_yaml is not None else None,
                            polybasic_version=__version__,
                            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        _check_tokenizers(manifest, Path(tmp))
        if recipe_yaml is not None:
            (tmp / "recipe.yaml").write_text(recipe_yaml)
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")

        (tmp / "README.md").write_text(render_model_card(manifest))
        if folder.exists():
            shutil.rmtree(folder)
    return folder


# -- check and load -------------------------------------------------------------------------------
def read_manifest(folder: str | Path) -> Manifest:
    """The manifest of a bundle folder, its schema and level kinds checked (no other file read)."""
    path = Path(folder) / MANIFEST
    d = read_json(path, "bundle", "pass a folder written by `polybasic export` (or `polybasic run`)",
                  "export the bundle again")
    where = f"bundle: {path}"
    check(isinstance(d, dict) and d.get("format") == FORMAT, where, f"is not a polybasic chain bundle "
          f"manifest (format {d.get('format') if isinstance(d, dict) else None!r})", f"expected format '{FORMAT}'")
    version = d.get("schema_version")
    check(isinstance(version, int), f"{where}: schema_version", f"is {version!r}", "export the bundle again")
    if version > SCHEMA_VERSION:
        raise ConfigError(f"{where}: schema_version {version} is newer than this polybasic "
                          f"({d.get('polybasic_version')} wrote it; this one reads up to {SCHEMA_VERSION}); "
                          "upgrade polybasic (pip install -U polybasic)")
    try:
        with named(f"{where}: chain"):
            chain = ChainSpec.from_dict(d.get("chain"))
        with named(f"{where}: decoding"):
            dec = d.get("decoding") or {}
            decoding = Decoding(**dec)
    except TypeError as e:
        raise ConfigError(f"{where}: decoding: {e}; export the bundle again") from None
    return Manifest(target=d.get("target") or {}, chain=chain, decoding=decoding, files=d.get("files") or {},
                    references=d.get("references") or {}, profile=d.get("profile"), plan=d.get("plan"),
                    machine=d.get("machine") or {}, recipe=d.get("recipe"),
                    polybasic_version=d.get("polybasic_version", ""), created=d.get("created", ""),
                    schema_version=version)


def _check_tokenizers(m: Manifest, folder: Path) -> None:
    """Every level by reference uses the target's tokenizer (as recorded in the manifest)."""
    t = m.target
    for name, ref in m.references.items():
        if (ref.get("vocab_size"), ref.get("tokenizer_sha256")) != (t.get("vocab_size"), t.get("tokenizer_sha256")):
            raise ConfigError(f"bundle: {folder / MANIFEST}: level '{name}' ({ref.get('source')}) has another "
                              f"tokenizer than the target {t.get('source')} (vocabulary {ref.get('vocab_size')} "
                              f"vs {t.get('vocab_size')} tokens); every level must share the target's "
                              "tokenizer: export a chain whose models share it")


def check_bundle(folder: str | Path, verify_target: bool = True) -> Manifest:
    """Read and check a bundle before anything loads; the returned manifest's level paths are
    absolute. verify_target: also check the local target's sha256 and tokenizer (loads the
    tokenizer, not the weights)."""
    folder = Path(folder)
    m = read_manifest(folder)
    where = f"bundle: {folder}"
    levels = []
    for lv in m.chain.levels:
        if lv.kind in FILE_LEVEL_KINDS:
            rel = Path(lv.path)
            path = folder / rel
            if rel.is_absolute() or ".." in rel.parts or not path.is_file():
                raise ModelNotFoundError(f"{where}: level '{lv.name}': file {path} is missing; download or "
                                         "export the whole bundle again")
            lv = replace(lv, path=str(path))
            with named(f"{where}: level '{lv.name}'"):
                LEVEL_KINDS[lv.kind].check_files(lv)  # a damaged or truncated file, by its header
            want = (m.files.get(str(rel)) or {}).get("sha256")
            if want is None:
                raise ConfigError(f"{where}: {MANIFEST} lists no sha256 for {rel}; export the bundle again")
            got = sha256_file(path)
            if got != want:
                raise CorruptFileError(f"{where}: {rel} has sha256 {got}, the manifest says {want}: the file "
                                       "was changed or damaged; download or export the bundle again")
        levels.append(lv)
    m.chain = ChainSpec(tuple(levels), m.chain.version)
    _check_tokenizers(m, folder)
    if verify_target:
        _check_target(m, folder)
    return m


def _check_target(m: Manifest, folder: Path) -> None:
    t = m.target
    source = t.get("source") or ""
    with named(f"bundle: {folder}: target"):
        check_source(source, "source")
    got = source_sha256(source)
    if got != t.get("sha256"):
        raise ConfigError(f"bundle: {folder}: the target '{source}' here has sha256 {got}, the bundle was made "
                          f"for {t.get('sha256')}: another build of the model; install the build the bundle "
                          "names or export the bundle again for this one")

    tok = load_tokenizer(resolve_hf_folder(split_kernel(source)[0]))
    if tokenizer_sha256(tok) != t.get("tokenizer_sha256"):
        raise ConfigError(f"bundle: {folder}: the target '{source}''s tokenizer differs from the one the bundle "
                          "was made with; export the bundle again for this target")


@dataclass
class BundleDecoder:
    """A loaded bundle: the target, its chain, and text in / text out."""

    folder: Path
    manifest: Manifest
    target: object  # models.loader.LoadedModel
    chain: object  # runtime.chain.Chain
    device: str = "cpu"

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def stats(self):
        """Statistics of the last generation (runtime.stats.ChainStats)."""
        return self.chain.stats

    @property
    def predicted_speedup(self) -> float | None:
        return self.manifest.predicted_speedup

    def sampling(self, **overrides):
        d = self.manifest.decoding
        base = {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p}
        return SamplingConfig(**{**base, **{k: v for k, v in overrides.items() if v is not None}})

    def tokens(self, prompt: str | list[int], max_new_tokens: int = 256, *, chat: bool = True,
               seed: int | None = None, **sampling) -> Iterator[int]:
        """New token ids as the target commits them. prompt: text (chat template applied unless
        chat=False) or token ids. sampling: temperature / top_k / top_p overrides."""
        ids = list(prompt) if isinstance(prompt, list) else encode_prompt(self.tokenizer, prompt, chat=chat)
        return self.chain.stream(ids, max_new_tokens, self.sampling(**sampling), make_generator(seed, self.device))

    def stream(self, prompt: str | list[int], max_new_tokens: int = 256, **kw) -> Iterator[str]:
        """Text pieces as they are decoded."""
        return stream_text(self.tokenizer, self.tokens(prompt, max_new_tokens, **kw))

    def generate(self, prompt: str | list[int], max_new_tokens: int = 256, **kw) -> str:
        """The whole answer as text; `stats` describes the run."""
        return "".join(self.stream(prompt, max_new_tokens, **kw))


def load(bundle: str | Path, device: str = "cpu", *, revision: str | None = None,
         verify_target: bool = True, target=None) -> BundleDecoder:
    """Load a chain bundle (a folder or a Hub id, through the HF cache) into a lossless decoder.

    Every check (schema, files, sha256, target identity, tokenizers) runs before any weights load.
    target: the bundle's target already loaded (a models.loader.LoadedModel), to share it.
    Nothing is measured: the bundle's own plan runs (polybasic.planner.replan re-plans it here)."""
    device = str(check_device(device, "device"))  # before any check or load: a missing CUDA fails first
    folder = resolve_bundle(bundle, revision)
    m = check_bundle(folder, verify_target=verify_target)
    source, dtype = m.target["source"], m.target.get("dtype", "float32")
    # a 'NAME@w4a8' target: NAME with its linears on the GGUF's own codes (quant.gguf_w4a8)
    lm = target or (load_any_model if split_kernel(source)[1] else load_model)(source, dtype, device)
    levels = build_chain(m.chain, lm, device, flag=f"bundle {folder}: chain")
    d = m.decoding
    chain = Chain(levels, k=d.k, thresholds=None if d.thresholds is None else list(d.thresholds),
                  eos=eos_ids(lm.tokenizer), adaptive_k=d.adaptive_k, draft_confidence=d.draft_confidence)
    return BundleDecoder(folder, m, lm, chain, device)
